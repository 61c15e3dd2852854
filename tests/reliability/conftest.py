"""Fixtures of the reliability tests (crashes, transient faults, hostile input): S3 behind the
fault proxy of :mod:`opd_testkit.proxies`."""

from __future__ import annotations

import pytest
from opd_testkit.proxies import S3FaultProxy, through_proxy

# s3fs's default block is 50 MiB; 5 MiB (S3's smallest part) makes a multipart payload cheap.
BLOCK_BYTES = 5 << 20


@pytest.fixture
def botocore_backoff(monkeypatch) -> list[float]:
    """botocore's waits between the attempts of an S3 request (seconds), recorded instead of slept:
    a test about which requests are retried and what lands need not wait out botocore's jittered
    exponential back-off (up to 1 s before the first retry, 2 s before the second...). s3fs's client
    is aiobotocore's, whose endpoint sleeps in ``AioEndpoint._sleep`` and nowhere else."""
    import asyncio

    from aiobotocore.endpoint import AioEndpoint

    waits: list[float] = []

    async def recorded_sleep(self, seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0)

    monkeypatch.setattr(AioEndpoint, "_sleep", recorded_sleep)
    return waits


@pytest.fixture
def s3_proxy(moto_s3):
    """A clean bucket on moto reached through :class:`S3FaultProxy`; yields (Backend, proxy).

    The backend's storage options point s3fs at the proxy and set a 5 MiB upload block.
    """
    proxy = S3FaultProxy(moto_s3.endpoint_url)
    try:
        yield through_proxy(moto_s3.new_backend(), proxy, default_block_size=BLOCK_BYTES), proxy
    finally:
        proxy.stop()


@pytest.fixture
def raw(backend, request):
    """An independent view of ``backend`` (see ``tests/core/helpers.py``)."""
    from core.helpers import Raw
    from store_fixtures import s3_server

    moto = s3_server(request, backend) if backend.name == "s3" else None
    return Raw(backend, moto)
