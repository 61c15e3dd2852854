"""Crash points: fail the Nth mutating operation of a save, for every N, and the commit's
ambiguous outcomes.

``tests/faults.py`` wraps the store's Storage and fails one operation (a payload ``write`` call,
a payload ``close``, the directory ``sync``, the manifest ``create``, a ``delete``). After each
failure: the exception reaches the caller, the step is not complete and not latest, and the
previous latest step is still latest and reads back byte-identical (through the store and raw).
"""

from __future__ import annotations

import gc
import logging

import pytest
from proc_writer import make_bytes

from opd_store import (
    AmbiguousCommitError,
    CheckpointStore,
    CommitConflictError,
    CommitError,
    IncompleteCheckpointError,
)
from opd_store.format import Manifest, PayloadEntry, Writer
from opd_store.testing import Fault, FaultyStorage, InjectedFault

from .helpers import crc_hex, open_store, save

# Each gc.collect() below scans only what the test made (the fixture freezes older objects).
pytestmark = pytest.mark.usefixtures("gc_of_this_test")

PREV, K = 1, 2
PREV_PAYLOADS = {"model.pt": make_bytes("prev-model", 6000), "nested/opt.pt": make_bytes("prev-opt", 2500)}
K_PAYLOADS = {
    "model.pt": make_bytes("k-model", 3 * 1024),  # 3 write calls of 1 KiB
    "nested/opt.pt": make_bytes("k-opt", 2 * 1024),  # 2 write calls
    "empty.bin": b"",  # no write call, only a close
}
CHUNK = 1024


def _save_k(store):
    return save(store, K, K_PAYLOADS, metadata={"step": K}, chunk=CHUNK)


def _chain(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _assert_previous_intact(store, raw, prev_attempt: str, *, raw_bytes: bool = False) -> None:
    assert not store.is_complete(K)
    assert store.steps() == [PREV]
    assert store.latest_step() == PREV
    for name, data in PREV_PAYLOADS.items():
        assert store.read(PREV, name) == data  # size and CRC32C checked against the manifest too
        if raw_bytes:
            assert raw.cat(f"step-{PREV:06d}/{prev_attempt}/{name}") == data
    prev_keys = {k: size for k, size in raw.keys().items() if k.startswith(f"step-{PREV:06d}/")}
    assert set(prev_keys) == {f"step-{PREV:06d}/manifest.json"} | {
        f"step-{PREV:06d}/{prev_attempt}/{n}" for n in PREV_PAYLOADS
    }
    for name, data in PREV_PAYLOADS.items():
        assert prev_keys[f"step-{PREV:06d}/{prev_attempt}/{name}"] == len(data)


def _count_clean_save(store) -> list:
    """The mutating ops of a clean save of K (then K is deleted again)."""
    spy = FaultyStorage(store.storage)
    txn = _save_k(CheckpointStore.from_storage(spy))
    assert store.is_complete(K) and store.latest_step() == K
    assert store.manifest(K).attempt_id == txn.attempt_id
    ops = [(op.kind, op.rel.rsplit("/", 1)[-1]) for op in spy.mutating_ops]
    store.delete(K)
    return ops


# S3 once (moto): the faults are injected in front of the storage, so a second S3 server would run
# the same client code; SeaweedFS's own answers to these writes and deletes are checked by
# tests/core/test_storage_conformance.py and its create-only commits by tests/core/test_races.py.
@pytest.mark.parametrize("backend", ["local", "memory", "s3", "gcs"], indirect=True)
def test_fail_every_mutating_op_of_a_save(backend, raw):
    store = open_store(backend)
    prev_attempt = save(store, PREV, PREV_PAYLOADS).attempt_id
    ops = _count_clean_save(store)
    # 3 + 2 writes, 3 closes, the sync of the attempt prefix, the manifest create.
    assert [kind for kind, _ in ops] == ["write"] * 3 + ["close"] + ["write"] * 2 + ["close", "close", "sync", "create"]
    assert [name for kind, name in ops if kind in ("write", "close")] == ["model.pt"] * 4 + ["opt.pt"] * 3 + ["empty.bin"]
    assert ops[-2][1].startswith("attempt-") and ops[-1] == ("create", "manifest.json")
    _assert_previous_intact(store, raw, prev_attempt)

    for n, (kind, _name) in enumerate(ops, start=1):
        spy = FaultyStorage(store.storage, Fault(at=n))
        with pytest.raises(Exception) as caught:
            _save_k(CheckpointStore.from_storage(spy))
        failed = [op for op in spy.ops if op.failed]
        assert [(op.index, op.kind) for op in failed] == [(n, kind)]
        if kind == "create":
            # Not landed, and the read-back finds no manifest: a plain commit failure.
            assert type(caught.value) is CommitError, repr(caught.value)
            assert isinstance(caught.value.__cause__, InjectedFault)
        else:
            assert isinstance(caught.value, InjectedFault), repr(caught.value)
            # The aborted attempt removed its own objects, and no writer left open publishes
            # later (an fsspec buffered file uploads when garbage-collected unless discarded).
            del caught
            gc.collect()
            assert [k for k in raw.keys() if k.startswith(f"step-{K:06d}/")] == []
        _assert_previous_intact(store, raw, prev_attempt)

    _assert_previous_intact(store, raw, prev_attempt, raw_bytes=True)
    assert store.status(K) == "uncommitted"
    # Leftovers (the CommitError case kept its payloads) never block a later save of K.
    txn = _save_k(store)
    assert store.latest_step() == K and store.manifest(K).attempt_id == txn.attempt_id
    for name, data in K_PAYLOADS.items():
        assert store.read(K, name) == data


@pytest.mark.parametrize("backend", ["local", "memory"], indirect=True)
@pytest.mark.parametrize("variant", ["landed", "cleanup-fails"])
def test_fail_every_op_variants(backend, raw, variant):
    """``landed``: the op takes effect, then raises (an upload whose response was lost).
    ``cleanup-fails``: the op fails and so does every delete of the abort that follows."""
    store = open_store(backend)
    prev_attempt = save(store, PREV, PREV_PAYLOADS).attempt_id
    ops = _count_clean_save(store)
    for n, (kind, _name) in enumerate(ops, start=1):
        if variant == "landed":
            faults = [Fault(at=n, landed=True)]
        else:
            faults = [Fault(at=n), Fault(when=lambda op: op.kind in ("delete", "delete_tree"), once=False)]
        spy = FaultyStorage(store.storage, faults)
        fstore = CheckpointStore.from_storage(spy)
        if variant == "landed" and kind == "create":
            # The manifest landed although the create raised: read back, it is ours: success.
            txn = _save_k(fstore)
            assert store.latest_step() == K and store.manifest(K).attempt_id == txn.attempt_id
            store.delete(K)
            continue
        with pytest.raises(Exception) as caught:
            _save_k(fstore)
        # The first failure is what the caller sees, never a cleanup error.
        assert any(isinstance(e, InjectedFault) and f"#{n} " in str(e) for e in _chain(caught.value)), repr(caught.value)
        _assert_previous_intact(store, raw, prev_attempt)
    txn = _save_k(store)
    assert store.latest_step() == K and store.manifest(K).attempt_id == txn.attempt_id


# -- the commit's outcomes ---------------------------------------------------------------------

COMMIT_BACKENDS = ["local", "memory", "s3", "gcs"]


def _begin_k(fstore):
    txn = fstore.begin(K, metadata={"step": K})
    for name, data in K_PAYLOADS.items():
        txn.write_bytes(name, data)
    return txn


@pytest.mark.parametrize("backend", COMMIT_BACKENDS, indirect=True)
@pytest.mark.parametrize("error", [TimeoutError("read timed out"), ConnectionResetError("reset by peer"),
                                   FileExistsError("412 on a retry of a create that landed")])
def test_ambiguous_commit_that_landed_is_success(backend, raw, error, caplog):
    store = open_store(backend)
    prev_attempt = save(store, PREV, PREV_PAYLOADS).attempt_id
    spy = FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "create", exc=error, landed=True))
    fstore = CheckpointStore.from_storage(spy)
    txn = _begin_k(fstore)
    with caplog.at_level(logging.WARNING, logger="opd_store"):
        assert txn.commit() == store.step_url(K)
    assert txn.committed_url == store.step_url(K)
    assert any(txn.attempt_id in r.getMessage() and "landed" in r.getMessage() for r in caplog.records)
    assert store.manifest(K).attempt_id == txn.attempt_id
    assert store.latest_step() == K and store.is_complete(K) and store.verify(K, deep=True).ok
    for name, data in K_PAYLOADS.items():
        assert store.read(K, name) == data
    assert raw.cat(f"step-{PREV:06d}/{prev_attempt}/model.pt") == PREV_PAYLOADS["model.pt"]


def _foreign_manifest(rel_prefix_writer, step: int) -> tuple[str, bytes]:
    attempt = "attempt-20260101T000000Z-0000000f0e19"
    data = b"foreign payload"
    rel_prefix_writer(f"step-{step:06d}/{attempt}/model.pt", data)
    manifest = Manifest(
        step=step, attempt_id=attempt, writer=Writer(host="other-host", pid=4242), created_at="2026-01-01T00:00:00Z",
        payloads=(PayloadEntry(name="model.pt", path=f"{attempt}/model.pt", size_bytes=len(data), crc32c=crc_hex(data)),),
    )
    return attempt, manifest.to_json_bytes()


@pytest.mark.parametrize("backend", COMMIT_BACKENDS, indirect=True)
def test_commit_lost_to_another_attempt(backend, raw):
    """Another attempt's manifest lands just before ours: CommitConflictError, our payloads are
    deleted, the other attempt's checkpoint stays whole."""
    store = open_store(backend)
    save(store, PREV, PREV_PAYLOADS)
    foreign = {}

    def other_writer_wins(inner, rel, _data):
        attempt, manifest_bytes = _foreign_manifest(raw.put, K)
        inner.create_exclusive(rel, manifest_bytes)
        foreign["attempt"] = attempt

    spy = FaultyStorage(store.storage, before_create=other_writer_wins)
    txn = _begin_k(CheckpointStore.from_storage(spy))
    with pytest.raises(CommitConflictError) as caught:
        txn.commit()
    assert isinstance(caught.value, FileExistsError)
    assert isinstance(caught.value.__cause__, FileExistsError)  # the backend's refusal
    assert foreign["attempt"] in str(caught.value) and txn.attempt_id in str(caught.value)
    assert [k for k in raw.keys() if f"/{txn.attempt_id}/" in k] == []
    assert store.manifest(K).attempt_id == foreign["attempt"]
    assert store.latest_step() == K and store.read(K, "model.pt") == b"foreign payload"


@pytest.mark.parametrize("backend", COMMIT_BACKENDS, indirect=True)
def test_commit_failed_without_manifest_keeps_payloads(backend, raw):
    store = open_store(backend)
    prev_attempt = save(store, PREV, PREV_PAYLOADS).attempt_id
    spy = FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "create", exc=TimeoutError("timed out")))
    txn = _begin_k(CheckpointStore.from_storage(spy))
    with pytest.raises(CommitError) as caught:
        txn.commit()
    assert not isinstance(caught.value, (CommitConflictError, AmbiguousCommitError))
    assert isinstance(caught.value, OSError)
    assert isinstance(caught.value.__cause__, TimeoutError)
    # Payloads kept: a delayed create could still land and name them.
    assert {k for k in raw.keys() if f"/{txn.attempt_id}/" in k} == {
        f"step-{K:06d}/{txn.attempt_id}/{name}" for name in K_PAYLOADS
    }
    _assert_previous_intact(store, raw, prev_attempt)
    with pytest.raises(ValueError):
        txn.commit()  # the transaction is over


@pytest.mark.parametrize("backend", ["local", "memory", "s3"], indirect=True)
@pytest.mark.parametrize("landed", [False, True])
def test_commit_and_read_back_both_fail_is_ambiguous(backend, raw, landed):
    store = open_store(backend)
    save(store, PREV, PREV_PAYLOADS)
    spy = FaultyStorage(
        store.storage,
        Fault(when=lambda op: op.kind == "create", exc=ConnectionResetError("reset"), landed=landed),
        read_fault=Fault(when=lambda op: op.kind == "read" and op.rel.endswith("manifest.json"),
                         exc=TimeoutError("read-back timed out")),
    )
    txn = _begin_k(CheckpointStore.from_storage(spy))
    with pytest.raises(AmbiguousCommitError) as caught:
        txn.commit()
    assert isinstance(caught.value, CommitError) and isinstance(caught.value.__cause__, ConnectionResetError)
    assert "may or may not" in str(caught.value)
    # Payloads are kept either way; the truth is whatever the backend holds now.
    assert {k for k in raw.keys() if f"/{txn.attempt_id}/" in k} == {
        f"step-{K:06d}/{txn.attempt_id}/{name}" for name in K_PAYLOADS
    }
    assert store.is_complete(K) is landed
    assert store.latest_step() == (K if landed else PREV)


@pytest.mark.parametrize("backend", ["local", "memory"], indirect=True)
def test_open_writer_blocks_commit(backend, raw):
    store = open_store(backend)
    save(store, PREV, PREV_PAYLOADS)
    txn = store.begin(K)
    txn.write_bytes("a.bin", b"a")
    writer = txn.open("model.pt")
    writer.write(b"half of it")
    with pytest.raises(IncompleteCheckpointError) as caught:
        txn.commit()
    assert "model.pt" in str(caught.value)
    assert store.steps() == [PREV] and not store.is_complete(K)
    assert [k for k in raw.keys() if k.startswith(f"step-{K:06d}/")] == []
