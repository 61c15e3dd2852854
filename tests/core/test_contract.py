"""Contract of the core store on local, memory, S3 (moto server) and GCS (fake-gcs-server).

Every result is checked through the store AND through the raw backend (a fresh fsspec instance,
boto3 for S3): exact object keys, manifest JSON fields, sizes and CRC32C of the raw bytes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
import logging
import os
import re
import socket

import pytest
import torch
from proc_writer import make_bytes

from opd_store import (
    CheckpointNotFoundError,
    CommitConflictError,
    IncompleteCheckpointError,
    IntegrityError,
    ManifestError,
)
from opd_store.store import LegacyReader, split_checkpoint_url

from .helpers import crc_hex, open_store, save

ATTEMPT_RE = re.compile(r"^attempt-\d{8}T\d{6}Z-[0-9a-f]{12}$")


def _torch_bytes() -> tuple[bytes, dict]:
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue(), state


def test_save_layout_manifest_and_reads(backend, raw):
    store = open_store(backend)
    model_bytes, state = _torch_bytes()
    payloads = {
        "model.pt": model_bytes,
        "adapter/config.json": b'{"r": 8}',
        "a/b/c/deep.bin": make_bytes("deep", 100_003),
        "empty.bin": b"",
    }
    metadata = {"successful_updates": 12, "fingerprint": "sha256:abc", "nested": {"lr": [0.1, 0.01]}}
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    with store.begin(12, metadata=metadata, world_size=1) as txn:
        with txn.open("model.pt") as writer:
            torch.save(state, writer)  # streams into the object
        for name in ("adapter/config.json", "a/b/c/deep.bin"):
            with txn.open(name) as writer:
                data = payloads[name]
                for offset in range(0, len(data), 4096):
                    writer.write(memoryview(data)[offset:offset + 4096])
        txn.write_bytes("empty.bin", b"")
    after = dt.datetime.now(dt.timezone.utc)
    aid = txn.attempt_id
    assert ATTEMPT_RE.match(aid)
    assert txn.committed_url == store.step_url(12)

    # -- raw: exact keys and bytes ---------------------------------------------------------
    expected_keys = {"step-000012/manifest.json"} | {f"step-000012/{aid}/{name}" for name in payloads}
    keys = raw.keys()
    assert set(keys) == expected_keys
    for name, data in payloads.items():
        assert raw.cat(f"step-000012/{aid}/{name}") == data
        assert keys[f"step-000012/{aid}/{name}"] == len(data)
    if backend.name == "s3":
        # boto3 above; s3fs (a fresh instance) must agree.
        assert raw.fsspec_keys() == keys

    # -- raw: manifest JSON ----------------------------------------------------------------
    manifest_raw = raw.cat("step-000012/manifest.json")
    doc = json.loads(manifest_raw)
    assert set(doc) == {
        "format", "format_version", "step", "attempt_id", "writer", "created_at", "world_size", "payloads", "metadata",
    }
    assert doc["format"] == "opd_store.manifest"
    assert doc["format_version"] == 1
    assert doc["step"] == 12
    assert doc["attempt_id"] == aid
    assert doc["writer"] == {"host": socket.gethostname(), "pid": os.getpid(), "rank": 0}
    created = dt.datetime.fromisoformat(doc["created_at"].replace("Z", "+00:00"))
    assert created.utcoffset() == dt.timedelta(0)
    assert before <= created <= after
    assert doc["world_size"] == 1
    assert doc["metadata"] == metadata
    by_name = {entry["name"]: entry for entry in doc["payloads"]}
    assert set(by_name) == set(payloads)
    for name, data in payloads.items():
        raw_bytes = raw.cat(f"step-000012/{aid}/{name}")
        assert by_name[name] == {
            "name": name,
            "path": f"{aid}/{name}",
            "size_bytes": len(raw_bytes),
            "crc32c": crc_hex(raw_bytes),
        }
    assert by_name["empty.bin"]["size_bytes"] == 0
    assert by_name["empty.bin"]["crc32c"] == "00000000"

    # -- through the store -----------------------------------------------------------------
    assert store.steps() == [12]
    assert store.latest_step() == 12
    assert store.is_complete(12)
    assert store.status(12) == "complete"
    manifest = store.manifest(12)
    assert manifest.attempt_id == aid and manifest.step == 12 and manifest.metadata == metadata
    assert sorted(store.names(12)) == sorted(payloads)
    for name, data in payloads.items():
        assert store.read(12, name) == data
        assert store.open(12, name).read() == data
    loaded = torch.load(store.open(12, "model.pt"), weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
    for deep in (False, True):
        report = store.verify(12, deep=deep)
        assert report.ok and report.status == "complete" and report.problems == ()
        assert report.checked_objects == 4 and report.deep is deep
    (info,) = store.checkpoints()
    assert info.step == 12 and info.status == "complete" and info.attempts == (aid,)
    assert info.total_size_bytes == sum(keys.values())
    assert info.created_at == created and info.metadata == metadata

    # -- URLs keep their protocol and round-trip -------------------------------------------
    step_url = store.step_url(12)
    if backend.name == "local":
        assert step_url == os.path.join(os.path.abspath(backend.url), "step-000012")
    else:
        assert step_url.startswith({"memory": "memory://", "s3": "s3://", "gcs": "gs://"}[backend.name])
        assert step_url.endswith("/runs/demo/step-000012")
    other, step = split_checkpoint_url(step_url, backend.storage_options)
    assert step == 12 and other.is_complete(12) and other.read(12, "adapter/config.json") == b'{"r": 8}'


def test_numeric_step_order(backend, raw):
    store = open_store(backend)
    for step in (1000000, 5, 999999):
        save(store, step, {"x.bin": str(step).encode()})
    assert store.steps() == [5, 999999, 1000000]
    assert [info.step for info in store.checkpoints()] == [5, 999999, 1000000]
    assert store.latest_step() == 1000000
    manifests = sorted(key for key in raw.keys() if key.endswith("manifest.json"))
    assert manifests == ["step-000005/manifest.json", "step-1000000/manifest.json", "step-999999/manifest.json"]
    store.delete(1000000)
    assert store.latest_step() == 999999
    assert store.read(999999, "x.bin") == b"999999"


@pytest.mark.parametrize(
    "bad",
    ["../x", "/abs", "a//b", "a/../b", "./a", "a/", "", "x*", "x?", "x[0]", "x{a,b}", "a\\b", "x#y", "a\nb"],
)
def test_unsafe_payload_names_refused(bad, tmp_path):
    from opd_store import CheckpointStore

    store = CheckpointStore(tmp_path / "store")
    with store.begin(1) as txn:
        with pytest.raises(ValueError):
            txn.open(bad)
        with pytest.raises(ValueError):
            txn.write_bytes(bad, b"data")
        txn.write_bytes("ok.bin", b"data")
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == [f"store/step-000001/{txn.attempt_id}/ok.bin", "store/step-000001/manifest.json"]
    with pytest.raises(CheckpointNotFoundError):
        store.read(1, bad or "x")


def test_unsafe_names_refused_every_backend(backend, raw):
    store = open_store(backend)
    with store.begin(1) as txn:
        for bad in ("../x", "/abs", "a//b", "glob*", "q?", "[ab]"):
            with pytest.raises(ValueError):
                txn.open(bad)
        txn.write_bytes("ok.bin", b"data")
    assert set(raw.keys()) == {"step-000001/manifest.json", f"step-000001/{txn.attempt_id}/ok.bin"}


def test_flipped_byte_raises_integrity_error(backend, raw):
    store = open_store(backend)
    data = make_bytes("flip", 10_000)
    txn = save(store, 3, {"model.pt": data})
    rel = f"step-000003/{txn.attempt_id}/model.pt"
    flipped = bytearray(data)
    flipped[5000] ^= 0xFF
    raw.put(rel, bytes(flipped))
    assert raw.cat(rel) == bytes(flipped)

    # Same size: the shallow checks cannot see it, the checksum can.
    assert store.is_complete(3)
    assert store.verify(3).ok
    deep = store.verify(3, deep=True)
    assert not deep.ok and deep.status == "corrupt"
    assert [(p.name, p.kind) for p in deep.problems] == [("model.pt", "checksum")]
    expected, actual = crc_hex(data), crc_hex(bytes(flipped))
    assert expected != actual
    with pytest.raises(IntegrityError) as caught:
        store.read(3, "model.pt")
    message = str(caught.value)
    for part in (store.storage.url(rel), "step 3", "model.pt", expected, actual):
        assert part in message, (part, message)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(IntegrityError):
        store.open(3, "model.pt")


def test_truncated_object_not_complete_latest_falls_back(backend, raw, caplog):
    store = open_store(backend)
    save(store, 1, {"model.pt": make_bytes("one", 5000)})
    txn = save(store, 2, {"model.pt": make_bytes("two", 5000), "opt.pt": make_bytes("two-opt", 3000)})
    rel = f"step-000002/{txn.attempt_id}/opt.pt"
    raw.put(rel, make_bytes("two-opt", 3000)[:2999])
    assert raw.keys()[rel] == 2999

    assert not store.is_complete(2)
    assert store.status(2) == "incomplete"
    assert store.steps() == [1, 2]  # the manifest exists; completeness is a separate question
    with caplog.at_level(logging.WARNING, logger="opd_store"):
        assert store.latest_step() == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("step 2" in w and "incomplete" in w for w in warnings), warnings
    report = store.verify(2)
    assert not report.ok and [(p.name, p.kind) for p in report.problems] == [("opt.pt", "size")]
    assert "3000" in report.problems[0].detail and "2999" in report.problems[0].detail
    assert [(i.step, i.status) for i in store.checkpoints()] == [(1, "complete"), (2, "incomplete")]
    with pytest.raises(IntegrityError):
        store.read(2, "opt.pt")
    assert store.read(1, "model.pt") == make_bytes("one", 5000)


@pytest.mark.parametrize("damage", ["zero-byte", "missing"])
def test_zero_byte_or_missing_object(backend, raw, damage, caplog):
    store = open_store(backend)
    save(store, 1, {"model.pt": make_bytes("one", 2000)})
    txn = save(store, 2, {"model.pt": make_bytes("two", 2000)})
    rel = f"step-000002/{txn.attempt_id}/model.pt"
    if damage == "zero-byte":
        raw.put(rel, b"")
    else:
        raw.rm(rel)
    assert not store.is_complete(2)
    assert store.status(2) == "incomplete"
    with caplog.at_level(logging.WARNING, logger="opd_store"):
        assert store.latest_step() == 1
    assert any("step 2" in r.getMessage() for r in caplog.records)
    kind = "size" if damage == "zero-byte" else "missing"
    assert [(p.name, p.kind) for p in store.verify(2, deep=True).problems] == [("model.pt", kind)]
    if damage == "missing":
        with pytest.raises(IncompleteCheckpointError) as caught:
            store.read(2, "model.pt")
        assert isinstance(caught.value.__cause__, FileNotFoundError)
    else:
        with pytest.raises(IntegrityError):
            store.read(2, "model.pt")


def _bad_manifest(kind: str, good: dict, other_step_raw: bytes) -> bytes:
    doc = json.loads(json.dumps(good))
    if kind == "garbage":
        return b"{not json at all"
    if kind == "empty":
        return b""
    if kind == "binary":
        return b"\xff\xfe\x00\x01"
    if kind == "other_step":
        return other_step_raw
    if kind == "dotdot_path":
        doc["payloads"][0]["path"] = "../step-000001/" + doc["payloads"][0]["path"]
    elif kind == "dotdot_name":
        doc["payloads"][0]["name"] = "../../step-000001/model.pt"
        doc["payloads"][0]["path"] = doc["attempt_id"] + "/../../step-000001/model.pt"
    elif kind == "absolute":
        doc["payloads"][0]["path"] = "/etc/passwd"
    elif kind == "protocol":
        doc["payloads"][0]["path"] = "s3://elsewhere/x"
    elif kind == "version":
        doc["format_version"] = 99
    elif kind == "not_opd":
        doc["format"] = "something.else"
    elif kind == "negative_size":
        doc["payloads"][0]["size_bytes"] = -1
    elif kind == "naive_time":
        doc["created_at"] = "2026-01-01T00:00:00"
    return json.dumps(doc).encode()


BAD_MANIFEST_KINDS = ["garbage", "empty", "binary", "other_step", "dotdot_path", "dotdot_name", "absolute",
                      "protocol", "version", "not_opd", "negative_size", "naive_time"]
# Parsing does not depend on the backend: every kind on local and memory, three on S3 and GCS.
BAD_MANIFEST_CASES = [(b, k) for b in ("local", "memory") for k in BAD_MANIFEST_KINDS] + [
    (b, k) for b in ("s3", "gcs") for k in ("garbage", "other_step", "dotdot_path")
]


@pytest.mark.parametrize("backend,kind", BAD_MANIFEST_CASES, indirect=["backend"])
def test_bad_manifest_never_complete(backend, raw, kind, caplog):
    store = open_store(backend)
    save(store, 1, {"model.pt": make_bytes("one", 1000)})
    save(store, 2, {"model.pt": make_bytes("two", 1000)})
    good = json.loads(raw.cat("step-000002/manifest.json"))
    raw.put("step-000002/manifest.json", _bad_manifest(kind, good, raw.cat("step-000001/manifest.json")))

    assert store.status(2) == "corrupt"
    assert not store.is_complete(2)
    with caplog.at_level(logging.WARNING, logger="opd_store"):
        assert store.latest_step() == 1
    assert any("step 2" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    assert [(i.step, i.status) for i in store.checkpoints()] == [(1, "complete"), (2, "corrupt")]
    report = store.verify(2, deep=True)
    assert not report.ok and report.status == "corrupt" and report.problems[0].kind == "manifest"
    with pytest.raises(ManifestError) as caught:
        store.manifest(2)
    assert isinstance(caught.value, ValueError)
    if kind in ("garbage", "empty", "binary"):
        assert caught.value.__cause__ is not None
    with pytest.raises(ManifestError):
        store.read(2, "model.pt")
    # A damaged commit record is never overwritten by a new save; deleting it frees the step.
    with pytest.raises(CommitConflictError):
        store.begin(2)
    store.delete(2)
    save(store, 2, {"model.pt": b"again"})
    assert store.latest_step() == 2 and store.read(2, "model.pt") == b"again"
    assert store.read(1, "model.pt") == make_bytes("one", 1000)


def test_uncommitted_payloads_never_count(backend, raw, caplog):
    store = open_store(backend)
    save(store, 1, {"model.pt": make_bytes("one", 1000)})
    # A save of step 2 that wrote everything but never committed (killed before the manifest).
    txn = store.begin(2)
    txn.write_bytes("model.pt", make_bytes("two", 1000))
    txn.settle()  # stored (a bucket store publishes in the background after write_bytes returns)
    # Leftover staging of step 7 (the highest name), written by some crashed writer.
    raw.put("step-000007/attempt-20260101T000000Z-00000000abcd/model.pt", make_bytes("seven", 1000))
    assert set(k.split("/")[0] for k in raw.keys()) == {"step-000001", "step-000002", "step-000007"}

    assert store.steps() == [1]
    assert not store.is_complete(2) and not store.is_complete(7)
    assert store.status(2) == "uncommitted" and store.status(7) == "uncommitted"
    with caplog.at_level(logging.WARNING, logger="opd_store"):
        assert store.latest_step() == 1
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "step 7" in messages and "step 2" in messages
    assert [(i.step, i.status) for i in store.checkpoints()] == [(1, "complete"), (2, "uncommitted"), (7, "uncommitted")]
    with pytest.raises(CheckpointNotFoundError):
        store.manifest(2)
    with pytest.raises(CheckpointNotFoundError):
        store.read(7, "model.pt")

    # Resaving step 7 over the leftovers succeeds; the leftovers are ignored.
    committed = save(store, 7, {"model.pt": b"fresh"})
    assert store.latest_step() == 7 and store.read(7, "model.pt") == b"fresh"
    assert [e.path for e in store.manifest(7).payloads] == [f"{committed.attempt_id}/model.pt"]
    assert store.steps() == [1, 7]


def test_legacy_seed_layout(backend, raw, caplog):
    """A legacy step (the seed's COMPLETE marker, no manifest) is read through the legacy adapter;
    to the generic store it is uncommitted, and a save of it is refused."""
    store = open_store(backend)
    legacy = LegacyReader(store)
    save(store, 3, {"model.pt": b"new-layout"})
    raw.put("step-000005/COMPLETE", b"")
    raw.put("step-000005/training_state.pt", b"legacy-state")
    raw.put("step-000005/adapter/adapter_model.bin", b"legacy-adapter")

    assert [(i.step, i.status) for i in legacy.checkpoints()] == [(3, "complete"), (5, "legacy")]
    assert legacy.status(5) == "legacy" and store.status(5) == "uncommitted"
    assert not store.is_complete(5) and not legacy.is_complete(5)
    assert store.steps() == [3] and legacy.steps() == [3]
    assert store.latest_step() == 3
    assert legacy.latest_step() == 5
    assert legacy.verify(5).ok and legacy.verify(5).status == "legacy"
    assert legacy.names(5) == ["adapter/adapter_model.bin", "training_state.pt"]
    assert legacy.read(5, "training_state.pt") == b"legacy-state"
    with pytest.raises(CommitConflictError) as caught:
        store.begin(5)
    assert isinstance(caught.value, FileExistsError)
    assert "legacy" in str(caught.value)
    # Nothing was uploaded by the refused begin.
    assert sorted(k for k in raw.keys() if k.startswith("step-000005/")) == [
        "step-000005/COMPLETE", "step-000005/adapter/adapter_model.bin", "step-000005/training_state.pt",
    ]
    store.delete(5)
    assert not any(k.startswith("step-000005/") for k in raw.keys())
    assert legacy.latest_step() == 3


def test_delete_removes_manifest_first_then_prefix(backend, raw):
    from opd_store import CheckpointStore
    from opd_store.testing import FaultyStorage

    store = open_store(backend)
    save(store, 1, {"model.pt": b"one"})
    save(store, 2, {"model.pt": b"two", "nested/x.bin": b"xx"})
    # A leftover attempt of step 2 goes too.
    raw.put("step-000002/attempt-20260101T000000Z-0000000000ff/model.pt", b"leftover")
    spy = FaultyStorage(store.storage)
    CheckpointStore.from_storage(spy).delete(2)
    mutating = [(op.kind, op.rel) for op in spy.mutating_ops]
    assert mutating[0] == ("delete", "step-000002/manifest.json")
    assert mutating[-1] == ("delete_tree", "step-000002")
    assert [k for k in raw.keys() if k.startswith("step-000002")] == []
    assert store.steps() == [1]
    assert not store.is_complete(2) and store.status(2) == "uncommitted"
    assert store.latest_step() == 1
    store.delete(2)  # deleting a missing step is not an error
    store.delete(42)
    assert store.read(1, "model.pt") == b"one"


def test_empty_store_and_missing_things(backend):
    store = open_store(backend)
    assert store.steps() == []
    assert store.checkpoints() == []
    assert not store.is_complete(0)
    with pytest.raises(CheckpointNotFoundError) as caught:
        store.latest_step()
    assert isinstance(caught.value, FileNotFoundError)
    with pytest.raises(CheckpointNotFoundError):
        store.manifest(1)
    with pytest.raises(CheckpointNotFoundError):
        store.read(1, "model.pt")
    save(store, 1, {"model.pt": b"one"})
    with pytest.raises(CheckpointNotFoundError):
        store.read(1, "other.pt")
    with pytest.raises(CommitConflictError):
        store.begin(1)


SPECIAL_NAMES = {
    "with space.pt": b"a",
    "plus+sign.bin": b"bb",
    "pct%20x.bin": b"ccc",
    "\u00fcn\u00ef/\u00e7\u00f8d\u00e9.bin": b"dddd",
    "semi;colon=eq&amp.bin": b"e",
    "tilde~q'uote(1).bin": b"ff",
    "dollar$at@comma,.bin": b"g",
}


def test_special_characters_in_payload_names(backend, raw):
    """URL-encoded listings (S3 ``encoding-type=url``), JSON API paths (GCS): names with spaces,
    ``+``, ``%``, non-ASCII and punctuation come back exactly."""
    store = open_store(backend)
    txn = save(store, 1, SPECIAL_NAMES)
    assert set(raw.keys()) == {"step-000001/manifest.json"} | {f"step-000001/{txn.attempt_id}/{n}" for n in SPECIAL_NAMES}
    assert store.is_complete(1) and store.verify(1, deep=True).ok
    assert [i.status for i in store.checkpoints()] == ["complete"]
    for name, data in SPECIAL_NAMES.items():
        assert store.read(1, name) == data
        assert raw.cat(f"step-000001/{txn.attempt_id}/{name}") == data


def _root_url(backend) -> str:
    if backend.name == "memory":
        return "memory://"
    if backend.name in ("s3", "gcs"):
        scheme, _, rest = backend.url.partition("://")
        return f"{scheme}://{rest.split('/')[0]}"  # the bucket itself
    return backend.url


@pytest.mark.parametrize("trailing_slash", [False, True])
def test_store_at_filesystem_or_bucket_root(backend, trailing_slash):
    """A store at the root of its filesystem or bucket: checkpoint URLs keep a usable spelling
    and round-trip through split_checkpoint_url."""
    root = _root_url(backend) + ("/" if trailing_slash else "")
    store = open_store(dataclasses.replace(backend, url=root))
    save(store, 2, {"m.pt": b"root"})
    step_url = store.step_url(2)
    assert step_url.endswith("/step-000002") and "//step" not in step_url.split("://", 1)[-1]
    if backend.name != "local":
        assert step_url.startswith(root.rstrip("/") + "/") or step_url.startswith(root)
    other, step = split_checkpoint_url(step_url, backend.storage_options)
    assert step == 2 and other.url == store.url and other.read(2, "m.pt") == b"root"
    assert other.latest_step() == 2


def test_explicit_step_read_whatever_latest_is(backend):
    """Steps 4 and 6 committed: loading step 4 explicitly returns step 4's bytes."""
    store = open_store(backend)
    save(store, 4, {"m.pt": b"four"})
    save(store, 6, {"m.pt": b"six"})
    assert store.latest_step() == 6
    assert store.read(4, "m.pt") == b"four" and store.manifest(4).step == 4
