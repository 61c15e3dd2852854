"""Fixtures of the retention tests: a clean local or S3 (moto server) store location."""

from __future__ import annotations

from store_fixtures import aio_session, backend  # noqa: F401 - fixtures

