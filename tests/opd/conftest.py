"""Fixtures of the OPD checkpoint tests: ``opd_backend`` over local, memory and S3 (moto server).

The helpers (``opd``, ``peft_factory``, ``opd_s3_backend``, ``s3_fault_proxy``) are in
tests/conftest.py, shared with the spot tests; the small real objects are in
:mod:`opd_testkit.opd`.
"""

from __future__ import annotations

import pytest
from store_fixtures import backend_named

OPD_BACKENDS = ("local", "memory", "s3")


@pytest.fixture(params=OPD_BACKENDS)
def opd_backend(request):
    """A clean store location on local, memory and S3 (moto server)."""
    return backend_named(request, request.param)
