"""The one retention executor: plan a policy over a store, then delete what the plan does not keep.

The decisions are made by the pure :func:`opd_store.retention._policy.plan_retention`; this module only
gathers its input from a store (one listing, the pins, and with ``deep`` the checksums of the
newest steps) and executes the plan. Every way to ask for retention ends here: ``opd-store gc``
directly, and a save's ``retention=`` (after its commit, or after its upload on a tiered store) and
a tiered store's ``bucket_retention`` and local retention through the bounded pass after a save
(:mod:`opd_store.retention._after_save`), which plans with the same rules and deletes through
:func:`execute_plan`. Every step deletion goes through
:meth:`CheckpointStore.delete <opd_store.store._checkpoint_store.CheckpointStore.delete>` (manifest first, then
payloads), so a crash mid-delete leaves an ``uncommitted`` step, never one that looks complete but
is not.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..runtime import kill_points
from ..store import COMPLETE, CORRUPT, CheckpointInfo, CheckpointStore, LegacyReader, pinned_steps
from ._policy import RetentionPlan, RetentionPolicy, StepRecord, check_retention, plan_retention

if TYPE_CHECKING:
    from ._gc import Orphan, StaleUpload

logger = logging.getLogger("opd_store.retention")


@dataclasses.dataclass
class GcReport:
    """What a retention or gc pass decided and did on one store.

    Attributes:
        plan (RetentionPlan): the retention plan.
        sizes (dict[int, int]): bytes of each step in the plan.
        orphans (list[Orphan]): orphans found (deleted unless ``dry_run``).
        uploads (list[StaleUpload]): stale multipart uploads (aborted unless ``dry_run``).
        deleted_steps (list[int]): steps actually deleted.
        journal_events (list[str]): run-journal events beyond the journal's bound (paths relative
            to the store root; :func:`opd_store.ledger.prune_journal`), deleted unless ``dry_run``.
        journal_bytes (int): their bytes (from the listing).
        dry_run (bool): nothing was deleted.
        store (CheckpointStore | None): the store the pass ran on.
        policy (RetentionPolicy | None): the policy it applied.
    """

    plan: RetentionPlan
    sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    orphans: "list[Orphan]" = dataclasses.field(default_factory=list)
    uploads: "list[StaleUpload]" = dataclasses.field(default_factory=list)
    deleted_steps: list[int] = dataclasses.field(default_factory=list)
    journal_events: list[str] = dataclasses.field(default_factory=list)
    journal_bytes: int = 0
    dry_run: bool = True
    store: CheckpointStore | None = dataclasses.field(default=None, repr=False)
    policy: RetentionPolicy | None = None

    @property
    def url(self) -> str:
        """The URL of the store the pass ran on."""
        return self.store.url if self.store is not None else ""

    @property
    def freed_bytes(self) -> int:
        """Bytes the steps, orphans and journal events to delete occupy (multipart parts are not counted)."""
        return self.plan.freed_bytes + sum(orphan.size_bytes for orphan in self.orphans) + self.journal_bytes


def step_records(infos: Iterable[CheckpointInfo]) -> list[StepRecord]:
    """Retention input from :meth:`CheckpointStore.checkpoints` output (no I/O)."""
    return [StepRecord.from_metadata(info.step, info.status, info.total_size_bytes, info.metadata) for info in infos]


def _deep_checked(store: CheckpointStore, records: list[StepRecord], policy: RetentionPolicy) -> list[StepRecord]:
    """Recompute the CRC32C of complete steps, newest first, until ``keep_last`` pass; mark the
    failures ``corrupt`` so they neither count toward keep-last nor get deleted (a same-size
    corruption is invisible to a listing, and would otherwise push the last good step out)."""
    wanted = policy.keep_last or 1
    good = 0
    out = {record.step: record for record in records}
    for record in sorted(records, key=lambda r: r.step, reverse=True):
        if good >= wanted:
            break
        if record.status != COMPLETE:
            continue
        report = store.verify(record.step, deep=True)
        if report.ok:
            good += 1
        else:
            logger.warning("retention: step %d fails deep verification: %s", record.step,
                           "; ".join(p.detail for p in report.problems))
            out[record.step] = dataclasses.replace(record, status=CORRUPT)
    return [out[step] for step in sorted(out)]


def plan_store_retention(
    store: CheckpointStore,
    policy: RetentionPolicy,
    *,
    just_committed: int | None = None,
    current_run: tuple[str, int | None] | None = None,
    not_durable: Iterable[int] = (),
    deep: bool = False,
) -> tuple[RetentionPlan, dict[int, int]]:
    """List ``store`` and plan ``policy`` over it (reads only).

    Args:
        store (CheckpointStore): the store (one tier).
        policy (RetentionPolicy): the policy.
        just_committed (int | None): a step the caller just committed (kept).
        current_run (tuple[str, int | None] | None): ``(run_id, parent_step)`` of the calling run.
        not_durable (Iterable[int]): steps not durable yet (kept).
        deep (bool): recompute checksums of the newest complete steps (see :func:`_deep_checked`).

    Returns:
        tuple[RetentionPlan, dict[int, int]]: the plan and each step's size in bytes.
    """
    # Legacy steps are listed as such (the plan reports and keeps them, as every step but a
    # complete one), in the same one listing.
    records = step_records(LegacyReader(store).checkpoints())
    if deep:
        records = _deep_checked(store, records, policy)
    plan = plan_retention(records, policy, pinned=pinned_steps(store), just_committed=just_committed,
                          current_run=current_run, not_durable=not_durable)
    return plan, {record.step: record.size_bytes for record in records}


def execute_plan(store: CheckpointStore, plan: RetentionPlan) -> list[int]:
    """Delete the plan's steps, oldest first, each manifest first (:meth:`CheckpointStore.delete`).

    Pins are read again just before deleting, so a step pinned after the plan was made survives.

    Returns:
        list[int]: the steps deleted.

    Raises:
        OSError: a backend failure; steps deleted before it stay deleted, the failing one is left
            ``uncommitted`` at worst (its manifest is deleted first) and gc removes the rest later.
    """
    pinned = pinned_steps(store) if plan.delete else set()
    deleted = []
    for step in plan.delete:
        if step in pinned:
            logger.info("retention: step %d was pinned after planning; kept", step)
            continue
        kill_points.reach("retention_pass", step=step)  # test-only (the soak); nothing when not armed
        store.delete(step)
        logger.info("retention: deleted %s", store.step_url(step))
        deleted.append(step)
    return deleted


def apply_retention(
    store: CheckpointStore,
    policy: RetentionPolicy,
    *,
    just_committed: int | None = None,
    current_run: tuple[str, int | None] | None = None,
    not_durable: Iterable[int] = (),
    deep: bool = False,
    dry_run: bool = False,
) -> GcReport:
    """Plan ``policy`` over ``store`` and delete what it does not keep (see :func:`plan_store_retention`).

    Raises:
        TypeError: ``policy`` is not a :class:`RetentionPolicy`.
        OSError: a backend failure while listing or deleting (see :func:`execute_plan`).
    """
    if check_retention(policy, "policy") is None:
        raise TypeError("policy takes a RetentionPolicy, got None")
    plan, sizes = plan_store_retention(store, policy, just_committed=just_committed, current_run=current_run,
                                       not_durable=not_durable, deep=deep)
    report = GcReport(plan=plan, sizes=sizes, dry_run=dry_run, store=store, policy=policy)
    if not dry_run:
        report.deleted_steps = execute_plan(store, plan)
    return report


__all__ = [
    "GcReport",
    "apply_retention",
    "execute_plan",
    "plan_store_retention",
    "step_records",
]
