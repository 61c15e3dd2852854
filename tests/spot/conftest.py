"""Fixtures of the spot tests: a fake cloud metadata server on loopback (the OPD helpers, tiny
PEFT student and S3 fault proxy are in tests/conftest.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_metadata import FakeMetadataServer  # noqa: E402


@pytest.fixture
def metadata_server():
    """A fake AWS IMDSv2 + GCE metadata server on 127.0.0.1 (no notice until the test posts one)."""
    server = FakeMetadataServer()
    try:
        yield server
    finally:
        server.stop()
