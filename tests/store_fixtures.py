"""Store-location fixtures shared by the CLI and retention tests: a clean local or S3 (moto server)
store location.

S3 stores share one aiobotocore session (as in tests/opd): each store still builds its own s3fs
instance and talks HTTP to moto, but botocore's service model is parsed once. Import the fixtures
into a directory's conftest (``from store_fixtures import aio_session, backend``).
"""

from __future__ import annotations

import pytest

from backends import Backend


@pytest.fixture(scope="session")
def aio_session():
    import aiobotocore.session

    return aiobotocore.session.AioSession()


def with_session(backend: Backend, session) -> Backend:
    if backend.name != "s3":
        return backend
    return Backend("s3", backend.url, dict(backend.storage_options, session=session))


@pytest.fixture(params=("local", "s3"))
def backend(request, tmp_path, aio_session) -> Backend:
    """A clean store location on local disk and on S3 (moto server)."""
    return with_session(request.getfixturevalue(f"{request.param}_backend"), aio_session)
