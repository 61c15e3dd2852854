"""Store-location fixtures shared by the CLI and retention tests: a clean local or S3 (moto server)
store location whose S3 stores share the process's aiobotocore session (import the fixture into a
directory's conftest: ``from store_fixtures import backend``), and :func:`backend_named`, the
locations of the OPD and spot tests.
"""

from __future__ import annotations

import pytest
from opd_testkit.stores import Backend, with_session


@pytest.fixture(params=("local", "s3"))
def backend(request, tmp_path) -> Backend:
    """A clean store location on local disk and on S3 (moto server)."""
    return with_session(request.getfixturevalue(f"{request.param}_backend"))


def s3_server(request, backend: Backend):
    """The server (moto or SeaweedFS: boto3 client, buckets) behind an ``s3`` ``backend``."""
    return request.getfixturevalue("seaweed_s3" if backend.server == "seaweed" else "moto_s3")


def backend_named(request, name: str) -> Backend:
    """The clean ``local``, ``memory`` or ``s3`` location of the OPD tests (S3 stores share the
    process's aiobotocore session)."""
    if name == "local":
        return request.getfixturevalue("local_backend")
    if name == "s3":
        return request.getfixturevalue("opd_s3_backend")
    if name == "memory":
        return Backend("memory", "memory://opd-test/runs/opd", {})
    raise ValueError(name)
