"""``TierRetention``: a retention policy as a tiered store's per-tier hook (issue 6 x issue 8)."""

from __future__ import annotations

import pytest

from opd_store import CheckpointStore
from opd_store.gc import TierRetention
from opd_store.pins import pin
from opd_store.retention import RetentionPolicy
from opd_store.tiered import TieredStore


def _commit(store: CheckpointStore, step: int) -> None:
    with store.begin(step) as txn:
        txn.write_bytes("model.bin", step.to_bytes(4, "big") * 4)


def test_policy_deletes_what_it_does_not_keep_except_protected_and_pinned(backend):
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    for step in (2, 4, 6, 8, 10, 12):
        _commit(store, step)
    pin(store, 4)
    hook = TierRetention(RetentionPolicy(keep_last=2))
    assert hook(store, frozenset({6})) == [2, 8]
    assert store.steps() == [4, 6, 10, 12]
    assert all(store.is_complete(step) for step in (4, 6, 10, 12))
    assert store.read(6, "model.bin") == (6).to_bytes(4, "big") * 4


def test_keep_every_alone_keeps_the_multiples_and_the_newest(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    for step in (1, 2, 3, 4, 5):
        _commit(store, step)
    assert TierRetention(RetentionPolicy(keep_every=2))(store, frozenset()) == [1, 3]
    assert store.steps() == [2, 4, 5]


def test_a_policy_that_keeps_everything_is_refused():
    with pytest.raises(ValueError, match="keeps every step"):
        TierRetention(RetentionPolicy())


def test_as_the_bucket_hook_of_a_tiered_store(tmp_path):
    store = TieredStore(tmp_path / "local", tmp_path / "bucket", local_keep_last=1,
                        bucket_retention=TierRetention(RetentionPolicy(keep_last=2)))
    with store:
        for step in (1, 2, 3, 4):
            _commit(store, step)
            store.flush()
        assert store.durable_steps() == [3, 4]
        assert store.local_steps() == [4]
    assert CheckpointStore(tmp_path / "bucket").read(3, "model.bin") == (3).to_bytes(4, "big") * 4


def test_a_bucket_that_keeps_fewer_steps_than_the_local_tier_does_not_grow_the_local_tier(tmp_path):
    store = TieredStore(tmp_path / "local", tmp_path / "bucket", local_keep_last=2,
                        bucket_retention=TierRetention(RetentionPolicy(keep_last=1)))
    with store:
        for step in (1, 2, 3, 4, 5):
            _commit(store, step)
            store.flush()
        assert store.durable_steps() == [5]
        # 1-3 were deleted from the bucket by its retention, so they are not "waiting for upload":
        # the local tier keeps its own newest two.
        assert store.local_steps() == [4, 5]
        assert store.upload_pending() == []


def test_a_failing_pass_is_logged_and_the_next_one_finishes(tmp_path, caplog, monkeypatch):
    store = CheckpointStore(tmp_path / "store")
    for step in (1, 2, 3):
        _commit(store, step)
    hook = TierRetention(RetentionPolicy(keep_last=1))
    real_delete = CheckpointStore.delete

    def failing_delete(self, step):
        if step == 2:
            raise PermissionError(f"AccessDenied deleting step {step}")
        return real_delete(self, step)

    monkeypatch.setattr(CheckpointStore, "delete", failing_delete)
    with caplog.at_level("WARNING", logger="opd_store.gc"):
        assert hook(store, frozenset()) == [1]
    assert "AccessDenied deleting step 2" in caplog.text and "after deleting [1]" in caplog.text
    assert store.steps() == [2, 3]
    monkeypatch.setattr(CheckpointStore, "delete", real_delete)
    assert hook(store, frozenset()) == [2]
    assert store.steps() == [3]
