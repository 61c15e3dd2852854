"""Damaged committed steps and resumes: skipped alike, and never in the way of a run's saves.

Shared by every resume path (the main job, ``opd_store.job._resume_check``; the Hugging Face
integration, ``opd_store.integrations._hf_resume`` and ``StoreCallback``):

1. **Damaged steps are skipped alike.** A committed step whose payloads no longer match its
   manifest, whether short or missing (size) or altered (CRC32C, found only by reading the bytes),
   is skipped with one warning naming the step and the file, and the resume takes the newest step
   that verifies deeply. A truncated payload and a flipped byte are the same fault (bytes changed
   after the commit), so they lead to the same outcome.
2. **A damaged step the run would save again stops it before training.** The step of a save is
   its count of updates (the seed: ``step-{successful_updates}``), and a committed step is never
   replaced (the manifest is created only if absent; the seed raises ``FileExistsError``). A run
   that would save a step whose manifest exists would redo every update up to it and then die at
   the commit, on every restart. It is refused before the first update instead, in one line
   naming the step, its damage and the command that removes it (``opd-store delete URL STEP``,
   which deletes a damaged step only).
"""

from __future__ import annotations

import logging

from ..errors import IntegrityError
from ._api import ReadableStore
from ._legacy import LEGACY, LegacyReader
from ._status import COMPLETE

logger = logging.getLogger(__name__)


def damage(report) -> str:
    """``status: <path> detail; ...`` of a failed :class:`~opd_store.store._status.VerifyReport`."""
    return f"{report.status}: {'; '.join(p.detail for p in report.problems) or 'no manifest'}"


def newest_intact_step(store: ReadableStore) -> int | None:
    """The newest step that verifies deeply (every payload's size and CRC32C), or ``None``.

    Steps are tried newest first (one recursive listing and one manifest read per committed step,
    then every payload of each candidate read once). Each skipped step is logged as a warning
    ``URL: skipped step N (corrupt: <path>: expected crc32c ..., found ...)``. Legacy steps are
    accepted as the OPD layer accepts them (:class:`~opd_store.store._legacy.LegacyReader`).
    """
    for info in reversed(LegacyReader(store).checkpoints()):
        if info.status == LEGACY:
            return info.step
        report = store.verify(info.step, deep=info.status == COMPLETE)
        if report.ok:
            return info.step
        logger.warning("%s: skipped step %d (%s)", store.url, info.step, damage(report))
    return None


def refuse_damaged_step_ahead(store: ReadableStore, start: int, last: int | None, run: str) -> None:
    """Refuse a run that would save a committed step that is damaged.

    Args:
        store (ReadableStore): the run's store.
        start (int): the step the run resumes from (0: from scratch).
        last (int | None): the run's last step (``None``: unknown, every newer step counts).
        run (str): the run in words for the message (``resuming from step 2, --updates 4``).

    Raises:
        IntegrityError: the first committed step in ``(start, last]`` that does not verify deeply,
            naming the step, the file and the command that removes the step.
    """
    for step in store.steps():
        if step <= start or (last is not None and step > last):
            continue
        report = store.verify(step, deep=True)
        if not report.ok:
            raise IntegrityError(
                f"{store.step_url(step)}: step {step} is damaged ({damage(report)}) and this run ({run}) would "
                f"save step {step} again, which a committed step never allows; training did not start: keep what "
                f"you need of it, remove it with `opd-store delete {store.url} {step}`, then rerun the same command"
            )


__all__ = ["damage", "newest_intact_step", "refuse_damaged_step_ahead"]
