"""The main job's resume guard: no committed step in the run's way.

Damaged steps follow :mod:`opd_store.store._resume_guard`'s rules over every step between the
resume point and ``--updates`` (a preemption notice saves whatever step the run reached, and a
damaged committed step fails that commit); an intact committed step that the run's cadence saves
is refused too: the run would redo updates, then fail at that commit. An intact step off the
cadence is no obstacle (a notice at it reports it ``already committed``): before, ``--resume never
--checkpoint-every 8 --updates 7`` was refused as "would save step 2 again" though it saves no step.
"""

from __future__ import annotations

from ..errors import CommitConflictError
from ..store import ReadableStore, VerifyReport, refuse_damaged_step_ahead


def check_steps_ahead(store: ReadableStore, resumed_step: int | None, updates: int, *, every: int | None = None,
                      known: dict[int, VerifyReport] | None = None) -> None:
    """Refuse a run that would save a step already committed (between its resume point and ``updates``).

    Args:
        store (ReadableStore): the job's store.
        resumed_step (int | None): the step the run resumes from (``None``: from scratch).
        updates (int): the run's last step.
        every (int | None): the run's fixed save interval (it saves the multiples of ``every``:
            :meth:`~opd_store.job._ledger.JobLedger.save_due`); ``None``: it may save any step
            (``--checkpoint-every auto`` moves the interval).
        known (dict[int, VerifyReport] | None): reports of the damaged steps the resume guard
            skipped (not read again).

    Raises:
        IntegrityError: such a step is damaged (exit 4): names the step, the file and the command
            that removes it (:func:`~opd_store.store._resume_guard.refuse_damaged_step_ahead`).
        CommitConflictError: such a step is intact (exit 6): ``--resume auto`` continues from it.
    """
    start = resumed_step or 0
    resuming = f"resuming from step {resumed_step}" if resumed_step is not None else "starting from scratch"
    refuse_damaged_step_ahead(store, start, updates, f"{resuming}, --updates {updates}", known=known)
    ahead = [step for step in store.steps() if start < step <= updates and (every is None or step % every == 0)]
    if ahead:
        raise CommitConflictError(
            f"{store.step_url(ahead[0])}: step {ahead[0]} is already committed and this run ({resuming}, --updates "
            f"{updates}) would save it again; training did not start: rerun with --resume auto to continue from it"
        )


__all__ = ["check_steps_ahead"]
