"""Request counts against moto's S3 server with 1,000 committed steps of 10 objects each.

Requests are counted with a botocore ``before-send`` handler registered on the store's own s3fs
client: every HTTP request it sends (retries included) passes through it.

The fixture (1,000 steps x (10 payloads + manifest) + failed-attempt leftovers, 11,013 objects) is
written straight into moto's in-process S3 backend (``moto.s3.models.s3_backends``), the same
storage its HTTP server serves from. Writing it over HTTP with boto3 in a thread pool ran at
~27 objects/s on this 2-core machine (the in-process server shares the GIL with the test), i.e.
about 7 minutes for 11,000 objects; the direct writes take about 2 s. A sample of the objects is
read back over HTTP with boto3 to prove the server serves them. The fixture is module-scoped, and
this module holds no other S3 test (a ``backend`` fixture would reset moto under it).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time

import pytest

from opd_store.format import Manifest, PayloadEntry, Writer

from .helpers import boto3_client, crc_hex, open_store

STEPS = list(range(10, 10_001, 10))  # 1,000 committed steps, step 10 ... 10000
OBJECTS_PER_STEP = 10
# Failed attempts: extra attempt prefixes inside committed steps, and two uncommitted steps.
LEFTOVER_ATTEMPTS = {500: 3, 9990: 2}
UNCOMMITTED_STEPS = {15: 3, 5005: 2}

logger = logging.getLogger(__name__)


def _aid(step: int, salt: int = 0) -> str:
    return f"attempt-20260101T000000Z-{salt:04x}{step:08x}"


def _payload(step: int, index: int) -> bytes:
    return f"step {step} part {index} ".encode() * 4


# One worker runs the module's tests together: the 1,000-step fixture is built once, and no other
# test resets that worker's moto server between them.
pytestmark = pytest.mark.xdist_group("thousand-steps")


@pytest.fixture(scope="module")
def thousand_steps(moto_s3):
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = moto_s3.new_backend(bucket="opd-bulk")
    bucket, _, prefix = backend.url[len("s3://"):].partition("/")
    s3 = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    started = time.perf_counter()
    count = 0

    def put(rel: str, data: bytes) -> None:
        nonlocal count
        s3.put_object(bucket, f"{prefix}/{rel}", data)
        count += 1

    created = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    for step in STEPS:
        aid = _aid(step)
        entries = []
        for index in range(OBJECTS_PER_STEP):
            data = _payload(step, index)
            name = f"part-{index}.bin"
            put(f"step-{step:06d}/{aid}/{name}", data)
            entries.append(PayloadEntry(name=name, path=f"{aid}/{name}", size_bytes=len(data), crc32c=crc_hex(data)))
        manifest = Manifest(
            step=step, attempt_id=aid, writer=Writer(host="fixture", pid=1), created_at=created,
            payloads=tuple(entries), metadata={"successful_updates": step},
        )
        put(f"step-{step:06d}/manifest.json", manifest.to_json_bytes())
    for step, n in {**LEFTOVER_ATTEMPTS, **UNCOMMITTED_STEPS}.items():
        for index in range(n):
            put(f"step-{step:06d}/{_aid(step, salt=1)}/part-{index}.bin", b"leftover")
    elapsed = time.perf_counter() - started
    logger.warning("built %d objects in moto in %.1f s", count, elapsed)
    assert count == len(STEPS) * (OBJECTS_PER_STEP + 1) + sum(LEFTOVER_ATTEMPTS.values()) + sum(UNCOMMITTED_STEPS.values())
    assert count == 11_010

    # The HTTP server serves what was written: a sample read back with boto3.
    client = boto3_client(moto_s3)
    head = client.head_object(Bucket=bucket, Key=f"{prefix}/step-010000/manifest.json")
    assert head["ContentLength"] > 0
    body = client.get_object(Bucket=bucket, Key=f"{prefix}/step-000010/{_aid(10)}/part-3.bin")["Body"].read()
    assert body == _payload(10, 3)
    return backend, count


class RequestCounter:
    """Counts HTTP requests sent by one s3fs instance (botocore ``before-send`` event)."""

    def __init__(self, fs) -> None:
        fs.connect()  # creates fs.s3, the aiobotocore client
        self.requests: list[tuple[str, str]] = []
        fs.s3.meta.events.register("before-send.s3", self._record)

    def _record(self, request, **_kwargs):
        self.requests.append((request.method, request.url))
        return None  # let botocore send it

    def measure(self, call):
        del self.requests[:]
        result = call()
        return result, list(self.requests)


def test_latest_step_at_most_five_requests(thousand_steps):
    backend, _ = thousand_steps
    store = open_store(backend)
    counter = RequestCounter(store.storage.fs)
    latest, requests = counter.measure(store.latest_step)
    print(f"latest_step(): {len(requests)} requests: {[m for m, _ in requests]}")
    assert latest == 10_000
    assert len(requests) <= 5, requests
    # Every request went to the moto endpoint given in storage_options.
    assert all(url.startswith(backend.storage_options["endpoint_url"]) for _, url in requests)

    complete, requests = counter.measure(lambda: store.is_complete(10_000))
    assert complete and len(requests) <= 4, requests
    manifest, requests = counter.measure(lambda: store.manifest(10_000))
    assert manifest.metadata == {"successful_updates": 10_000} and len(requests) <= 2, requests


def test_steps_lists_pages_not_steps(thousand_steps):
    backend, count = thousand_steps
    store = open_store(backend)
    counter = RequestCounter(store.storage.fs)
    steps, requests = counter.measure(store.steps)
    print(f"steps(): {len(requests)} requests for {count} objects")
    assert steps == STEPS  # exact, numeric order; uncommitted steps 15 and 5005 are not listed
    assert len(requests) <= math.ceil(count / 1000) + 2, len(requests)
    assert all(method == "GET" and "list-type=2" in url for method, url in requests), requests


def test_latest_step_skipping_the_newest_costs_a_constant(thousand_steps, moto_s3):
    """With the newest step's manifest gone, latest_step checks one more candidate: a few
    requests for the skipped step (manifest and legacy-marker lookups), never a scan."""
    backend, _ = thousand_steps
    bucket, _, prefix = backend.url[len("s3://"):].partition("/")
    client = boto3_client(moto_s3)
    key = f"{prefix}/step-010000/manifest.json"
    saved = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.delete_object(Bucket=bucket, Key=key)
    try:
        store = open_store(backend)
        counter = RequestCounter(store.storage.fs)
        latest, requests = counter.measure(store.latest_step)
        print(f"latest_step() skipping the newest: {len(requests)} requests")
        assert latest == 9_990
        assert len(requests) <= 5 + 4, requests
    finally:
        client.put_object(Bucket=bucket, Key=key, Body=saved)
