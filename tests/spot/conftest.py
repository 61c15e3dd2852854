"""Fixtures for the spot tests (issue 8): the OPD fixtures of ``tests/opd/conftest.py`` (tiny PEFT
student, small training objects, S3 fault proxy) and a fake cloud metadata server on loopback."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).parent
sys.path.insert(0, str(_HERE))

_spec = importlib.util.spec_from_file_location("opd_fixtures", _HERE.parent / "opd" / "conftest.py")
opd_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(opd_fixtures)

# Re-exported so pytest registers them for tests/spot.
aio_session = opd_fixtures.aio_session
opd_s3_backend = opd_fixtures.opd_s3_backend
opd = opd_fixtures.opd
peft_factory = opd_fixtures.peft_factory
s3_fault_proxy = opd_fixtures.s3_fault_proxy

from fake_metadata import FakeMetadataServer  # noqa: E402


@pytest.fixture
def metadata_server():
    """A fake AWS IMDSv2 + GCE metadata server on 127.0.0.1 (no notice until the test posts one)."""
    server = FakeMetadataServer()
    try:
        yield server
    finally:
        server.stop()
