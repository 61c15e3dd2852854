"""Freshness: every answer reflects the backend as it is now, on the same instance, on a second
instance and in a second process, with no manual refresh (s3fs and gcsfs cache listings and
sizes per instance; none of that may leak into a decision)."""

from __future__ import annotations

import pytest
from proc_writer import make_bytes, payloads_for

from opd_store import CheckpointNotFoundError, IntegrityError

from .helpers import Proc, open_store, run_proc, save


def _state(store, *steps: int):
    try:
        latest = store.latest_step()
    except CheckpointNotFoundError:
        latest = None
    return store.steps(), latest, {s: store.is_complete(s) for s in steps}


def test_same_instance_sees_its_own_commit(backend, raw):
    """Lists [1, 2], commits 3 with a small manifest, lists [1, 2, 3]."""
    store = open_store(backend)
    save(store, 1, {"m.pt": b"1"})
    save(store, 2, {"m.pt": b"2"})
    assert _state(store, 3) == ([1, 2], 2, {3: False})
    save(store, 3, {"m.pt": b"3"})
    assert _state(store, 3) == ([1, 2, 3], 3, {3: True})
    assert [i.step for i in store.checkpoints()] == [1, 2, 3]
    assert sorted(k for k in raw.keys() if k.endswith("manifest.json")) == [
        f"step-00000{s}/manifest.json" for s in (1, 2, 3)
    ]


def test_new_sub_prefix_listed(backend):
    """Save 1, list, save 2 (a new sub-prefix), list again: both shown."""
    store = open_store(backend)
    save(store, 1, {"a/b/m.pt": b"1"})
    assert store.steps() == [1] and [i.step for i in store.checkpoints()] == [1]
    save(store, 2, {"a/b/m.pt": b"2", "c/d.bin": b"d"})
    assert store.steps() == [1, 2]
    assert [(i.step, i.status) for i in store.checkpoints()] == [(1, "complete"), (2, "complete")]
    assert store.names(2) == ["a/b/m.pt", "c/d.bin"]


def test_delete_seen_at_once_by_same_instance(backend):
    """Commit 1-3, delete 3: steps, is_complete and latest agree (latest 2)."""
    store = open_store(backend)
    for step in (1, 2, 3):
        save(store, step, {"m.pt": str(step).encode()})
    assert _state(store, 3) == ([1, 2, 3], 3, {3: True})
    store.delete(3)
    assert _state(store, 3) == ([1, 2], 2, {3: False})
    assert store.status(3) == "uncommitted"
    assert [i.step for i in store.checkpoints()] == [1, 2]


def test_second_instance_sees_commit_and_delete_at_once(backend):
    writer = open_store(backend)
    reader = open_store(backend)
    save(writer, 1, {"m.pt": b"1"})
    # Prime every cache the reader has: listings, sizes, the manifest.
    assert _state(reader, 1, 2) == ([1], 1, {1: True, 2: False})
    assert reader.read(1, "m.pt") == b"1"
    save(writer, 2, {"m.pt": b"2"})
    assert _state(reader, 1, 2) == ([1, 2], 2, {1: True, 2: True})
    assert reader.read(2, "m.pt") == b"2"
    writer.delete(2)
    assert _state(reader, 1, 2) == ([1], 1, {1: True, 2: False})
    writer.delete(1)
    assert _state(reader, 1, 2) == ([], None, {1: False, 2: False})
    with pytest.raises(CheckpointNotFoundError):
        reader.read(1, "m.pt")
    # And a new save of the deleted step is seen too.
    save(writer, 1, {"m.pt": b"again"})
    assert reader.read(1, "m.pt") == b"again"


@pytest.mark.parametrize("backend", ["local", "s3", "gcs"], indirect=True)
def test_other_process_sees_commit_and_delete_at_once(backend):
    store = open_store(backend)
    save(store, 1, {"m.pt": b"1"})
    observer = Proc(backend, "observe")
    try:
        observer.expect("ready")
        assert observer.query("query 1,2") == {"steps": [1], "latest": 1, "complete": {"1": True, "2": False}}
        save(store, 2, {"m.pt": b"2"})
        assert observer.query("query 1,2") == {"steps": [1, 2], "latest": 2, "complete": {"1": True, "2": True}}
        store.delete(2)
        assert observer.query("query 1,2") == {"steps": [1], "latest": 1, "complete": {"1": True, "2": False}}
        observer.send("quit")
        assert observer.result() == {"done": True}
    finally:
        observer.kill()


@pytest.mark.parametrize("backend", ["local", "s3", "gcs"], indirect=True)
def test_no_negative_answer_cached(backend):
    """is_complete(7) is False; another process commits 7; the same instance says
    True and latest is 7. Then another process deletes it: the instance sees that too."""
    store = open_store(backend)
    save(store, 3, {"m.pt": b"3"})
    assert _state(store, 7) == ([3], 3, {7: False})
    assert store.status(7) == "uncommitted"
    result = run_proc(backend, "save", "7", "other")
    assert result["outcome"] == "committed"
    assert _state(store, 7) == ([3, 7], 7, {7: True})
    assert store.manifest(7).attempt_id == result["attempt_id"]
    assert store.read(7, "model.pt") == payloads_for("other")["model.pt"]
    assert run_proc(backend, "delete", "7") == {"deleted": 7}
    assert _state(store, 7) == ([3], 3, {7: False})


def test_stale_size_never_used(backend, raw):
    """An object overwritten behind the store's back (longer, other bytes) after the store read
    it: the store sees the new size, and never returns a truncated body as valid."""
    store = open_store(backend)
    data = make_bytes("orig", 3000)
    txn = save(store, 1, {"m.pt": data})
    assert store.read(1, "m.pt") == data and store.is_complete(1)
    rel = f"step-000001/{txn.attempt_id}/m.pt"
    raw.put(rel, make_bytes("other", 5000))
    assert not store.is_complete(1)
    assert [(p.kind, p.name) for p in store.verify(1).problems] == [("size", "m.pt")]
    with pytest.raises(IntegrityError) as caught:
        store.read(1, "m.pt")
    assert "5000" in str(caught.value) and "3000" in str(caught.value)
