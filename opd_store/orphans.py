"""Garbage collection (``opd-store gc``): retention, orphan attempts and stale multipart uploads.

Retention goes through the one executor (:func:`opd_store.pruning.apply_retention`). What counts
as an orphan: an ``attempt-<utc>-<hex>`` prefix under a step that no manifest names (a killed
save, a lost commit race, the payloads of a step whose deletion was interrupted), older than a
grace period (default 1 hour, so a live writer is never raced; its age comes from the UTC time in
its id). Objects outside that layout (a checkpoint copied in by another tool, a seed ``COMPLETE``
directory, anything unknown) are never touched; nor is a step whose manifest cannot be parsed
(which attempt it names is unknown). On S3, multipart uploads under the store prefix that were
started more than the grace period ago are aborted and reported (they are invisible to listings
but billed).

A tiered store is collected tier by tier (:meth:`BaseStore.retention_tiers
<opd_store.store_api.BaseStore.retention_tiers>`): the bucket with the policy asked for, the local
tier with its own, and a local step that is not durable yet is never deleted.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from .layout import MANIFEST_NAME, is_attempt_id, parse_step_dirname, step_dirname
from .pruning import GcReport, apply_retention, execute_plan
from .retention import RetentionPolicy
from .status import LEGACY, objects_by_step
from .store import CheckpointStore
from .store_api import BaseStore

logger = logging.getLogger("opd_store.orphans")

DEFAULT_ORPHAN_GRACE_SECS = 3600.0
"""Grace period before an uncommitted attempt counts as an orphan: one hour, far longer than any
save takes between its first payload and its commit, so a live writer is never raced."""


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
            manifest = store.step_state(step, objects).manifest
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
    store: BaseStore,
    policy: RetentionPolicy,
    *,
    orphans_older_than_secs: float = DEFAULT_ORPHAN_GRACE_SECS,
    deep: bool = False,
    dry_run: bool = True,
    now_secs: float | None = None,
) -> GcReport:
    """Retention, orphan removal and stale-upload aborts in one pass (``opd-store gc``).

    Args:
        store (BaseStore): a plain store, or a tiered store (each tier is collected; see the
            module docstring).
        policy (RetentionPolicy): steps to keep (a policy with no rule deletes no step); on a
            tiered store, the bucket's.
        orphans_older_than_secs (float): grace period of uncommitted attempts and uploads.
        deep (bool): recompute checksums of the newest complete steps before planning.
        dry_run (bool): only report (the default).
        now_secs (float | None): the current time (seconds since the epoch), for tests.

    Returns:
        GcReport: the plan, orphans and uploads, and what was deleted, of the store (of the bucket
        for a tiered store); :func:`collect_garbage_tiers` returns one report per tier.

    Raises:
        ValueError: a negative grace period.
        OSError: a backend failure (what was deleted before it stays deleted).
    """
    return collect_garbage_tiers(store, policy, orphans_older_than_secs=orphans_older_than_secs, deep=deep,
                                 dry_run=dry_run, now_secs=now_secs)[0]


def collect_garbage_tiers(
    store: BaseStore,
    policy: RetentionPolicy,
    *,
    orphans_older_than_secs: float = DEFAULT_ORPHAN_GRACE_SECS,
    deep: bool = False,
    dry_run: bool = True,
    now_secs: float | None = None,
) -> list[GcReport]:
    """:func:`collect_garbage` of every tier of ``store``: one report per tier, the durable tier
    first (one report for a plain store). Same arguments and errors."""
    if orphans_older_than_secs < 0:
        raise ValueError(f"orphan grace period must be >= 0 seconds, got {orphans_older_than_secs}")
    reports = []
    for tier in store.retention_tiers(policy):
        reports.append(_collect_tier(tier.store, tier.policy, tier.not_durable, orphans_older_than_secs, deep,
                                     dry_run, now_secs))
    return reports


def _collect_tier(store: CheckpointStore, policy: RetentionPolicy, not_durable: frozenset[int],
                  grace_secs: float, deep: bool, dry_run: bool, now_secs: float | None) -> GcReport:
    report = apply_retention(store, policy, not_durable=not_durable, deep=deep, dry_run=True)
    report.dry_run = dry_run
    report.orphans = find_orphans(store, older_than_secs=grace_secs, now_secs=now_secs)
    report.uploads = find_stale_uploads(store, older_than_secs=grace_secs, now_secs=now_secs)
    if dry_run:
        return report
    report.deleted_steps = execute_plan(store, report.plan)
    report.orphans = delete_orphans(store, report.orphans)
    for upload in report.uploads:
        store.storage.abort_upload(upload.rel, upload.upload_id)
    return report


__all__ = [
    "DEFAULT_ORPHAN_GRACE_SECS",
    "Orphan",
    "StaleUpload",
    "collect_garbage",
    "collect_garbage_tiers",
    "delete_orphans",
    "find_orphans",
    "find_stale_uploads",
]
