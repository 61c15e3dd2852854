"""Fixtures for the tiered-store tests: an S3 bucket (moto server) and a proxy that can hold a
request (the bucket manifest's PUT) for as long as a test wants, so a process can be killed with
its upload provably unfinished."""

from __future__ import annotations

from typing import Callable

import pytest
from opd_testkit.hold_proxy import HoldProxy
from opd_testkit.stores import Backend


@pytest.fixture
def bucket(s3_backend) -> Backend:
    """A clean S3 bucket on the moto server (HTTP on loopback)."""
    return s3_backend


@pytest.fixture
def hold_proxy(moto_s3):
    """Factory: ``hold_proxy(hold)`` starts a :class:`HoldProxy` in front of the moto server."""
    proxies = []

    def start(hold: Callable[[str, str], bool]) -> HoldProxy:
        proxy = HoldProxy(moto_s3.endpoint_url, hold)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.stop()
