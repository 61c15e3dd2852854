"""Garbage collection (``opd-store gc``): retention, orphan attempts and stale multipart uploads.

Retention goes through the one executor (:func:`opd_store.retention._executor.apply_retention`). What counts
as an orphan: an ``attempt-<utc>-<hex>`` prefix under a step (and, in the spread layout, the same
attempt's prefixes under the spread prefixes: one orphan) that no manifest names (a killed
save, a lost commit race, the payloads of a step whose deletion was interrupted) and that nothing
has written to for longer than a grace period (default 1 hour). Objects outside that layout (a
checkpoint copied in by another tool, a seed ``COMPLETE`` directory, anything unknown) are never
touched; nor is a step whose manifest cannot be parsed (which attempt it names is unknown).
Multipart uploads under the store prefix that nothing has written to for longer than the grace
period are aborted and reported (they are invisible to listings but billed, S3).

**Age is measured on the store's clock, never the writer's.** The UTC time in an attempt id is
the writer's clock, and the machines of a fleet do not share one: a VM restored from a snapshot,
a container whose host has not synced its time yet, a laptop copying checkpoints up. With the id
as the age, a writer 2 hours behind had its live attempt deleted under it by ``gc`` (its save then
failed at the commit), and one 2 hours ahead left abandoned attempts that looked young for as long
as its clock ran ahead. So an attempt's *last activity* is the newest of

- the modification time the backend recorded for each object under it (S3 ``LastModified``, GCS
  ``updated``, the local file's mtime: :meth:`Storage.list_tree_modified
  <opd_store.storage._base.Storage.list_tree_modified>`), and
- for each unfinished multipart upload under it, its ``Initiated`` time and the ``LastModified``
  of its newest part (both the server's),

and its age is the store's notion of now (:meth:`Storage.clock_secs
<opd_store.storage._base.Storage.clock_secs>`: the ``Date`` an S3 or GCS server sends, the time a
local filesystem stamps on a new file), read *before* the listing, minus that activity. An attempt
is an orphan only when that age reaches the grace period; the attempt id's time is reported as a
hint (``writer_clock_age_secs``) and never decides anything. An object without a recorded time (a
backend that reports none) keeps its attempt. A multipart upload under an attempt prefix lives and
dies with its attempt, even while the attempt has no published object yet (its payloads upload in
parallel, so a save may be only open uploads, one of them idle while another streams); one outside
every attempt is judged by its own activity. Before an orphan is
deleted its objects and open uploads are listed again against a fresh reading of the clock, so a
writer that came back meanwhile keeps it, and its uploads with it.

The grace period must exceed the longest time a live save goes without writing: on S3 a payload's
parts, on GCS its temporary part objects and on local disk its bytes count as writes while it
streams; a payload of at most one part is one request, invisible until it lands.

The run journal (:mod:`opd_store.ledger`) lives outside every step prefix, so none of the above
sees it; ``gc`` bounds it on its own terms: the newest ``journal_keep_events`` events of the durable
tier are kept and older starts are deleted whole (:func:`opd_store.ledger.prune_journal`), never on
the save path (a save writes one event and deletes none).

A tiered store is collected tier by tier (:meth:`Durability.retention_tiers
<opd_store.store._api.Durability.retention_tiers>`), each tier on its own clock: the bucket with the
policy asked for, the local tier with its own, and a local step that is not durable yet is never
deleted. Attempts written by the tier uploader (the bucket copy of a step) and by an asynchronous
save's background writer are judged by the same rule: only their objects' times count.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from ..format import (
    MANIFEST_NAME,
    attempt_created_secs,
    is_attempt_id,
    parse_step_dirname,
    split_key_in_step,
    split_step_rel,
    step_dirname,
    step_rel,
)
from ..ledger import DEFAULT_KEEP_EVENTS, prune_journal
from ..storage import MultipartUploads
from ..store import CheckpointStore, Durability, holds_legacy_marker
from ._executor import GcReport, apply_retention, execute_plan
from ._policy import RetentionPolicy

logger = logging.getLogger("opd_store.retention")

DEFAULT_ORPHAN_GRACE_SECS = 3600.0
"""Grace period before an uncommitted attempt nothing writes to counts as an orphan: one hour, far
longer than a live save goes between two writes, so a live writer is never raced."""


@dataclasses.dataclass(frozen=True)
class Orphan:
    """An uncommitted attempt prefix.

    Attributes:
        step (int): its step.
        attempt_id (str): the attempt.
        rel (str): its prefix relative to the store root.
        url (str): its URL.
        size_bytes (int): bytes under it.
        age_secs (float): seconds since anything was last written under it, on the store's clock.
        writer_clock_age_secs (float | None): the same age by the UTC time in its id (the writer's
            clock): a hint for people, never used to decide.
        spread_rels (tuple[str, ...]): its prefixes under spread prefixes
            (``.spread/0a/step-NNNNNN/<attempt>``), which hold more of its objects (the spread
            layout, :mod:`opd_store.format._layout`); ``rel`` may then hold none.
    """

    step: int
    attempt_id: str
    rel: str
    url: str
    size_bytes: int
    age_secs: float
    writer_clock_age_secs: float | None = None
    spread_rels: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class StaleUpload:
    """An unfinished S3 multipart upload under the store prefix.

    Attributes:
        rel (str): the object key relative to the store root.
        upload_id (str): its upload id.
        age_secs (float): seconds since it (or, under an attempt prefix, its attempt) was last
            written to, on the store's clock.
    """

    rel: str
    upload_id: str
    age_secs: float


@dataclasses.dataclass
class _Attempt:
    step: int
    attempt_id: str
    size_bytes: int = 0
    rels: set[str] = dataclasses.field(default_factory=set)  # its prefixes (spread layout: several)
    last_secs: float | None = None  # newest activity on the store's clock
    untimed: bool = False  # an object without a recorded time: never an orphan

    def saw(self, secs: float | None) -> None:
        if secs is None:
            self.untimed = True
        elif self.last_secs is None or secs > self.last_secs:
            self.last_secs = secs


def _attempt_of(rel: str) -> tuple[int, str] | None:
    """``(step, attempt id)`` of an object under an attempt prefix (under the step prefix or a
    spread prefix), else ``None``."""
    found = _attempt_prefix_of(rel)
    return None if found is None else found[:2]


def _attempt_prefix_of(rel: str) -> tuple[int, str, str] | None:
    """``(step, attempt id, the attempt's prefix relative to the root)`` of an object under an
    attempt prefix, else ``None``."""
    found = split_step_rel(rel)
    if found is None:
        return None
    step, key = found
    prefix, path = split_key_in_step(key)
    attempt_id, slash, rest = path.partition("/")
    if not slash or not rest or not is_attempt_id(attempt_id):
        return None
    return step, attempt_id, f"{step_rel(step, prefix)}/{attempt_id}"


@dataclasses.dataclass
class Survey:
    """What one pass over a store found (see :func:`survey`).

    Attributes:
        now_secs (float): the store's clock when the pass began.
        orphans (list[Orphan]): orphan attempts.
        uploads (list[StaleUpload]): stale multipart uploads.
        live (list[Orphan]): uncommitted attempts written to within the grace period (age and
            size as for an orphan), for ``ls --all``.
    """

    now_secs: float
    orphans: list[Orphan]
    uploads: list[StaleUpload]
    live: list[Orphan]


def survey(store: CheckpointStore, *, older_than_secs: float = DEFAULT_ORPHAN_GRACE_SECS,
           now_secs: float | None = None) -> Survey:
    """Orphan attempts and stale multipart uploads of ``store`` (module docstring), read only.

    One reading of the store's clock, one flat listing, one listing of multipart uploads (where the
    backend has them: :meth:`Storage.multipart_uploads
    <opd_store.storage._base.Storage.multipart_uploads>`), one ``ListParts`` per upload initiated
    longer ago than the grace period, one manifest read per
    committed step (which attempt it names); a step without a manifest is judged from the listing
    (a legacy step's marker keeps it).

    Args:
        store (CheckpointStore): the store (one tier).
        older_than_secs (float): the grace period in seconds.
        now_secs (float | None): the store's notion of now, when the caller read it (tests);
            :meth:`Storage.clock_secs <opd_store.storage._base.Storage.clock_secs>` by default.

    Raises:
        OSError: a backend failure.
    """
    storage = store.storage
    now = storage.clock_secs() if now_secs is None else now_secs  # before the listing (module docs)
    attempts: dict[tuple[int, str], _Attempt] = {}
    by_step: dict[int, dict[str, int]] = {}  # the listing by step, for the manifest reads
    for rel, (size, modified) in storage.list_tree_modified("").items():
        head, _, tail = rel.partition("/")
        step = parse_step_dirname(head)
        if step is not None and tail:
            by_step.setdefault(step, {})[tail] = size
        found = _attempt_prefix_of(rel)
        if found is not None:
            attempt = attempts.setdefault(found[:2], _Attempt(*found[:2]))
            attempt.size_bytes += size
            attempt.rels.add(found[2])
            attempt.saw(modified)
    uploads: list[tuple[str, str, float]] = []
    multipart = storage.multipart_uploads()
    for rel, upload_id, initiated in multipart.list() if multipart is not None else []:
        last = _upload_activity(multipart, now, older_than_secs, rel, upload_id, initiated)
        uploads.append((rel, upload_id, last))
        found = _attempt_prefix_of(rel)
        if found is not None:
            # An attempt may be only uploads so far (its payloads stream in parallel and none is
            # published yet): its age is still the newest activity of all of them, never one
            # upload's alone (an idle payload's upload would be aborted under a live save).
            attempt = attempts.setdefault(found[:2], _Attempt(*found[:2]))
            attempt.rels.add(found[2])
            attempt.saw(last)

    orphans, live = [], []
    committed = _committed_attempts(store, by_step, {key[0] for key in attempts})
    for (step, attempt_id), attempt in sorted(attempts.items()):
        if step not in committed or committed[step] == attempt_id:
            continue  # legacy or unreadable step (kept), or the committed attempt
        rel = f"{step_dirname(step)}/{attempt_id}"
        created = attempt_created_secs(attempt_id)
        found = Orphan(step, attempt_id, rel, storage.url(rel), attempt.size_bytes,
                       now - attempt.last_secs if attempt.last_secs is not None else 0.0,
                       None if created is None else time.time() - created,
                       tuple(sorted(attempt.rels - {rel})))
        old = attempt.last_secs is not None and not attempt.untimed and found.age_secs >= older_than_secs
        (orphans if old else live).append(found)
    ages = {(o.step, o.attempt_id): o.age_secs for o in orphans + live}
    stale = []
    for rel, upload_id, last in uploads:
        key = _attempt_of(rel)
        age = ages[key] if key in ages else now - last
        if age >= older_than_secs:
            stale.append(StaleUpload(rel, upload_id, age))
    return Survey(now, orphans, stale, live)


def _upload_activity(multipart: MultipartUploads, now: float, older_than_secs: float, rel: str, upload_id: str,
                     initiated: float) -> float:
    """The last activity of one multipart upload on the store's clock: its ``Initiated``, or its
    newest part's time when it was initiated longer ago than the grace period (a live upload has a
    recent part; moto also reports one fixed ``Initiated`` for every upload)."""
    if now - initiated < older_than_secs:
        return initiated
    newest_part = multipart.newest_part_secs(rel, upload_id)
    return initiated if newest_part is None else max(initiated, newest_part)


def _committed_attempts(store: CheckpointStore, by_step: dict[int, dict[str, int]],
                        steps: set[int]) -> dict[int, str | None]:
    """For each step with attempts: the attempt its manifest names (``None``: no manifest). Steps
    whose manifest cannot be parsed, and legacy steps, are left out (nothing there is collected)."""
    out: dict[int, str | None] = {}
    for step in sorted(steps):
        objects = by_step.get(step, {})
        if MANIFEST_NAME in objects:
            manifest = store.step_state(step, objects).manifest
            if manifest is None:  # unreadable manifest: which attempt it names is unknown
                continue
            out[step] = manifest.attempt_id
        elif not holds_legacy_marker(objects):
            out[step] = None
    return out


def find_orphans(
    store: CheckpointStore, *, older_than_secs: float = DEFAULT_ORPHAN_GRACE_SECS, now_secs: float | None = None
) -> list[Orphan]:
    """Attempt prefixes no manifest names that nothing wrote to for ``older_than_secs`` on the
    store's clock (see :func:`survey`). Legacy steps and steps with an unreadable manifest are
    skipped (module docstring)."""
    return survey(store, older_than_secs=older_than_secs, now_secs=now_secs).orphans


def delete_orphans(store: CheckpointStore, orphans: Iterable[Orphan], *,
                   older_than_secs: float | None = None) -> list[Orphan]:
    """Delete orphan attempt prefixes. One that a manifest names by now is kept, and so, when
    ``older_than_secs`` is given, is one written to within the grace period by now: its objects
    and its open multipart uploads are listed again against a fresh reading of the store's clock
    (a writer that came back, perhaps streaming a payload not yet published).

    Returns:
        list[Orphan]: the orphans deleted.
    """
    orphans = list(orphans)
    now = store.storage.clock_secs() if orphans and older_than_secs is not None else None
    multipart = store.storage.multipart_uploads()
    open_uploads = multipart.list() if now is not None and multipart is not None else []
    deleted = []
    for orphan in orphans:
        try:
            manifest = store.manifest(orphan.step)
        except (FileNotFoundError, ValueError):
            manifest = None
        if manifest is not None and manifest.attempt_id == orphan.attempt_id:
            logger.warning("gc: %s was committed meanwhile; kept", orphan.url)
            continue
        rels = (orphan.rel, *orphan.spread_rels)
        if now is not None:
            times = [modified for prefix in rels
                     for _size, modified in store.storage.list_tree_modified(prefix).values()]
            times += [_upload_activity(multipart, now, older_than_secs, rel, upload_id, initiated)
                      for rel, upload_id, initiated in open_uploads if rel.startswith(tuple(f"{p}/" for p in rels))]
            if any(modified is None or now - modified < older_than_secs for modified in times):
                logger.warning("gc: %s was written to meanwhile; kept", orphan.url)
                continue
        for prefix in rels:
            store.storage.delete_tree(prefix)
        deleted.append(orphan)
    return deleted


def collect_garbage(
    store: Durability,
    policy: RetentionPolicy,
    *,
    orphans_older_than_secs: float = DEFAULT_ORPHAN_GRACE_SECS,
    deep: bool = False,
    dry_run: bool = True,
    now_secs: float | None = None,
    journal_keep_events: int = DEFAULT_KEEP_EVENTS,
) -> GcReport:
    """Retention, orphan removal, stale-upload aborts and the run journal's bound in one pass
    (``opd-store gc``).

    Args:
        store (Durability): a plain store, or a tiered store (each tier is collected; see the
            module docstring).
        policy (RetentionPolicy): steps to keep (a policy with no rule deletes no step); on a
            tiered store, the bucket's.
        orphans_older_than_secs (float): grace period of uncommitted attempts and uploads: seconds
            since anything was written under them, on the store's clock (module docstring).
        deep (bool): recompute checksums of the newest complete steps before planning.
        dry_run (bool): only report (the default).
        now_secs (float | None): the store's notion of now (seconds since the epoch), for tests;
            read from the store (:meth:`Storage.clock_secs
            <opd_store.storage._base.Storage.clock_secs>`) by default.
        journal_keep_events (int): run-journal events kept in the durable tier (module docstring).

    Returns:
        GcReport: the plan, orphans and uploads, and what was deleted, of the store (of the bucket
        for a tiered store); :func:`collect_garbage_tiers` returns one report per tier.

    Raises:
        ValueError: a negative grace period or ``journal_keep_events``.
        OSError: a backend failure (what was deleted before it stays deleted).
    """
    return collect_garbage_tiers(store, policy, orphans_older_than_secs=orphans_older_than_secs, deep=deep,
                                 dry_run=dry_run, now_secs=now_secs, journal_keep_events=journal_keep_events)[0]


def collect_garbage_tiers(
    store: Durability,
    policy: RetentionPolicy,
    *,
    orphans_older_than_secs: float = DEFAULT_ORPHAN_GRACE_SECS,
    deep: bool = False,
    dry_run: bool = True,
    now_secs: float | None = None,
    journal_keep_events: int = DEFAULT_KEEP_EVENTS,
) -> list[GcReport]:
    """:func:`collect_garbage` of every tier of ``store``: one report per tier, the durable tier
    first (one report for a plain store; the journal is bounded in the durable tier only). Same
    arguments and errors."""
    if orphans_older_than_secs < 0:
        raise ValueError(f"orphan grace period must be >= 0 seconds, got {orphans_older_than_secs}")
    if journal_keep_events < 0:
        raise ValueError(f"journal_keep_events must be >= 0, got {journal_keep_events}")
    reports = []
    for index, tier in enumerate(store.retention_tiers(policy)):
        report = _collect_tier(tier.store, tier.policy, tier.not_durable, orphans_older_than_secs, deep, dry_run,
                               now_secs)
        if index == 0:
            pruned = prune_journal(tier.store, keep_events=journal_keep_events, dry_run=dry_run)
            report.journal_events = [name.rel for name in pruned]
            report.journal_bytes = sum(name.size_bytes for name in pruned)
        reports.append(report)
    return reports


def _collect_tier(store: CheckpointStore, policy: RetentionPolicy, not_durable: frozenset[int],
                  grace_secs: float, deep: bool, dry_run: bool, now_secs: float | None) -> GcReport:
    report = apply_retention(store, policy, not_durable=not_durable, deep=deep, dry_run=True)
    report.dry_run = dry_run
    found = survey(store, older_than_secs=grace_secs, now_secs=now_secs)
    report.orphans, report.uploads = found.orphans, found.uploads
    if dry_run:
        return report
    report.deleted_steps = execute_plan(store, report.plan)
    # A given now_secs (tests) is the store's clock for the whole pass: no second reading.
    report.orphans = delete_orphans(store, report.orphans, older_than_secs=grace_secs if now_secs is None else None)
    # An upload under an attempt lives and dies with it: none of an orphan kept at its deletion.
    kept = {(o.step, o.attempt_id) for o in found.orphans} - {(o.step, o.attempt_id) for o in report.orphans}
    report.uploads = [u for u in report.uploads if _attempt_of(u.rel) not in kept]
    multipart = store.storage.multipart_uploads()
    for upload in report.uploads:  # found only where the backend has multipart uploads
        multipart.abort(upload.rel, upload.upload_id)
    return report


__all__ = [
    "DEFAULT_ORPHAN_GRACE_SECS",
    "Orphan",
    "StaleUpload",
    "Survey",
    "collect_garbage",
    "collect_garbage_tiers",
    "delete_orphans",
    "find_orphans",
    "survey",
]
