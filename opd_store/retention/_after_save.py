"""The retention pass after a save: the same plan as :func:`~opd_store.retention._executor.apply_retention`,
in a number of requests that does not grow with the run's history.

The full pass (``opd-store gc``) lists every object of the store and reads the manifest of every
step; run after every save, a long run with many kept milestones paid for its whole history on each
save (100 steps with ``keep_last=3, keep_every=10``: 13 manifest reads per save; at 512 ranks the
recursive listing alone is a page per step). The pass after a save instead makes

* one delimiter listing of the root (the step prefixes: a page per 1,000 steps) and one of the pins;
* no request for a step this store instance saw complete (:mod:`opd_store.store._known_steps`: its
  own commits, and the steps earlier passes read): a committed manifest never changes;
* a fresh read (the manifest and a listing of its attempt) of each other step of the keep-last
  window (newest first, until ``keep_last`` complete steps were found);
* below the window, reads only where a decision needs them: a step there can be deleted only if it
  is no ``keep_every`` milestone, not pinned and not otherwise protected, and deciding it needs
  every step newer than it (one may name it as a run's resume parent or best step). Steps older than the oldest
  such candidate are not read at all (milestones and pins are kept whatever they hold); of the
  others, at most :data:`READS_PER_PASS` the instance has not seen, newest first;
* a fresh read of each step the plan deletes, just before deleting it (a step found damaged is kept,
  as every pass keeps damaged steps), the pins read again, and the deletes.

A step the pass did not read is ``unread``: kept, and so is every step older than the newest unread
one, because a manifest not read may name it as a run's resume parent or best step
(:mod:`~opd_store.retention._policy`). The next pass reads further (an instance that saves again
reads each step once), and ``opd-store gc`` decides them all. What is protected is what the full
pass protects: pins (read twice), the resume parent, the best step a kept step names, steps not
durable yet, the step just committed and the newest complete one; steps this pass did not read
count toward no parent's release.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from ..errors import RetentionError
from ..storage import describe
from ..store import COMPLETE, CheckpointStore, pinned_steps
from ._executor import GcReport, execute_plan
from ._policy import RetentionPlan, RetentionPolicy, RunLineage, StepRecord, plan_retention

logger = logging.getLogger("opd_store.retention")

READS_PER_PASS = 16
"""Most steps older than the keep-last window one pass reads that this store instance has not
seen complete (each a manifest read and a listing)."""
UNREAD = "unread"
"""Status of a step the pass did not read (kept, as every step that is not complete)."""


def step_records_after_save(store: CheckpointStore, policy: RetentionPolicy, protected: Iterable[int] = ()
                            ) -> list[StepRecord]:
    """The plan's input, read as the module docstring says.

    Args:
        store (CheckpointStore): the store.
        policy (RetentionPolicy): the policy (its window and milestones decide what is read).
        protected (Iterable[int]): steps kept whatever they hold (pinned, not durable, just
            committed): like milestones, nothing needs reading to keep them.

    Raises:
        OSError: a backend failure while listing or reading.
    """
    steps = store.step_prefixes()
    store.known.keep_only(steps)
    protected = set(protected)
    window = policy.keep_last or 1  # keep-last, and the newest complete step
    records: dict[int, StepRecord] = {}

    def read(step: int) -> None:
        known = store.known.get(step)
        if known is None:
            state = store.step_state(step)
            if state.status != COMPLETE:
                metadata = state.manifest.metadata if state.manifest is not None else None
                records[step] = StepRecord.from_metadata(step, state.status, 0, metadata)
                return
            store.known.saw_complete(state.manifest)
            known = store.known.get(step)
        records[step] = StepRecord.from_metadata(step, COMPLETE, known.size_bytes, known.manifest.metadata)

    older = list(reversed(steps))
    complete_seen = 0
    while older and complete_seen < window:  # the window: always read
        step = older.pop(0)
        read(step)
        complete_seen += records[step].status == COMPLETE
    # A step older than the window can be deleted only if it is no milestone and not protected;
    # deciding it needs every step newer than it (one may name it as a resume parent). Steps older
    # than the oldest such candidate change no decision: known ones are recorded, others not read.
    every = policy.keep_every
    candidates = [s for s in older if not (every and s % every == 0) and s not in protected]
    oldest = min(candidates) if candidates else None
    budget = READS_PER_PASS
    for step in older:
        if store.known.get(step) is not None or (oldest is not None and step >= oldest and budget > 0):
            budget -= store.known.get(step) is None
            read(step)
        else:
            records[step] = StepRecord(step, UNREAD)
    unread = [step for step, record in records.items() if record.status == UNREAD]
    if unread:
        horizon = max(unread)
        for step, record in records.items():
            if step < horizon and record.status == COMPLETE:
                records[step] = dataclasses.replace(record, status=UNREAD)
    return [records[step] for step in sorted(records)]


def apply_retention_after_save(
    store: CheckpointStore,
    policy: RetentionPolicy,
    *,
    just_committed: int | None = None,
    current_run: tuple[str, int | None] | None = None,
    not_durable: Iterable[int] = (),
) -> GcReport:
    """Plan ``policy`` over ``store`` after a save and delete what the plan does not keep, in the
    bounded requests of the module docstring.

    Args:
        store (CheckpointStore): the store (one tier).
        policy (RetentionPolicy): the policy.
        just_committed (int | None): the step just committed (kept).
        current_run (tuple[str, int | None] | None): ``(run_id, parent_step)`` of the saving run.
        not_durable (Iterable[int]): steps not durable yet (kept).

    Returns:
        GcReport: the plan (steps not read are ``untouched`` as ``unread``) and the steps deleted.

    Raises:
        OSError: a backend failure while listing, reading or deleting (see
            :func:`~opd_store.retention._executor.execute_plan`).
    """
    pinned, not_durable = pinned_steps(store), set(not_durable)
    kept = pinned | not_durable | ({just_committed} if just_committed is not None else set())
    records = step_records_after_save(store, policy, kept)
    plan = plan_retention(records, policy, pinned=pinned, just_committed=just_committed,
                          current_run=current_run, not_durable=not_durable)
    sizes = {record.step: record.size_bytes for record in records}
    plan = _still_complete(store, plan, sizes)
    report = GcReport(plan=plan, sizes=sizes, dry_run=False, store=store, policy=policy)
    report.deleted_steps = execute_plan(store, plan)
    return report


def _still_complete(store: CheckpointStore, plan: RetentionPlan, sizes: dict[int, int]) -> RetentionPlan:
    """The plan without the steps to delete that a fresh read finds not complete (kept damaged)."""
    damaged = {}
    for step in plan.delete:
        state = store.step_state(step)
        if state.status != COMPLETE:
            logger.warning("retention: step %d is %s now (%s); kept", step, state.status,
                           "; ".join(p.detail for p in state.problems))
            store.known.forget(step)
            damaged[step] = state.status
    if not damaged:
        return plan
    return dataclasses.replace(plan, delete=tuple(s for s in plan.delete if s not in damaged),
                               untouched={**plan.untouched, **damaged},
                               freed_bytes=plan.freed_bytes - sum(sizes.get(s, 0) for s in damaged))


def retention_after_commit(
    policy: RetentionPolicy, step: int, *, lineage: RunLineage | None = None, url: str | None = None
):
    """The after-commit retention hook of a save of ``step``: ``hook(durable_store)``, run by
    :meth:`Durability.when_durable <opd_store.store._api.Durability.when_durable>` once the step is
    durable (at once on a plain store, after the upload on a tiered one, against the bucket): the
    pass :func:`apply_retention_after_save`.

    ``step`` (just committed) and ``lineage.parent_step`` (until the run has a second checkpoint)
    are protected. A pass that cannot run or fails part-way raises :class:`RetentionError` (the
    checkpoint stays committed; ``BaseException`` such as a kill propagates as it is).

    Args:
        policy (RetentionPolicy): what to keep.
        step (int): the step just committed.
        lineage (RunLineage | None): the saving run's id and resume parent.
        url (str | None): the committed checkpoint's URL, named in the error.
    """
    current = (lineage.run_id, lineage.parent_step) if lineage is not None else None

    def hook(durable_store: CheckpointStore) -> GcReport:
        try:
            return apply_retention_after_save(durable_store, policy, just_committed=step, current_run=current)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as a RetentionError
            raise RetentionError.after(
                f"retention {policy!r} after committing step {step} at {durable_store.url} failed "
                f"({describe(exc)}); step {step} is committed{f' at {url}' if url else ''} and nothing "
                "committed was lost; the next pass or `opd-store gc` finishes the job",
                url=url,
            ) from exc

    return hook


__all__ = ["READS_PER_PASS", "UNREAD", "apply_retention_after_save", "retention_after_commit", "step_records_after_save"]
