"""The main job's resume decision: the newest *intact* step, and no committed step in the run's way.

Two rules, both decided before any model is built or any update runs:

1. **Damaged steps are skipped alike.** A committed step whose payloads no longer match its
   manifest, whether short (size) or altered (CRC32C, found only by reading the bytes), is skipped
   with one warning naming the step and the file, and the run resumes from the newest step that
   verifies deeply. One rule for both kinds of damage: a truncated payload and a flipped byte are
   the same fault (bytes changed after the commit), so they must not lead to different outcomes.
2. **No committed step ahead of the resume point.** The step of a save is the count of successful
   updates (the seed: ``step-{successful_updates}``), and a committed step is never replaced (the
   manifest is created only if absent; the seed raises ``FileExistsError``). A run that would
   save a step that already has a manifest would redo every update up to it and then die at the
   commit, on every restart. It is refused here instead, in one line naming the step, its damage
   and the exact command that clears the way (``opd-store delete URL STEP``, which removes only a
   damaged step), or, for an intact step, the resume that reaches it.
"""

from __future__ import annotations

import logging

from ..errors import CommitConflictError, IntegrityError
from ..status import COMPLETE, LEGACY
from ..store_api import BaseStore

logger = logging.getLogger(__name__)


def _damage(report) -> str:
    """``status: file detail; ...`` of a failed :class:`~opd_store.status.VerifyReport`."""
    return f"{report.status}: {'; '.join(p.detail for p in report.problems) or 'no manifest'}"


def newest_intact_step(store: BaseStore) -> int | None:
    """The newest step that verifies deeply (every payload's size and CRC32C), or ``None``.

    Steps are tried newest first (one recursive listing, one manifest read per committed step,
    then every payload of each candidate read once). Each skipped step is logged as a warning
    ``skipped step N (corrupt: <path>: expected crc32c ..., found ...)``. Seed-layout (legacy)
    steps are accepted as the OPD layer does.
    """
    for info in reversed(store.checkpoints()):
        if info.status == LEGACY:
            return info.step
        if info.status == COMPLETE:
            report = store.verify(info.step, deep=True)
            if report.ok:
                return info.step
            logger.warning("%s: skipped step %d (%s)", store.url, info.step, _damage(report))
            continue
        logger.warning("%s: skipped step %d (%s)", store.url, info.step, _damage(store.verify(info.step)))
    return None


def check_steps_ahead(store: BaseStore, resumed_step: int | None, updates: int) -> None:
    """Refuse a run that would save a step already committed (between its resume point and ``updates``).

    Args:
        store (BaseStore): the job's store.
        resumed_step (int | None): the step the run resumes from (``None``: from scratch).
        updates (int): the run's last step.

    Raises:
        IntegrityError: the first such step is damaged (exit 4); the message names the step, the
            file and the command that removes the damaged step.
        CommitConflictError: it is intact (exit 6): another resume (``--resume auto``) reaches it.
    """
    start = resumed_step or 0
    ahead = [step for step in store.steps() if start < step <= updates]
    if not ahead:
        return
    step = ahead[0]
    resuming = f"resuming from step {resumed_step}" if resumed_step is not None else "starting from scratch"
    report = store.verify(step, deep=True)
    if report.ok:
        raise CommitConflictError(
            f"{store.step_url(step)}: step {step} is already committed and this run ({resuming}, --updates "
            f"{updates}) would save it again; training did not start: rerun with --resume auto to continue from it"
        )
    raise IntegrityError(
        f"{store.step_url(step)}: step {step} is damaged ({_damage(report)}) and this run ({resuming}, "
        f"--updates {updates}) would save step {step} again, which a committed step never allows; training "
        f"did not start: keep what you need of it, remove it with `opd-store delete {store.url} {step}`, "
        "then rerun the same command"
    )


__all__ = ["check_steps_ahead", "newest_intact_step"]
