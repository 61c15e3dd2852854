"""An endpoint that stops answering in the middle of a job (a stuck gateway): saves and loads fail
with an error naming the step, the object, the operation and the read timeout, instead of
hanging. The proxy in front of moto (:mod:`opd_testkit.proxies`) reads the stalled requests and never
answers them; the store's ``read_timeout_secs`` is 0.5 s and botocore makes one attempt per pass of
s3fs's retry loop (opd_store's default: 2 passes, nested twice for a download), so a failure takes
at most 4 attempts of 0.5 s (a request that is answered is retried by the second pass if a loaded
machine holds it past 0.5 s). With the defaults (60 s, 3 botocore attempts) the same failure takes at
most 6 attempts (12 for a download) of 60 s (docs/protocol.md, "Retries").
"""

from __future__ import annotations

import time

import pytest
from proc_writer import make_bytes

from opd_store import CheckpointStore, StoreUnreachableError

from .conftest import BLOCK_BYTES

READ_TIMEOUT_SECS = 0.5
BOUND_SECS = 4 * (READ_TIMEOUT_SECS + 0.5)  # four attempts of the read timeout, with s3fs's back-off between them
MARGIN_SECS = 30.0  # an upper limit on a loaded machine, not a speed target


def _store(backend) -> CheckpointStore:
    options = dict(backend.storage_options, read_timeout_secs=READ_TIMEOUT_SECS,
                   config_kwargs={"retries": {"total_max_attempts": 1}})
    return CheckpointStore(backend.url, storage_options=options)


def test_a_save_against_a_stalled_endpoint_fails_naming_step_and_object(s3_proxy):
    backend, proxy = s3_proxy
    store = _store(backend)
    with store.begin(1) as txn:
        txn.write_bytes("model.bin", b"step one")

    # A small payload is one PutObject when it is published.
    rule = proxy.add(ops=("PutObject",), fault="stall", times=None)
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError) as caught:
        with store.begin(2) as txn:
            txn.write_bytes("model.bin", b"step two")
    assert time.monotonic() - started < BOUND_SECS + MARGIN_SECS
    assert str(caught.value) == (f"{store.url}/step-000002/{txn.attempt_id}/model.bin: cannot write payload "
                                 f"'model.bin' of step 2: endpoint {proxy.endpoint_url} did not answer within 0.5 s; "
                                 "step 2 is not committed")
    assert type(caught.value.__cause__).__name__ == "ReadTimeoutError"
    assert rule.hits == 2  # one botocore attempt in each of s3fs's two passes

    # A large one uploads its parts while it is written; the payload writer names it and the step.
    proxy.clear()
    rule = proxy.add(ops=("UploadPart",), fault="stall", times=None)
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError) as caught:
        with store.begin(3) as txn:
            txn.write_bytes("big.bin", make_bytes("big", 2 * BLOCK_BYTES + 1))
    assert time.monotonic() - started < BOUND_SECS + MARGIN_SECS
    assert str(caught.value) == (f"{store.url}/step-000003/{txn.attempt_id}/big.bin: cannot write payload 'big.bin' "
                                 f"of step 3: endpoint {proxy.endpoint_url} did not answer within 0.5 s; step 3 is "
                                 "not committed")
    assert rule.hits == 3 * 2  # three parts in flight at once, each once in each of s3fs's two passes
    proxy.clear()
    assert store.steps() == [1] and store.read(1, "model.bin") == b"step one"


def test_a_load_against_a_stalled_endpoint_fails_naming_step_and_object(s3_proxy):
    backend, proxy = s3_proxy
    store = _store(backend)
    with store.begin(1) as txn:
        txn.write_bytes("model.bin", b"step one")
    attempt_id = store.manifest(1).attempt_id

    rule = proxy.add(ops=("GetObject",), fault="stall", times=None, match=lambda r: r.path.endswith("/model.bin"))
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError) as caught:
        store.read(1, "model.bin")
    assert time.monotonic() - started < BOUND_SECS + MARGIN_SECS
    assert str(caught.value) == (f"{store.url}/step-000001/{attempt_id}/model.bin: cannot read: endpoint "
                                 f"{proxy.endpoint_url} did not answer within 0.5 s")
    assert rule.hits == 2  # the ranged GET: one botocore attempt in each of s3fs's two passes
    proxy.clear()
    assert store.read(1, "model.bin") == b"step one"


def test_a_stalled_size_check_names_the_object_in_one_sentence(s3_proxy):
    """``begin`` first reads the size of the step's manifest (is the step committed?): a stalled
    HEAD names the manifest and the operation as a whole phrase (never ``cannot read the size of:``)."""
    backend, proxy = s3_proxy
    store = _store(backend)
    proxy.add(ops=("HeadObject",), fault="stall", times=None, match=lambda r: r.path.endswith("/manifest.json"))
    with pytest.raises(StoreUnreachableError) as caught:
        store.begin(2)
    assert str(caught.value) == (f"{store.url}/step-000002/manifest.json: cannot read its size: endpoint "
                                 f"{proxy.endpoint_url} did not answer within 0.5 s")
    proxy.clear()
