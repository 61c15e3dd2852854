"""Partial writes: an exception inside a payload writer, a writer dropped without close, and a
serializer that raises half way. Nothing is committed, nothing new is listed, no object appears
under a committed name, and committed steps are untouched."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from proc_writer import make_bytes

from opd_store import IncompleteCheckpointError, StoreUnreachableError

from .helpers import open_store, save

# Each gc.collect() below scans only what the test made (the fixture freezes older objects).
pytestmark = pytest.mark.usefixtures("gc_of_this_test")

PREV_PAYLOADS = {"model.pt": make_bytes("prev", 8000)}
HALF = make_bytes("half", 3000)


def _committed_snapshot(raw) -> dict[str, bytes]:
    return {key: raw.cat(key) for key in raw.keys() if key.startswith("step-000001/")}


def _assert_nothing_new(store, raw, before: dict[str, bytes]) -> None:
    assert store.steps() == [1]
    assert store.latest_step() == 1
    assert not store.is_complete(2) and store.status(2) == "uncommitted"
    assert store.read(1, "model.pt") == PREV_PAYLOADS["model.pt"]
    assert _committed_snapshot(raw) == before
    # No manifest anywhere but step 1's: no object sits under a committed name.
    assert [k for k in raw.keys() if k.endswith("manifest.json")] == ["step-000001/manifest.json"]


def test_exception_inside_writer_after_half_the_bytes(backend, raw):
    store = open_store(backend)
    save(store, 1, PREV_PAYLOADS)
    before = _committed_snapshot(raw)
    with pytest.raises(RuntimeError, match="boom"):
        with store.begin(2) as txn:
            txn.write_bytes("config.json", b"{}")
            with txn.open("model.pt") as writer:
                writer.write(HALF)
                assert writer.tell() == len(HALF)
                raise RuntimeError("boom")
    gc.collect()  # a buffered remote file must not publish its bytes when collected
    _assert_nothing_new(store, raw, before)
    assert [k for k in raw.keys() if k.startswith("step-000002/")] == []


def test_exception_in_writer_then_commit_refused(backend, raw):
    """The caller swallows the writer's exception and tries to commit anyway."""
    store = open_store(backend)
    save(store, 1, PREV_PAYLOADS)
    before = _committed_snapshot(raw)
    txn = store.begin(2)
    txn.write_bytes("config.json", b"{}")
    with pytest.raises(RuntimeError):
        with txn.open("model.pt") as writer:
            writer.write(HALF)
            raise RuntimeError("boom")
    with pytest.raises(IncompleteCheckpointError) as caught:
        txn.commit()
    assert "model.pt" in str(caught.value) and "config.json" not in str(caught.value)
    assert isinstance(caught.value, ValueError)
    gc.collect()
    _assert_nothing_new(store, raw, before)
    assert [k for k in raw.keys() if k.startswith("step-000002/")] == []


def test_writer_dropped_without_close(backend, raw):
    store = open_store(backend)
    save(store, 1, PREV_PAYLOADS)
    before = _committed_snapshot(raw)
    txn = store.begin(2)
    txn.write_bytes("config.json", b"{}")
    writer = txn.open("model.pt")
    writer.write(HALF)
    del writer  # never closed
    gc.collect()
    with pytest.raises(IncompleteCheckpointError) as caught:
        txn.commit()
    assert "model.pt" in str(caught.value)
    gc.collect()
    _assert_nothing_new(store, raw, before)
    assert [k for k in raw.keys() if k.startswith("step-000002/")] == []


def test_whole_transaction_dropped(backend, raw):
    """A transaction and its open writer abandoned (the code that held them is gone): whatever
    a collected writer leaves behind lies under its attempt prefix and never counts."""
    store = open_store(backend)
    save(store, 1, PREV_PAYLOADS)
    before = _committed_snapshot(raw)
    txn = store.begin(2)
    attempt = txn.attempt_id
    txn.write_bytes("config.json", b"{}")
    writer = txn.open("model.pt")
    writer.write(HALF)
    del writer, txn
    gc.collect()
    _assert_nothing_new(store, raw, before)
    assert all(k.startswith(f"step-000002/{attempt}/") for k in raw.keys() if k.startswith("step-000002/"))
    # A later save of the step ignores those leftovers.
    save(store, 2, {"model.pt": b"fresh"})
    assert store.latest_step() == 2 and store.names(2) == ["model.pt"] and store.read(2, "model.pt") == b"fresh"


def test_serialization_raises_mid_payload(backend, raw):
    store = open_store(backend)
    save(store, 1, PREV_PAYLOADS)
    before = _committed_snapshot(raw)
    state = {"weights": torch.arange(50_000, dtype=torch.float32), "hook": lambda x: x}  # a lambda cannot be pickled
    seen = {}
    with pytest.raises(Exception) as caught:
        with store.begin(2) as txn:
            txn.write_bytes("config.json", b"{}")
            with txn.open("model.pt") as writer:
                seen["writer"] = writer
                torch.save(state, writer)
    assert "pickle" in str(caught.value).lower() or "lambda" in str(caught.value)
    assert seen["writer"].tell() > 0  # torch.save had streamed bytes before it failed
    assert seen["writer"].closed
    gc.collect()
    _assert_nothing_new(store, raw, before)
    assert [k for k in raw.keys() if k.startswith("step-000002/")] == []


def test_commit_failing_before_the_create_discards_the_attempt(backend, raw):
    """Metadata that cannot be written as JSON fails the commit before the manifest create: the
    error reaches the caller, nothing is committed and the attempt's payloads are removed (no
    manifest can ever name them)."""
    store = open_store(backend)
    save(store, 1, PREV_PAYLOADS)
    before = _committed_snapshot(raw)
    with pytest.raises(ValueError, match="serialize"):
        with store.begin(2, metadata={"not_json": object()}) as txn:
            txn.write_bytes("model.pt", HALF)
    _assert_nothing_new(store, raw, before)
    assert [k for k in raw.keys() if k.startswith("step-000002/")] == []
    with pytest.raises(ValueError):
        txn.commit()  # the transaction is over
    save(store, 2, {"model.pt": b"ok"}, metadata={"fine": 1})
    assert store.latest_step() == 2


@pytest.mark.parametrize("how", ["exception", "dropped"])
def test_s3_failed_multipart_payload_leaves_no_open_upload(s3_backend, moto_s3, how):
    """A payload above the multipart threshold that fails after a part was uploaded: the
    multipart upload is aborted (an open one costs money on real S3 until someone aborts it)."""
    from .helpers import Raw, boto3_client

    options = {**s3_backend.storage_options, "default_block_size": 5 * 2**20}  # S3's minimum part
    store = open_store(dataclasses.replace(s3_backend, storage_options=options))
    raw = Raw(s3_backend, moto_s3)
    save(store, 1, PREV_PAYLOADS)
    client = boto3_client(moto_s3)
    bucket = s3_backend.url[len("s3://"):].split("/")[0]
    part = make_bytes("part", 6 * 2**20)
    txn = store.begin(2)
    writer = txn.open("model.pt")
    writer.write(part)  # more than one block: a multipart upload is open, one part uploaded
    assert len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1
    if how == "exception":
        with pytest.raises(RuntimeError):
            with writer:
                raise RuntimeError("boom")
        txn.abort()
    else:
        del writer
        gc.collect()
        with pytest.raises(IncompleteCheckpointError):
            txn.commit()
    gc.collect()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert [k for k in raw.keys() if k.startswith("step-000002/")] == []
    assert store.steps() == [1] and store.latest_step() == 1


def test_s3_failed_multipart_completion_leaves_no_open_upload(s3_backend, moto_s3):
    """The publish of a multipart payload fails at CompleteMultipartUpload: the error reaches the
    caller, the upload is aborted, nothing is committed."""
    from .helpers import Raw, boto3_client

    options = {**s3_backend.storage_options, "default_block_size": 5 * 2**20}
    store = open_store(dataclasses.replace(s3_backend, storage_options=options))
    raw = Raw(s3_backend, moto_s3)
    save(store, 1, PREV_PAYLOADS)
    client = boto3_client(moto_s3)
    bucket = s3_backend.url[len("s3://"):].split("/")[0]

    def complete_fails(**_kwargs):
        raise ConnectionResetError("connection reset during CompleteMultipartUpload")

    store.storage.fs.s3.meta.events.register("before-call.s3.CompleteMultipartUpload", complete_fails)
    with pytest.raises(StoreUnreachableError) as caught:
        with store.begin(2) as txn:
            txn.write_bytes("model.pt", make_bytes("big", 6 * 2**20))
    # The object, the operation and the cause in one line; the client's error is the cause.
    assert str(caught.value) == (f"{store.url}/step-000002/{txn.attempt_id}/model.pt: cannot write payload "
                                 f"'model.pt' of step 2: endpoint {moto_s3.endpoint_url} closed the connection "
                                 "(connection reset during CompleteMultipartUpload); step 2 is not committed")
    assert isinstance(caught.value.__cause__, ConnectionResetError)
    gc.collect()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert [k for k in raw.keys() if k.startswith("step-000002/")] == []
    assert store.steps() == [1] and store.latest_step() == 1
    assert txn.attempt_id
