"""Fixtures of the CLI tests: a clean local or S3 (moto server) store location.

S3 stores share one aiobotocore session (as in tests/opd): each store still builds its own s3fs
instance and talks HTTP to moto, but botocore's service model is parsed once.
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


def cli_store_args(backend: Backend) -> list[str]:
    """The command-line store options that reach ``backend`` (moto: endpoint and test keys)."""
    if backend.name != "s3":
        return []
    options = backend.storage_options
    return [
        "--s3-endpoint-url", options["endpoint_url"],
        "--storage-option", f"key={options['key']}",
        "--storage-option", f"secret={options['secret']}",
        "--storage-option", "client_kwargs.region_name=us-east-1",
    ]


@pytest.fixture
def store_args(backend) -> list[str]:
    return cli_store_args(backend)
