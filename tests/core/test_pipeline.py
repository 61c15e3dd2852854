"""The one save sequence (:mod:`opd_store.pipeline._save`) on its own: write parts under an attempt,
commit, then the after-commit stage in order; what it gives back when a stage fails."""

from __future__ import annotations

import threading

import pytest

from opd_store import CheckpointStore, CommitConflictError, TieredStore
from opd_store.errors import RetentionError, SaveAbandonedError
from opd_store.pipeline import AfterCommit, SaveRequest, run_save, write_and_commit
from opd_store.retention import RetentionPolicy
from opd_store.testing import Fault, FaultyStorage


def _request(store, step: int, released: list[int], **kwargs) -> SaveRequest:
    def write(txn, shared: bool) -> None:
        assert shared
        txn.write_bytes("model.bin", step.to_bytes(4, "big") * 4)

    return SaveRequest(AfterCommit(store, step, **kwargs), world_size=1, metadata={"step": step}, write=write,
                       release=lambda: released.append(step))


def test_stages_run_in_order_and_hooks_see_retention_done(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    released: list[int] = []
    seen: list[tuple[int, str, list[int]]] = []
    for step in (1, 2, 3):
        request = _request(store, step, released, retention=RetentionPolicy(keep_last=1))
        request.after.on_commit.append(lambda after, url: seen.append((after.step, url, store.steps())))
        assert run_save(request) == store.step_url(step)
    assert released == [1, 2, 3]  # the snapshot's resources, freed once the write stage ended
    assert seen == [(1, store.step_url(1), [1]), (2, store.step_url(2), [2]), (3, store.step_url(3), [3])]
    assert store.manifest(3).metadata == {"step": 3} and store.read(3, "model.bin") == (3).to_bytes(4, "big") * 4


def test_a_refused_step_still_releases_the_snapshot_and_runs_no_hook(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    released: list[int] = []
    run_save(_request(store, 1, released))
    request = _request(store, 1, released, retention=RetentionPolicy(keep_last=1))
    request.after.on_commit.append(lambda after, url: pytest.fail("no hook after a refused commit"))
    with pytest.raises(CommitConflictError, match="step 1 is committed"):
        run_save(request)
    assert released == [1, 1]


def test_a_cancelled_save_is_abandoned_before_its_commit(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    cancelled = threading.Event()
    released: list[int] = []
    request = _request(store, 1, released)
    with pytest.raises(SaveAbandonedError, match="abandoned before its commit"):
        write_and_commit(request, cancelled=cancelled, before_commit=cancelled.set)
    assert store.steps() == [] and store.storage.list_tree("step-000001") == {}


def test_the_retention_hook_of_a_plain_store_raises_a_retention_error_after_the_commit(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    run_save(_request(store, 1, []))
    failing = CheckpointStore.from_storage(FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "delete")))
    with pytest.raises(RetentionError, match="after committing step 2"):
        run_save(_request(failing, 2, [], retention=RetentionPolicy(keep_last=1)))
    assert store.steps() == [1, 2] and store.is_complete(2)


def test_on_a_tiered_store_the_retention_hook_waits_for_the_upload(tmp_path):
    store = TieredStore(tmp_path / "local", tmp_path / "bucket")
    for step in (1, 2, 3):
        run_save(_request(store, step, [], retention=RetentionPolicy(keep_last=1)))
    store.flush()
    assert CheckpointStore(tmp_path / "bucket").steps() == [3]
    assert CheckpointStore(tmp_path / "local").steps() == [2, 3]
    store.close()
