"""Garbage collection: run a retention plan against a store, remove orphans, abort stale uploads.

The decisions are made by the pure functions of :mod:`opd_store.retention`; this module only
gathers their input from the store and executes the plan. Every step deletion goes through
:meth:`CheckpointStore.delete` (manifest first, then payloads), so a crash mid-delete leaves an
``uncommitted`` step, never one that looks complete but is not (issue 6).

What counts as an orphan: an ``attempt-<utc>-<hex>`` prefix under a step that no manifest names
(a killed save, a lost commit race, the payloads of a step whose deletion was interrupted),
older than a grace period (default 1 hour, so a live writer is never raced; its age comes from the
UTC time in its id). Objects outside that layout (a checkpoint copied in by another tool, a seed
``COMPLETE`` directory, anything unknown) are never touched; nor is a step whose manifest cannot
be parsed (which attempt it names is unknown). On S3, multipart uploads under the store prefix
that were started more than the grace period ago are aborted and reported (they are invisible to
listings but billed).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from .layout import MANIFEST_NAME, is_attempt_id, parse_step_dirname, step_dirname
from .pins import pinned_steps
from .retention import RetentionPlan, RetentionPolicy, RunLineage, StepRecord, plan_retention
from .store import COMPLETE, CORRUPT, LEGACY, CheckpointInfo, CheckpointStore, objects_by_step

logger = logging.getLogger("opd_store.gc")

DEFAULT_ORPHAN_GRACE_SECS = 3600.0
"""Grace period before an uncommitted attempt counts as an orphan (issue 6: one hour)."""


@dataclasses.dataclass(frozen=True)
class Orphan:
    """An uncommitted attempt prefix.

    Attributes:
        step (int): its step.
        attempt_id (str): the attempt.
        rel (str): its prefix relative to the store root.
        url (str): its URL.
        size_bytes (int): bytes under it.
        age_secs (float): seconds since the attempt started (from its id).
    """

    step: int
    attempt_id: str
    rel: str
    url: str
    size_bytes: int
    age_secs: float


@dataclasses.dataclass(frozen=True)
class StaleUpload:
    """An unfinished S3 multipart upload under the store prefix.

    Attributes:
        rel (str): the object key relative to the store root.
        upload_id (str): its upload id.
        age_secs (float): seconds since it was initiated.
    """

    rel: str
    upload_id: str
    age_secs: float


@dataclasses.dataclass
class GcReport:
    """What a retention or gc pass decided and did.

    Attributes:
        plan (RetentionPlan): the retention plan.
        sizes (dict[int, int]): bytes of each step in the plan.
        orphans (list[Orphan]): orphans found (deleted unless ``dry_run``).
        uploads (list[StaleUpload]): stale multipart uploads (aborted unless ``dry_run``).
        deleted_steps (list[int]): steps actually deleted.
        dry_run (bool): nothing was deleted.
    """

    plan: RetentionPlan
    sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    orphans: list[Orphan] = dataclasses.field(default_factory=list)
    uploads: list[StaleUpload] = dataclasses.field(default_factory=list)
    deleted_steps: list[int] = dataclasses.field(default_factory=list)
    dry_run: bool = True

    @property
    def freed_bytes(self) -> int:
        """Bytes the steps and orphans to delete occupy (multipart parts are not counted)."""
        return self.plan.freed_bytes + sum(orphan.size_bytes for orphan in self.orphans)


def _parent(info: CheckpointInfo) -> tuple[str | None, int | None]:
    metadata = info.metadata
    run_id = metadata.get("run_id")
    parent = metadata.get("parent_step")
    run_id = run_id if isinstance(run_id, str) else None
    parent = parent if isinstance(parent, int) and not isinstance(parent, bool) else None
    return run_id, parent


def step_records(infos: Iterable[CheckpointInfo]) -> list[StepRecord]:
    """Retention input from :meth:`CheckpointStore.checkpoints` output (no I/O)."""
    records = []
    for info in infos:
        run_id, parent = _parent(info)
        records.append(StepRecord(info.step, info.status, info.total_size_bytes, run_id, parent))
    return records


def _deep_checked(store: CheckpointStore, records: list[StepRecord], policy: RetentionPolicy) -> list[StepRecord]:
    """Recompute the CRC32C of complete steps, newest first, until ``keep_last`` pass; mark the
    failures ``corrupt`` so they neither count toward keep-last nor get deleted (scenario 30)."""
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
    deep: bool = False,
) -> tuple[RetentionPlan, dict[int, int]]:
    """List ``store`` and plan ``policy`` over it (reads only).

    Args:
        store (CheckpointStore): the store.
        policy (RetentionPolicy): the policy.
        just_committed (int | None): a step the caller just committed (kept).
        current_run (tuple[str, int | None] | None): ``(run_id, parent_step)`` of the calling run.
        deep (bool): recompute checksums of the newest complete steps (see module docs) so a
            same-size corruption does not count as complete.

    Returns:
        tuple[RetentionPlan, dict[int, int]]: the plan and each step's size in bytes.
    """
    records = step_records(store.checkpoints())
    if deep:
        records = _deep_checked(store, records, policy)
    plan = plan_retention(
        records, policy, pinned=pinned_steps(store), just_committed=just_committed, current_run=current_run
    )
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
    deep: bool = False,
    dry_run: bool = False,
) -> GcReport:
    """Plan ``policy`` over ``store`` and delete what it does not keep (see :func:`plan_store_retention`).

    Raises:
        OSError: a backend failure while listing or deleting (see :func:`execute_plan`).
    """
    plan, sizes = plan_store_retention(
        store, policy, just_committed=just_committed, current_run=current_run, deep=deep
    )
    report = GcReport(plan=plan, sizes=sizes, dry_run=dry_run)
    if not dry_run:
        report.deleted_steps = execute_plan(store, plan)
    return report


def retention_after_commit(
    store: CheckpointStore, policy: RetentionPolicy, step: int, lineage: RunLineage | None = None
) -> GcReport | None:
    """The retention pass a save runs once its own commit has succeeded.

    ``step`` (just committed) and ``lineage.parent_step`` (until the run has a second checkpoint)
    are protected. A failure here never turns the committed save into a failure: it is logged as
    a warning and the next pass (or ``opd-store gc``) finishes the job; ``BaseException`` (a kill)
    propagates.

    Returns:
        GcReport | None: what was deleted, or ``None`` when the pass failed.
    """
    current = (lineage.run_id, lineage.parent_step) if lineage is not None else None
    try:
        return apply_retention(store, policy, just_committed=step, current_run=current)
    except Exception:  # noqa: BLE001 - the checkpoint is committed; retention is best effort
        logger.warning("retention after committing step %d at %s failed; nothing committed was lost",
                       step, store.url, exc_info=True)
        return None


class TierRetention:
    """A :class:`~opd_store.tiered.TieredStore` retention hook that applies a :class:`RetentionPolicy`
    to one tier (``TieredStore(..., bucket_retention=TierRetention(policy))``).

    Called by the tiered store's upload thread after each upload, as ``hook(tier_store,
    protected_steps)``. Kept whatever the policy says: every step in ``protected_steps`` (for the
    local tier, each step not yet durable in the bucket, so the local hook never removes a step's
    only copy), pinned steps, the newest complete step, and ``lineage.parent_step`` until the run
    of ``lineage`` has a second checkpoint (the rules of :func:`opd_store.retention.plan_retention`).

    Like :func:`retention_after_commit`, a failing pass is logged, not raised: the checkpoint is
    already durable, and a transient delete error must not stop training at the next save (the
    tiered store raises what a hook raises). The next pass, or ``opd-store gc``, finishes the job.

    Args:
        policy (RetentionPolicy): what to keep.
        lineage (RunLineage | None): the saving run's id and resume parent (see
            :func:`opd_store.retention.protected_parents`), or ``None``.

    Raises:
        ValueError: ``policy`` keeps every step (a hook that never deletes is ``None``).
    """

    def __init__(self, policy: RetentionPolicy, *, lineage: RunLineage | None = None) -> None:
        if policy.keeps_all:
            raise ValueError(f"{policy!r} keeps every step; pass no retention hook instead")
        self.policy = policy
        self.lineage = lineage

    def __call__(self, store: CheckpointStore, protected_steps: frozenset) -> list[int]:
        """Plan the policy over ``store`` and delete what it does not keep, except ``protected_steps``.

        Returns:
            list[int]: the steps deleted, ascending (those deleted before a failure, if one occurs).
        """
        current = (self.lineage.run_id, self.lineage.parent_step) if self.lineage is not None else None
        deleted: list[int] = []
        try:
            plan, _sizes = plan_store_retention(store, self.policy, current_run=current)
            for step in plan.delete:
                if step in protected_steps:
                    continue
                deleted += execute_plan(store, dataclasses.replace(plan, delete=(step,)))
        except Exception:  # noqa: BLE001 - the checkpoint is durable; retention is best effort
            logger.warning("retention %r on %s failed after deleting %s; nothing committed was lost",
                           self.policy, store.url, deleted, exc_info=True)
        return deleted

    def __repr__(self) -> str:
        return f"TierRetention({self.policy!r})"


def find_orphans(
    store: CheckpointStore, *, older_than_secs: float = DEFAULT_ORPHAN_GRACE_SECS, now_secs: float | None = None
) -> list[Orphan]:
    """Attempt prefixes no manifest names, older than ``older_than_secs`` (one listing plus one
    manifest read per committed step). Legacy steps and steps with an unreadable manifest are
    skipped (see module docs)."""
    now = time.time() if now_secs is None else now_secs
    by_step = objects_by_step(store.storage.list_tree(""))
    orphans = []
    for step, objects in sorted(by_step.items()):
        attempts: dict[str, int] = {}
        for name, size in objects.items():
            first, sep, _rest = name.partition("/")
            if sep and is_attempt_id(first):
                attempts[first] = attempts.get(first, 0) + size
        if not attempts:
            continue
        if MANIFEST_NAME in objects:
            status, manifest, _problems = store._status(step, objects)
            if manifest is None:  # unreadable manifest: which attempt it names is unknown
                continue
            attempts.pop(manifest.attempt_id, None)
        elif store.status(step) == LEGACY:
            continue
        for attempt_id, size in sorted(attempts.items()):
            age = store.attempt_age_secs(attempt_id, now)
            if age is not None and age >= older_than_secs:
                rel = f"{step_dirname(step)}/{attempt_id}"
                orphans.append(Orphan(step, attempt_id, rel, store.storage.url(rel), size, age))
    return orphans


def delete_orphans(store: CheckpointStore, orphans: Iterable[Orphan]) -> list[Orphan]:
    """Delete orphan attempt prefixes; one that a manifest names by now is skipped.

    Returns:
        list[Orphan]: the orphans deleted.
    """
    deleted = []
    for orphan in orphans:
        try:
            manifest = store.manifest(orphan.step)
        except (FileNotFoundError, ValueError):
            manifest = None
        if manifest is not None and manifest.attempt_id == orphan.attempt_id:
            logger.warning("gc: %s was committed meanwhile; kept", orphan.url)
            continue
        store.storage.delete_tree(orphan.rel)
        deleted.append(orphan)
    return deleted


def find_stale_uploads(
    store: CheckpointStore, *, older_than_secs: float = DEFAULT_ORPHAN_GRACE_SECS, now_secs: float | None = None
) -> list[StaleUpload]:
    """Unfinished multipart uploads under the store prefix started ``older_than_secs`` ago (S3).

    The age is the server's ``Initiated`` time, or the attempt id's time when the key lies in an
    attempt prefix and that is younger (a clock-skewed or emulated server never makes a live
    writer's upload look old).
    """
    now = time.time() if now_secs is None else now_secs
    stale = []
    for rel, upload_id, initiated in store.storage.list_uploads():
        age = now - initiated
        # An upload of one of our payloads is as young as its attempt id says, whatever the
        # server reports (moto reports one fixed 2010 date for every upload; field notes).
        parts = rel.split("/")
        if len(parts) >= 3 and parse_step_dirname(parts[0]) is not None and is_attempt_id(parts[1]):
            attempt_age = store.attempt_age_secs(parts[1], now)
            if attempt_age is not None:
                age = min(age, attempt_age)
        if age >= older_than_secs:
            stale.append(StaleUpload(rel, upload_id, age))
    return stale


def collect_garbage(
    store: CheckpointStore,
    policy: RetentionPolicy,
    *,
    orphans_older_than_secs: float = DEFAULT_ORPHAN_GRACE_SECS,
    deep: bool = False,
    dry_run: bool = True,
    now_secs: float | None = None,
) -> GcReport:
    """Retention, orphan removal and stale-upload aborts in one pass (``opd-store gc``).

    Args:
        store (CheckpointStore): the store.
        policy (RetentionPolicy): steps to keep (a policy with no rule deletes no step).
        orphans_older_than_secs (float): grace period of uncommitted attempts and uploads.
        deep (bool): recompute checksums of the newest complete steps before planning.
        dry_run (bool): only report (the default).
        now_secs (float | None): the current time (seconds since the epoch), for tests.

    Returns:
        GcReport: the plan, orphans and uploads, and what was deleted.

    Raises:
        ValueError: a negative grace period.
        OSError: a backend failure (what was deleted before it stays deleted).
    """
    if orphans_older_than_secs < 0:
        raise ValueError(f"orphan grace period must be >= 0 seconds, got {orphans_older_than_secs}")
    report = apply_retention(store, policy, deep=deep, dry_run=True)
    report.dry_run = dry_run
    report.orphans = find_orphans(store, older_than_secs=orphans_older_than_secs, now_secs=now_secs)
    report.uploads = find_stale_uploads(store, older_than_secs=orphans_older_than_secs, now_secs=now_secs)
    if dry_run:
        return report
    report.deleted_steps = execute_plan(store, report.plan)
    report.orphans = delete_orphans(store, report.orphans)
    for upload in report.uploads:
        store.storage.abort_upload(upload.rel, upload.upload_id)
    return report


__all__ = [
    "DEFAULT_ORPHAN_GRACE_SECS",
    "GcReport",
    "Orphan",
    "StaleUpload",
    "TierRetention",
    "apply_retention",
    "collect_garbage",
    "delete_orphans",
    "execute_plan",
    "find_orphans",
    "find_stale_uploads",
    "plan_store_retention",
    "retention_after_commit",
    "step_records",
]
