"""Retention applied by ``save_opd_checkpoint`` after its own commit, never deleting the step a run
resumed from (a run that resumes and crashes before its first save still finds that step).

Real saves and loads of the OPD layer (small real torch objects from opd_testkit.opd), on
local disk and S3 (moto server). Crashes are injected with opd_store.testing.FaultyStorage: a ``KeyboardInterrupt``
raised by the storage stands for the process dying at that operation.
"""

from __future__ import annotations

import pytest
from opd_testkit import opd as helpers
from opd_testkit.stores import open_store

from opd_store import CheckpointStore, RetentionError
from opd_store.opd import OPDConfig, load_opd_checkpoint, save_opd_checkpoint
from opd_store.retention import RetentionPolicy, RunLineage, collect_garbage
from opd_store.store import pin
from opd_store.testing import Fault, FaultyStorage, InjectedFault


def save(store, step: int, **kwargs) -> str:
    return save_opd_checkpoint(**helpers.save_kwargs(store, successful=step, **kwargs))


def load(store, step: int) -> dict:
    return load_opd_checkpoint((store, step), **helpers.load_kwargs())


def test_config_section_gives_the_policy():
    config = OPDConfig.model_validate({"checkpoint": {"keep_last": 2, "keep_every": 1000}})
    assert config.checkpoint.retention_policy() == RetentionPolicy(keep_last=2, keep_every=1000)
    assert OPDConfig().checkpoint.retention_policy() == RetentionPolicy(keep_last=3)


def test_save_applies_retention_after_its_commit(backend):
    store = open_store(backend)
    policy = RetentionPolicy(keep_last=2)
    for step in (2, 4, 6, 8):
        url = save(store, step, retention=policy)
        assert url == store.step_url(step)
    assert store.steps() == [6, 8]
    assert load(store, 8)["successful_updates"] == 8
    assert save(store, 10) == store.step_url(10)  # no retention keyword: nothing deleted
    assert store.steps() == [6, 8, 10]


def test_the_step_just_committed_is_never_deleted(backend):
    store = open_store(backend)
    for step in (600, 700):
        save(store, step)
    url = save(store, 510, retention=RetentionPolicy(keep_last=1))
    assert url == store.step_url(510)
    assert store.steps() == [510, 700]  # 700 newest complete, 510 just committed; 600 deleted


def test_pinned_steps_are_never_deleted_by_a_save(backend):
    store = open_store(backend)
    for step in (2, 4):
        save(store, step)
    pin(store, 2)
    save(store, 6, retention=RetentionPolicy(keep_last=1))
    assert store.steps() == [2, 6]


def test_resume_parent_is_kept_until_the_run_commits_its_second_checkpoint(backend):
    store = open_store(backend)
    run_1 = RunLineage.new()
    for step in (500, 600, 700):
        save(store, step, lineage=run_1)
    assert store.manifest(600).metadata["run_id"] == run_1.run_id
    assert store.manifest(600).metadata["parent_step"] is None
    # Run 2 resumes from 500 (explicitly, not the newest), then keeps only 1.
    load(store, 500)
    run_2 = RunLineage.new(parent_step=500)
    policy = RetentionPolicy(keep_last=1)
    save(store, 510, retention=policy, lineage=run_2)
    assert store.steps() == [500, 510, 700]
    assert store.manifest(510).metadata["parent_step"] == 500
    # Another process's gc sees the parent in 510's manifest and keeps it too.
    collect_garbage(open_store(backend), policy, dry_run=False)
    assert store.steps() == [500, 700]
    save(store, 520, retention=policy, lineage=run_2)
    save(store, 530, retention=policy, lineage=run_2)
    assert store.steps() == [530, 700]


def test_resume_then_crash_before_the_next_save(backend):
    # Run 1 keeps only step 500; run 2 resumes from 500 and dies before its first save.
    store = open_store(backend)
    policy = RetentionPolicy(keep_last=1)
    run_1 = RunLineage.new()
    for step in (100, 300, 500):
        save(store, step, retention=policy, lineage=run_1)
    assert store.steps() == [500]
    resumed = load(store, 500)
    assert resumed["successful_updates"] == 500
    # (run 2 is killed here) -- an operator's gc with the strictest policy runs meanwhile:
    collect_garbage(open_store(backend), policy, orphans_older_than_secs=0, dry_run=False)
    fresh = open_store(backend)
    assert fresh.steps() == [500] and fresh.is_complete(500)
    assert load(fresh, 500)["successful_updates"] == 500
    # Run 3 resumes from 500 again and saves: 500 stays until run 3 has two checkpoints.
    run_3 = RunLineage.new(parent_step=500)
    save(fresh, 510, retention=policy, lineage=run_3)
    assert fresh.steps() == [500, 510]


def test_crash_between_the_commit_and_the_retention_pass(backend):
    store = open_store(backend)
    for step in (2, 4):
        save(store, step)
    # The process dies at the first delete of the retention pass, after the commit of 6.
    faulty = CheckpointStore.from_storage(
        FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "delete", exc=KeyboardInterrupt()))
    )
    with pytest.raises(KeyboardInterrupt):
        save(faulty, 6, retention=RetentionPolicy(keep_last=1))
    fresh = open_store(backend)
    assert fresh.steps() == [2, 4, 6]
    assert all(fresh.is_complete(step) for step in (2, 4, 6))
    assert fresh.latest_step() == 6 and load(fresh, 6)["successful_updates"] == 6
    # The next save's retention pass finishes the job.
    save(fresh, 8, retention=RetentionPolicy(keep_last=1))
    assert fresh.steps() == [8]


def test_crash_mid_delete_in_the_retention_pass_leaves_no_false_complete(backend):
    store = open_store(backend)
    for step in (2, 4):
        save(store, step)
    # The manifest delete of step 2 lands, then the process dies before its payloads go.
    faulty = CheckpointStore.from_storage(
        FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "delete", exc=KeyboardInterrupt(), landed=True))
    )
    with pytest.raises(KeyboardInterrupt):
        save(faulty, 6, retention=RetentionPolicy(keep_last=1))
    fresh = open_store(backend)
    assert fresh.steps() == [4, 6]
    assert fresh.status(2) == "uncommitted"
    assert fresh.latest_step() == 6 and load(fresh, 6)["successful_updates"] == 6
    report = collect_garbage(fresh, RetentionPolicy(keep_last=1), orphans_older_than_secs=0, dry_run=False)
    assert report.deleted_steps == [4] and [o.step for o in report.orphans] == [2]
    assert [info.step for info in fresh.checkpoints()] == [6]


def test_a_failing_retention_pass_is_raised_and_the_save_stays_committed(backend):
    store = open_store(backend)
    for step in (2, 4):
        save(store, step)
    faulty = CheckpointStore.from_storage(
        FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "delete"))
    )
    with pytest.raises(RetentionError, match="after committing step 6") as caught:
        save(faulty, 6, retention=RetentionPolicy(keep_last=1))
    assert caught.value.url == store.step_url(6) and isinstance(caught.value, OSError)
    assert isinstance(caught.value.__cause__, InjectedFault)
    fresh = open_store(backend)
    assert fresh.steps() == [2, 4, 6] and load(fresh, 6)["successful_updates"] == 6


def test_a_retention_that_is_not_a_policy_is_refused_before_anything_is_written(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    with pytest.raises(TypeError, match=r"^retention takes a RetentionPolicy or None, got 2 \(int\)"):
        save(store, 2, retention=2)
    assert store.steps() == [] and not (tmp_path / "store").exists()
