"""Fixtures of the scenario tests (the backends come from tests/conftest.py)."""

from __future__ import annotations

import pytest

from .helpers import open_store


@pytest.fixture
def store(backend):
    """A clean ``CheckpointStore`` on ``backend`` (local, memory, S3 on moto, GCS on fake-gcs-server)."""
    return open_store(backend)
