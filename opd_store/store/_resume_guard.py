"""The promise every resume keeps when a committed step is damaged, stated once (docs/resume.md,
"A damaged checkpoint"; every entry point links here):

    A damaged newest checkpoint either resumes from the newest intact one with a warning naming
    what was skipped (where the framework's semantics allow it and the resumed run cannot later
    collide with the damaged step), or stops before training with one line naming the step, the
    file and the remedy; never a silent fresh start, never a load of damaged bytes.

*Damaged* means a committed step (its manifest exists) whose payloads no longer match the
manifest: missing, short (size), or altered (CRC32C, found only by reading the bytes); a missing
rank file is a missing payload. A truncated payload and a flipped byte are the same fault (bytes
changed after the commit), so they get the same outcome. What follows from the seed's rules:

1. **The damaged step is in the run's way.** A save's step is its count of updates (the seed:
   ``step-{successful_updates}``) and a committed step is never replaced (the manifest is created
   only if absent; the seed raises ``FileExistsError``). A run resumed from an older step (or
   started from scratch) would redo every update up to the damaged step and then die at its commit,
   on every restart. So the run stops before the first update with one line naming the step, its
   damage and the remedy (:func:`remedy`: ``opd-store delete URL STEP``, which deletes a damaged
   step only), unless it ends before that step (:func:`refuse_damaged_step_ahead`).
2. **Skipped alike, and said.** The newest step that verifies deeply is the resume candidate
   (:func:`find_resume_point`); every damaged step skipped on the way is logged as a warning naming
   the step and the file. A step without a manifest (a save that never committed) is skipped too:
   it is not in the run's way (a new attempt commits beside its leftovers).
3. **Never damaged bytes.** Every payload is checked (size, CRC32C) before a loader sees it
   (:mod:`opd_store.store._verified_reads`); a load that meets a damaged payload raises
   ``IntegrityError`` or ``IncompleteCheckpointError`` whose message ends with :func:`remedy`.
4. **One download.** The bytes the deep check read are the bytes the load uses
   (:class:`~opd_store.store._verified_copy.VerifiedCopy`).

Entry points: the main job (``opd_store.job._resume_check``), ``latest_complete_checkpoint``,
``load_opd_checkpoint``, ``load_adapter``, ``load_sharded_opd_checkpoint``, ``opd_store.dcp.load``,
the Hugging Face and Lightning integrations.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from ..errors import IntegrityError
from ._api import ReadableStore
from ._legacy import LEGACY, LegacyReader
from ._status import COMPLETE, UNCOMMITTED, VerifyReport
from ._verified_copy import VerifiedCopy

logger = logging.getLogger(__name__)


def damage(report: VerifyReport) -> str:
    """``status: <path> detail; ...`` of a failed :class:`~opd_store.store._status.VerifyReport`."""
    return f"{report.status}: {'; '.join(p.detail for p in report.problems) or 'no manifest'}"


def remedy(store_url: str, step: int) -> str:
    """The remedy for damaged committed step ``step`` of the store at ``store_url``, in words."""
    return (f"keep what you need of it, remove it with `opd-store delete {store_url} {step}` (it deletes a damaged "
            "step only), then resume from the newest intact step")


@dataclasses.dataclass
class ResumePoint:
    """Where a resume starts (:func:`find_resume_point`).

    Attributes:
        step (int | None): the newest step that verified deeply (or a legacy step); ``None``: none.
        copy (VerifiedCopy | None): that step's payloads as the check read them, for the load
            (``None`` for a legacy step or when there is no step); release it after loading.
        skipped (dict[int, VerifyReport]): the committed steps newer than ``step`` that are
            damaged, with their reports (a step without a manifest is not listed).
    """

    step: int | None
    copy: VerifiedCopy | None = None
    skipped: dict[int, VerifyReport] = dataclasses.field(default_factory=dict)

    def release(self) -> None:
        """Drop the kept payloads."""
        if self.copy is not None:
            self.copy.release()


def find_resume_point(store: ReadableStore, *, keep: Callable[[str], bool] | None = None) -> ResumePoint:
    """The newest step that verifies deeply, with its payloads kept for the load.

    Steps are tried newest first: one recursive listing and one manifest read per committed step,
    then every payload of a complete candidate read once (the first intact one's are kept, as
    ``keep`` selects: :class:`~opd_store.store._verified_copy.VerifiedCopy`). Each skipped step is
    logged as a warning ``URL: skipped step N (corrupt: <path>: expected crc32c ..., found ...)``.
    Legacy steps are accepted as the OPD layer accepts them
    (:class:`~opd_store.store._legacy.LegacyReader`), without a copy (no checksums to check).

    Args:
        store (ReadableStore): the run's store.
        keep (Callable[[str], bool] | None): which payloads of the resumed step to keep (default:
            none: the caller only wants the step).

    Returns:
        ResumePoint: the step (``None``: no intact step), its copy and the damaged steps skipped.
    """
    point = ResumePoint(None)
    for info in reversed(LegacyReader(store).checkpoints()):
        if info.status == LEGACY:
            point.step = info.step
            return point
        if info.status == COMPLETE:
            copy = VerifiedCopy(store, info.step, keep=keep if keep is not None else (lambda _name: False))
            report = copy.check()
            if report.ok:
                point.step, point.copy = info.step, copy
                return point
        else:
            report = store.verify(info.step)
        logger.warning("%s: skipped step %d (%s)", store.url, info.step, damage(report))
        if report.status != UNCOMMITTED:
            point.skipped[info.step] = report
    return point


def newest_intact_step(store: ReadableStore) -> int | None:
    """The newest step that verifies deeply, or ``None`` (:func:`find_resume_point`, nothing kept)."""
    return find_resume_point(store).step


def refuse_damaged_step_ahead(store: ReadableStore, start: int, last: int | None, run: str, *,
                              known: dict[int, VerifyReport] | None = None, shallow: bool = False) -> None:
    """Refuse a run that would save a committed step that is damaged (rule 1 of the module docstring).

    Each committed step in ``(start, last]`` is checked: its sizes, then (when they hold, unless
    ``shallow``) its CRC32Cs, unless ``known`` already holds its report (the steps
    :func:`find_resume_point` skipped: never read twice).

    Args:
        store (ReadableStore): the run's store.
        start (int): the step the run resumes from (0: from scratch).
        last (int | None): the run's last step (``None``: unknown, every newer step counts).
        run (str): the run in words for the message (``resuming from step 2, --updates 4``).
        known (dict[int, VerifyReport] | None): reports already made (:attr:`ResumePoint.skipped`).
        shallow (bool): sizes only, no payload read (``latest_complete_checkpoint``: every step
            newer than the newest complete one already fails on sizes or its manifest).

    Raises:
        IntegrityError: the first committed step in ``(start, last]`` that does not verify deeply,
            naming the step, the file and the remedy (:func:`remedy`).
    """
    known = known or {}
    for step in store.steps():
        if step <= start or (last is not None and step > last):
            continue
        report = known.get(step) or store.verify(step)
        if report.ok and not report.deep and not shallow:
            report = store.verify(step, deep=True)
        if not report.ok:
            raise IntegrityError(
                f"{store.step_url(step)}: step {step} is damaged ({damage(report)}) and this run ({run}) would "
                f"save step {step} again, which a committed step never allows; training did not start: keep what "
                f"you need of it, remove it with `opd-store delete {store.url} {step}`, then rerun the same command"
            )


__all__ = ["ResumePoint", "damage", "find_resume_point", "newest_intact_step", "refuse_damaged_step_ahead", "remedy"]
