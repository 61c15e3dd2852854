"""Retention policies as pure functions (no store, no I/O): keep-last, keep-every, pins, the
never-deleted steps (just committed, resume parent, newest complete, the best step a kept step
names), and damaged newest steps that never push a good one out."""

from __future__ import annotations

import random

import pytest

from opd_store.retention import RetentionPolicy, RunLineage
from opd_store.retention._policy import (
    KEEP_BEST,
    KEEP_EVERY,
    KEEP_JUST_COMMITTED,
    KEEP_LAST,
    KEEP_NEWEST,
    KEEP_PARENT,
    KEEP_PINNED,
    StepRecord,
    plan_retention,
    protected_parents,
)


def complete(*steps, size=10, run_id=None, parent=None):
    return [StepRecord(step, "complete", size, run_id, parent) for step in steps]


def test_keep_last_keeps_the_newest_complete_and_deletes_the_rest():
    plan = plan_retention(complete(1, 2, 3, 4, 5, size=7), RetentionPolicy(keep_last=2))
    assert plan.delete == (1, 2, 3)
    assert plan.keep == {4: (KEEP_LAST,), 5: (KEEP_LAST, KEEP_NEWEST)}
    assert plan.freed_bytes == 21


def test_keep_every_and_keep_last_keep_the_union():
    plan = plan_retention(complete(5000, 10000, 15000, 20000, 25000, 30000),
                          RetentionPolicy(keep_last=2, keep_every=10000))
    assert set(plan.keep) == {10000, 20000, 25000, 30000}
    assert plan.delete == (5000, 15000)
    assert plan.keep[10000] == (KEEP_EVERY,)
    assert plan.keep[30000] == (KEEP_LAST, KEEP_EVERY, KEEP_NEWEST)


def test_a_policy_without_rules_deletes_nothing():
    plan = plan_retention(complete(1, 2, 3), RetentionPolicy())
    assert plan.delete == () and set(plan.keep) == {1, 2, 3} and plan.freed_bytes == 0


def test_damaged_newest_steps_never_push_a_good_one_out():
    # keep-last 2 plus keep-every 10000, the two newest steps damaged (one corrupt, one incomplete).
    records = complete(10000, 15000, 20000, 20100, 20200) + [
        StepRecord(20300, "corrupt", 50), StepRecord(20400, "incomplete", 60)
    ]
    plan = plan_retention(records, RetentionPolicy(keep_last=2, keep_every=10000))
    assert plan.keep[20200] == (KEEP_LAST, KEEP_NEWEST)
    assert plan.keep[20100] == (KEEP_LAST,)
    assert set(plan.keep) == {10000, 20000, 20100, 20200}
    assert plan.delete == (15000,)
    assert plan.untouched == {20300: "corrupt", 20400: "incomplete"}


def test_legacy_and_uncommitted_steps_are_never_deleted_nor_counted():
    records = [StepRecord(1, "legacy", 99), StepRecord(2, "uncommitted", 5)] + complete(3, 4)
    plan = plan_retention(records, RetentionPolicy(keep_last=1))
    assert plan.delete == (3,)
    assert plan.untouched == {1: "legacy", 2: "uncommitted"}
    assert plan.freed_bytes == 10


def test_the_newest_complete_step_is_kept_by_a_keep_every_only_policy():
    plan = plan_retention(complete(10, 15, 17), RetentionPolicy(keep_every=10))
    assert plan.keep == {10: (KEEP_EVERY,), 17: (KEEP_NEWEST,)}
    assert plan.delete == (15,)


def test_the_step_just_committed_is_kept_even_when_older_than_the_window():
    # A run that resumed from an older step commits 510 while 600 and 700 exist.
    plan = plan_retention(complete(500, 510, 600, 700), RetentionPolicy(keep_last=1), just_committed=510)
    assert plan.keep[510] == (KEEP_JUST_COMMITTED,)
    assert plan.delete == (500, 600)


def test_pinned_steps_are_kept():
    plan = plan_retention(complete(1, 2, 3, 4), RetentionPolicy(keep_last=1), pinned=[2, 99])
    assert plan.keep == {2: (KEEP_PINNED,), 4: (KEEP_LAST, KEEP_NEWEST)}
    assert plan.delete == (1, 3)


def test_resume_parent_is_kept_until_the_run_has_a_second_checkpoint():
    # Run "b" resumed from 500 (older than run "a"'s 600 and 700).
    first = complete(500, 600, 700, run_id="a") + complete(510, run_id="b", parent=500)
    plan = plan_retention(first, RetentionPolicy(keep_last=1))
    assert plan.keep[500] == (KEEP_PARENT,)
    assert plan.delete == (510, 600)  # 510 is no longer "just committed" for an outside gc
    second = first + complete(520, run_id="b", parent=500)
    plan = plan_retention(second, RetentionPolicy(keep_last=1), just_committed=520)
    assert 500 in plan.delete and plan.delete == (500, 510, 600)


def test_damaged_steps_of_the_run_do_not_release_its_parent():
    records = complete(500, 600, run_id="a") + [
        StepRecord(510, "complete", 10, "b", 500), StepRecord(520, "incomplete", 10, "b", 500)
    ]
    assert protected_parents(records) == {500}
    records[-1] = StepRecord(520, "complete", 10, "b", 500)
    assert protected_parents(records) == set()


def test_current_run_parent_is_protected_before_its_first_save():
    # Run 2 resumed from 500 and has committed nothing yet: its parent is protected even
    # though nothing in the store records the resume.
    records = complete(500, 600, 700, run_id="run-1")
    plan = plan_retention(records, RetentionPolicy(keep_last=1), current_run=("run-2", 500))
    assert plan.keep[500] == (KEEP_PARENT,)
    assert plan.delete == (600,)


def test_plan_does_not_depend_on_input_order():
    records = complete(1, 2, 3, 4, 5, 6) + [StepRecord(7, "corrupt", 3)]
    expected = plan_retention(records, RetentionPolicy(keep_last=2, keep_every=3), pinned=[1])
    shuffled = list(records)
    random.Random(0).shuffle(shuffled)
    assert plan_retention(shuffled, RetentionPolicy(keep_last=2, keep_every=3), pinned=[1]) == expected
    assert expected.delete == (2, 4)


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": -1}, {"keep_last": True}, {"keep_last": 1.5}])
def test_invalid_policies_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RetentionPolicy(**kwargs)


def test_run_lineage_metadata_and_validation():
    lineage = RunLineage("r1", 500)
    assert lineage.as_metadata() == {"run_id": "r1", "parent_step": 500}
    fresh = RunLineage.new()
    assert len(fresh.run_id) == 32 and fresh.parent_step is None and fresh.run_id != RunLineage.new().run_id
    with pytest.raises(ValueError, match="parent_step"):
        RunLineage("r1", -1)
    with pytest.raises(ValueError, match="run_id"):
        RunLineage("", 1)


def test_the_best_step_a_kept_step_names_is_kept_while_one_names_it():
    # steps 3 and 4 name step 1 as their best (the Trainer's best_model_checkpoint): kept beside 4
    records = complete(1, 2) + [StepRecord(3, "complete", 10, best_step=1), StepRecord(4, "complete", 10, best_step=1)]
    plan = plan_retention(records, RetentionPolicy(keep_last=1))
    assert plan.keep == {1: (KEEP_BEST,), 4: (KEEP_LAST, KEEP_NEWEST)} and plan.delete == (2, 3)
    # a new best: step 1 is named by no kept step any more, and goes
    records.append(StepRecord(5, "complete", 10, best_step=5))
    plan = plan_retention(records, RetentionPolicy(keep_last=1))
    assert plan.keep == {5: (KEEP_LAST, KEEP_NEWEST)} and plan.delete == (1, 2, 3, 4)

