"""Fixtures of the CLI tests: a clean local or S3 (moto server) store location and its CLI options."""

from __future__ import annotations

import pytest
from cli_helpers import cli_store_args
from store_fixtures import backend  # noqa: F401 - a fixture


@pytest.fixture
def store_args(backend) -> list[str]:
    return cli_store_args(backend)
