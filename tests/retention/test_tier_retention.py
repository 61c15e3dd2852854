"""Retention of each tier of a tiered store: ``bucket_retention``/``local_retention`` policies run by
the one executor after each upload, with the steps that are not durable protected."""

from __future__ import annotations

import pytest

from opd_store import CheckpointStore
from opd_store.errors import RetentionError, UploadError
from opd_store.retention import RetentionPolicy, apply_retention
from opd_store.store import pin
from opd_store.tiered import TieredStore


def _commit(store: CheckpointStore, step: int) -> None:
    with store.begin(step) as txn:
        txn.write_bytes("model.bin", step.to_bytes(4, "big") * 4)


def test_policy_deletes_what_it_does_not_keep_except_not_durable_and_pinned(backend):
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    for step in (2, 4, 6, 8, 10, 12):
        _commit(store, step)
    pin(store, 4)
    report = apply_retention(store, RetentionPolicy(keep_last=2), not_durable={6})
    assert report.deleted_steps == [2, 8]
    assert report.plan.keep[6] == ("not-durable",) and report.plan.keep[4] == ("pinned",)
    assert store.steps() == [4, 6, 10, 12]
    assert all(store.is_complete(step) for step in (4, 6, 10, 12))
    assert store.read(6, "model.bin") == (6).to_bytes(4, "big") * 4


def test_keep_every_alone_keeps_the_multiples_and_the_newest(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    for step in (1, 2, 3, 4, 5):
        _commit(store, step)
    assert apply_retention(store, RetentionPolicy(keep_every=2)).deleted_steps == [1, 3]
    assert store.steps() == [2, 4, 5]


def test_a_retention_that_is_not_a_policy_is_refused(tmp_path):
    with pytest.raises(TypeError, match="bucket_retention takes a RetentionPolicy"):
        TieredStore(tmp_path / "local", tmp_path / "bucket", bucket_retention=lambda store, protected: None)
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        TieredStore(tmp_path / "local", tmp_path / "bucket", local_keep_last=0)
    # Every entry point taking a retention checks it before any work (one rule, check_retention).
    from opd_store.job import train

    store = CheckpointStore(tmp_path / "store")
    _commit(store, 1)
    refusal = r"retention takes a RetentionPolicy or None, got 3 \(int\) \(for the newest 3 steps: "
    with pytest.raises(TypeError, match="^" + refusal):
        train(store=CheckpointStore(tmp_path / "train"), updates=1, checkpoint_every=1, retention=3)
    with pytest.raises(TypeError, match=r"^local_retention takes a RetentionPolicy or None, got 2 \(int\)"):
        TieredStore(tmp_path / "local", tmp_path / "bucket", local_retention=2)
    with pytest.raises(TypeError, match=r"^policy takes a RetentionPolicy or None, got 1 \(int\)"):
        apply_retention(store, 1)
    assert store.steps() == [1] and not (tmp_path / "train").exists() and not (tmp_path / "local").exists()


def test_as_the_bucket_retention_of_a_tiered_store(tmp_path):
    store = TieredStore(tmp_path / "local", tmp_path / "bucket", local_keep_last=1,
                        bucket_retention=RetentionPolicy(keep_last=2))
    with store:
        for step in (1, 2, 3, 4):
            _commit(store, step)
            store.flush()
        assert store.durable_steps() == [3, 4]
        assert store.local_steps() == [4]
    assert CheckpointStore(tmp_path / "bucket").read(3, "model.bin") == (3).to_bytes(4, "big") * 4


def test_a_bucket_that_keeps_fewer_steps_than_the_local_tier_does_not_grow_the_local_tier(tmp_path):
    store = TieredStore(tmp_path / "local", tmp_path / "bucket", local_keep_last=2,
                        bucket_retention=RetentionPolicy(keep_last=1))
    with store:
        for step in (1, 2, 3, 4, 5):
            _commit(store, step)
            store.flush()
        assert store.durable_steps() == [5]
        # 1-3 were deleted from the bucket by its retention, so they are not "waiting for upload":
        # the local tier keeps its own newest two.
        assert store.local_steps() == [4, 5]
        assert store.upload_pending() == []


def test_a_failing_pass_is_raised_and_the_next_one_finishes(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "store")
    for step in (1, 2, 3):
        _commit(store, step)
    real_delete = CheckpointStore.delete

    def failing_delete(self, step):
        if step == 2:
            raise PermissionError(f"AccessDenied deleting step {step}")
        return real_delete(self, step)

    monkeypatch.setattr(CheckpointStore, "delete", failing_delete)
    with pytest.raises(PermissionError, match="AccessDenied deleting step 2"):
        apply_retention(store, RetentionPolicy(keep_last=1))
    assert store.steps() == [2, 3]  # 1 went before the failure
    # On a tiered store the same failure is the caller's at the next flush, not a log line.
    tiered = TieredStore(tmp_path / "local", store, bucket_retention=RetentionPolicy(keep_last=1))
    _commit(tiered, 4)
    with pytest.raises(UploadError, match="retention .* after the upload of step 4") as caught:
        tiered.flush()
    assert isinstance(caught.value.__cause__, RetentionError)
    assert isinstance(caught.value.__cause__.__cause__, PermissionError)
    assert tiered.is_durable(4)
    monkeypatch.setattr(CheckpointStore, "delete", real_delete)
    assert apply_retention(store, RetentionPolicy(keep_last=1)).deleted_steps == [2, 3]
    assert store.steps() == [4]
    tiered.close()
