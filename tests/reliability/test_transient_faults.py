"""Transient S3 faults: HTTP 500, 503 SlowDown, connections
dropped before the request reaches S3, dropped after it landed (the reply is lost), and bodies cut
mid-response, injected by a proxy in front of moto (:mod:`opd_testkit.proxies`).

Saves and loads retry with back-off (botocore's retry handler, then s3fs's own retry loop; see
docs/protocol.md, "Retries") and either commit whole or not at all; committed data is never lost.
Each test fails the first request of every S3 operation a save and a load use, once, and checks
the retried requests, the bytes that reached S3, and the loaded bytes.
"""

from __future__ import annotations

import pytest
from core.helpers import boto3_client, crc_hex, open_store, save

from .conftest import BLOCK_BYTES

# Retries are what these tests count: botocore's back-offs between them are recorded, not slept.
pytestmark = pytest.mark.usefixtures("botocore_backoff")

SAVE_OPS = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "HeadObject", "ListObjectsV2")
# A payload is read in ranges of the size its manifest records: no HeadObject.
LOAD_OPS = ("GetObject", "ListObjectsV2")
LARGE = bytes(range(251)) * ((BLOCK_BYTES + 4096) // 251)  # above the 5 MiB block: a multipart upload of 2 parts
SMALL = b"small payload " * 10

FAULTS = {
    "500": dict(fault="status", status=500, code="InternalError"),
    "503-slowdown": dict(fault="status", status=503, code="SlowDown"),
    "drop": dict(fault="drop"),
}


def _committed_step_1(store) -> str:
    return save(store, 1, {"prev.bin": b"committed before the faults"}).attempt_id


def _assert_step_1_intact(store, attempt_id: str) -> None:
    assert store.manifest(1).attempt_id == attempt_id
    assert store.read(1, "prev.bin") == b"committed before the faults"


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_every_save_and_load_operation_failing_once_is_retried(s3_proxy, moto_s3, kind):
    backend, proxy = s3_proxy
    store = open_store(backend)
    prev = _committed_step_1(store)
    proxy.clear()
    rules = {op: proxy.add(ops=(op,), times=1, **FAULTS[kind]) for op in SAVE_OPS}
    save(store, 2, {"model.bin": LARGE, "small.bin": SMALL})
    for op, rule in rules.items():
        assert rule.hits == 1, (op, proxy.ops())
        assert proxy.count(op, faulted=False) >= 1, (op, proxy.ops())  # retried and got through
    # Bytes that reached S3: the two parts of the large payload, the small payload, the manifest.
    parts = [r for r in proxy.requests if r.op == "UploadPart" and r.fault is None]
    # (s3fs sends each part when its buffer passes the block size: 8 MiB writes make 8 MiB parts.)
    assert sum(r.request_bytes for r in parts) == len(LARGE)
    assert len(parts) == len({r.query for r in parts}) == -(-len(LARGE) // BLOCK_BYTES)  # every part once, after its retry
    puts = [r for r in proxy.requests if r.op == "PutObject" and r.fault is None]
    assert [r.path.rsplit("/", 1)[-1] for r in puts] == ["small.bin", "manifest.json"]
    assert puts[0].request_bytes == len(SMALL)

    proxy.clear()
    load_rules = {op: proxy.add(ops=(op,), times=1, **FAULTS[kind]) for op in LOAD_OPS}
    assert store.latest_step() == 2
    assert store.read(2, "model.bin") == LARGE
    assert store.read(2, "small.bin") == SMALL
    for op, rule in load_rules.items():
        assert rule.hits == 1, (op, proxy.ops())
    assert store.manifest(2).entry("model.bin").crc32c == crc_hex(LARGE)
    _assert_step_1_intact(store, prev)
    bucket = backend.url[len("s3://"):].partition("/")[0]
    assert boto3_client(moto_s3).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_body_cut_mid_response_is_fetched_again(s3_proxy):
    backend, proxy = s3_proxy
    store = open_store(backend)
    save(store, 2, {"model.bin": LARGE})
    proxy.clear()
    rule = proxy.add(ops=("GetObject",), fault="truncate", times=1)
    assert store.read(2, "model.bin") == LARGE
    assert rule.hits == 1
    gets = [r for r in proxy.requests if r.op == "GetObject"]
    assert gets[0].fault == "truncate" and gets[0].response_bytes < gets[0].request_bytes + len(LARGE)


@pytest.mark.parametrize("op", ["PutObject", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload"])
def test_a_lost_reply_after_the_request_landed_commits_whole_or_not_at_all(s3_proxy, moto_s3, op):
    """``drop_after``: S3 applied the request, the reply never came. The retry meets the changed
    state (a 412 for the manifest create, a finished upload for CompleteMultipartUpload)."""
    backend, proxy = s3_proxy
    store = open_store(backend)
    prev = _committed_step_1(store)
    proxy.clear()
    match = (lambda r: r.path.endswith("/manifest.json")) if op == "PutObject" else None
    rule = proxy.add(ops=(op,), match=match, fault="drop_after", times=1)
    try:
        save(store, 2, {"model.bin": LARGE, "small.bin": SMALL})
        outcome = "committed"
    except OSError as exc:
        outcome = f"failed: {exc!r}"
    assert rule.hits == 1
    _assert_step_1_intact(store, prev)
    if outcome == "committed":
        assert store.latest_step() == 2
        assert store.read(2, "model.bin") == LARGE and store.read(2, "small.bin") == SMALL
    else:
        assert store.steps() == [1] and store.latest_step() == 1, outcome
    # moto, like S3, answers a repeated CompleteMultipartUpload of a finished upload with success,
    # and the manifest's 412 on the retried create is read back as this attempt's own: every case
    # commits (a failure would have had to leave step 2 uncommitted, checked above).
    assert outcome == "committed", outcome
    bucket = backend.url[len("s3://"):].partition("/")[0]
    uploads = boto3_client(moto_s3).list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    if op == "CreateMultipartUpload":
        # The lost reply orphaned the first upload; S3 bills its parts (none here) until it is
        # aborted: a bucket lifecycle rule (AbortIncompleteMultipartUpload) removes it.
        assert len(uploads) <= 1 and all("/step-000002/attempt-" in u["Key"] for u in uploads)
    else:
        assert uploads == []


@pytest.mark.parametrize("target", ["payload", "manifest"])
def test_a_persistent_fault_fails_the_save_and_loses_nothing(s3_proxy, target):
    """Retries are bounded and configurable through storage options (botocore's ``retries``
    config); when they run out the save fails, step 2 is not committed, step 1 is untouched."""
    from opd_store import CheckpointStore
    from opd_store.errors import CommitError

    backend, proxy = s3_proxy
    options = dict(backend.storage_options, config_kwargs={"retries": {"total_max_attempts": 2, "mode": "standard"}})
    store = CheckpointStore(backend.url, storage_options=options)
    prev = _committed_step_1(store)
    proxy.clear()
    name = "manifest.json" if target == "manifest" else "small.bin"
    rule = proxy.add(ops=("PutObject",), match=lambda r: r.path.endswith("/" + name), times=None,
                     fault="status", status=500, code="InternalError")
    with pytest.raises(OSError) as caught:
        save(store, 2, {"small.bin": SMALL})
    assert rule.hits == 2  # total_max_attempts=2: the request and one retry; s3fs does not retry a 500
    if target == "manifest":
        # No manifest after the failed create: a plain CommitError, payloads kept for gc.
        assert type(caught.value) is CommitError
        assert store.status(2) == "uncommitted"
    else:
        assert [c.attempts for c in store.checkpoints() if c.step == 2] == []
    assert store.steps() == [1] and store.latest_step() == 1
    _assert_step_1_intact(store, prev)
