"""Fixtures of the core store tests (the backends themselves come from tests/conftest.py)."""

from __future__ import annotations

import pytest

from .helpers import Raw


@pytest.fixture
def raw(backend, request) -> Raw:
    """An independent view of ``backend`` (fresh fsspec instance per call; boto3 for S3)."""
    from store_fixtures import s3_server

    moto = s3_server(request, backend) if backend.name == "s3" else None
    return Raw(backend, moto)
