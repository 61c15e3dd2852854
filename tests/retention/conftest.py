"""Fixtures of the retention tests: a clean local or S3 (moto server) store location."""

from __future__ import annotations

from store_fixtures import backend  # noqa: F401 - a fixture

