"""Multi-rank OPD checkpoints on ``torch.distributed``: every rank writes its part, one commit (issue 7).

With a process group initialised (NCCL in production, gloo in tests), every rank calls
:func:`~opd_store.opd.checkpoint.save_opd_checkpoint` and the save runs as three collectives over
the group's object collectives (``all_gather_object``, ``broadcast_object_list``):

1. **Prepare.** Every rank checks and snapshots its state; rank 0 also opens the transaction
   (``store.begin``: refuses a committed step) and so chooses the attempt id. All ranks gather
   ``(step, attempt id, error)``: any failure, or ranks disagreeing on the step, ends the save on
   every rank with the same :class:`~opd_store.errors.DistributedSaveError`.
2. **Write.** Rank 0 writes the shared payloads and its own RNG part into its transaction; every
   other rank writes its parts (``rng-rank-XX.pt``) under the same attempt through
   ``store.begin_part`` and seals them (durable; entries with size and CRC32C). All ranks gather
   ``(entries, error)``. Any failure: rank 0 deletes the attempt, every rank raises the same error.
3. **Commit.** Rank 0 records the other ranks' entries (``Transaction.add_entry``), creates the
   manifest and broadcasts the outcome: every rank returns the committed URL or raises the same
   error.

A rank that dies (SIGKILL, OOM) makes the collectives fail on the others (gloo: connection
closed) or time out (the process group's ``timeout``); rank 0 then never reaches the manifest
create, so nothing is committed. Every rank calls the collectives in the same order whatever
happens locally, so a local failure never leaves another rank waiting.

Loads (:func:`load_collective`) run locally on each rank, then gather the outcome: when some rank
failed, every rank raises. Decisions that must be the same everywhere (which checkpoint is the
latest) are made on rank 0 and broadcast (:func:`decide_on_rank0`).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import (
    CommitConflictError,
    DistributedCommitConflictError,
    DistributedLoadError,
    DistributedSaveError,
)
from ..manifest import PayloadEntry

logger = logging.getLogger("opd_store.opd.distributed")

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """This process's place in the default ``torch.distributed`` process group.

    Attributes:
        rank (int): this process's rank, ``0 <= rank < world_size``.
        world_size (int): ranks in the group (``> 1``).
    """

    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), index = rank. A collective: every rank must call it."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank. A collective: every rank must call it."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def current_group(*, rank: int | None = None, world_size: int | None = None) -> RankGroup | None:
    """The initialised process group as a :class:`RankGroup`, or ``None`` without one (or with one rank).

    Args:
        rank (int | None): the caller's rank; must equal the group's when given.
        world_size (int | None): the caller's world size; must equal the group's when given.

    Raises:
        ValueError: ``rank`` or ``world_size`` differ from the process group's (a misconfigured
            rank would otherwise write another rank's part), or ``rank`` is not 0 without a group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if rank not in (None, 0):
            raise ValueError(f"rank {rank} was given but no torch.distributed process group is initialised")
        return None
    group = RankGroup(dist.get_rank(), dist.get_world_size())
    check_group_args(group, rank=rank, world_size=world_size)
    return None if group.world_size == 1 else group


def check_group_args(group: RankGroup, *, rank: int | None, world_size: int | None) -> None:
    """Check a caller's ``rank``/``world_size`` arguments against the process group.

    Multi-rank saves and loads call this inside their first collective, so a rank with a wrong
    argument fails every rank at once instead of leaving the others waiting on the collective until
    the process group's timeout (issue 7: "none hangs when one rank fails").

    Raises:
        ValueError: ``rank`` or ``world_size`` differ from the group's (a misconfigured rank would
            otherwise write another rank's part).
    """
    if rank is not None and rank != group.rank:
        raise ValueError(f"rank {rank} differs from the process group's rank {group.rank}")
    if world_size is not None and world_size != group.world_size:
        raise ValueError(f"world_size {world_size} differs from the process group's world size {group.world_size}")


def _describe(error: BaseException | None) -> tuple[str, str, bool] | None:
    """``(type name, message, is a commit conflict)`` of a local failure: picklable, same everywhere."""
    if error is None:
        return None
    return type(error).__name__, str(error), isinstance(error, CommitConflictError)


def _failure_text(failures: dict[int, tuple[str, str, bool]]) -> str:
    return "; ".join(f"rank {rank} failed: {name}: {message}" for rank, (name, message, _c) in sorted(failures.items()))


def _save_error(url: str | None, step: Any, failures: dict[int, tuple[str, str, bool]]) -> DistributedSaveError:
    cls = DistributedCommitConflictError if all(c for _n, _m, c in failures.values()) else DistributedSaveError
    where = f"{url}: " if url else ""
    return cls.from_failures(
        f"{where}step {step} was not committed: {_failure_text(failures)}",
        {rank: f"{name}: {message}" for rank, (name, message, _c) in failures.items()},
    )


def save_collective(
    group: RankGroup,
    prepare: Callable[[], Any],
    write: Callable[[Any, Any, bool], None],
) -> str:
    """Save one checkpoint with every rank writing its part; commit once all parts are durable.

    Rank obligations: every rank of ``group`` calls this for the same step, in the same order as
    its other collectives, after the update has ended on every rank.

    Args:
        group (RankGroup): the process group (see :func:`current_group`).
        prepare (Callable[[], Any]): checks and snapshots this rank's state; returns a plan with
            ``store`` (CheckpointStore), ``step`` (int), ``world_size`` (int) and ``metadata``
            (dict) attributes. Runs on every rank.
        write (Callable[[txn, plan, bool], None]): writes the plan's payloads into a transaction;
            the flag is True on rank 0 (shared payloads too) and False elsewhere (rank-local parts
            only). Payload names must not collide across ranks.

    Returns:
        str: the committed checkpoint's URL, the same on every rank.

    Raises:
        opd_store.errors.DistributedCommitConflictError: (a ``FileExistsError``) the step is
            already committed, or another writer committed it first; on every rank.
        opd_store.errors.DistributedSaveError: (a ``CommitError``, an ``OSError``) any rank failed
            to prepare or write its part, ranks disagreed on the step, or the manifest create
            failed; on every rank, naming each failing rank and its error. Nothing is committed.
        RuntimeError: a collective failed (a rank died or the process group timed out); the
            attempt is discarded by rank 0 when it can still run.
    """
    plan = txn = None
    committing = False
    local_error: BaseException | None = None
    try:
        try:
            plan = prepare()
            if group.rank == 0:
                txn = plan.store.begin(plan.step, world_size=group.world_size, metadata=plan.metadata, rank=0)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_error = exc
        reports = group.all_gather(
            (
                None if plan is None else plan.step,
                None if plan is None else plan.store.step_url(plan.step),
                None if txn is None else txn.attempt_id,
                _describe(local_error),
            )
        )
        url = next((report[1] for report in reports if report[1] is not None), None)
        step = reports[0][0]
        failures = {rank: report[3] for rank, report in enumerate(reports) if report[3] is not None}
        if not failures and len({report[0] for report in reports}) > 1:
            steps = ", ".join(f"rank {rank}: {report[0]}" for rank, report in enumerate(reports))
            failures = {0: ("ValueError", f"ranks disagree on the step ({steps})", False)}
        if failures:
            raise _save_error(url, step, failures) from local_error
        attempt_id = reports[0][2]

        entries: list[dict] | None = None
        try:
            if group.rank == 0:
                write(txn, plan, True)
            else:
                with plan.store.begin_part(
                    plan.step, attempt_id=attempt_id, rank=group.rank, world_size=group.world_size
                ) as part:
                    write(part, plan, False)
                entries = [entry.model_dump() for entry in part.entries]
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_error = exc
        reports = group.all_gather((entries, _describe(local_error)))
        failures = {rank: report[1] for rank, report in enumerate(reports) if report[1] is not None}
        if failures:
            raise _save_error(url, step, failures) from local_error

        outcome = None
        if group.rank == 0:
            try:
                for rank_entries, _error in reports[1:]:
                    for entry in rank_entries:
                        txn.add_entry(PayloadEntry(**entry))
                committing = True
                outcome = (txn.commit(), None)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                local_error = exc
                outcome = (None, _describe(exc))
        outcome = group.broadcast(outcome)
        if outcome[1] is not None:
            raise _save_error(url, step, {0: outcome[1]}) from local_error
        return outcome[0]
    except BaseException:
        # Before the manifest create nothing names the attempt: rank 0 deletes it (every rank's
        # parts). After a failed create the payloads stay (a delayed create may still land).
        if txn is not None and not committing:
            txn.abort()
        raise


def load_collective(group: RankGroup, load: Callable[[], T]) -> T:
    """Run ``load`` on every rank, then agree on the outcome.

    Rank obligations: every rank calls this (a collective).

    Returns:
        the local result, when every rank's ``load`` succeeded.

    Raises:
        Exception: the local error itself when every rank failed with the same error type and
            message (a world-size change: a ``ResumeMismatchError`` naming both sizes).
        opd_store.errors.DistributedLoadError: (an ``OSError``) some ranks failed, or they failed
            differently; every rank raises it, naming each failing rank and its error.
    """
    result = None
    local_error: BaseException | None = None
    try:
        result = load()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        local_error = exc
    reports = group.all_gather(_describe(local_error))
    failures = {rank: report for rank, report in enumerate(reports) if report is not None}
    if not failures:
        return result
    if local_error is not None and len(failures) == group.world_size and len(set(failures.values())) == 1:
        raise local_error
    raise DistributedLoadError.from_failures(
        f"the checkpoint load failed on {len(failures)} of {group.world_size} ranks: {_failure_text(failures)}",
        {rank: f"{name}: {message}" for rank, (name, message, _c) in failures.items()},
    ) from local_error


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - replaced by a plain error with the same text
        return RuntimeError(f"{type(error).__name__}: {error}")


def decide_on_rank0(group: RankGroup, decide: Callable[[], T]) -> T:
    """Run ``decide`` on rank 0 only and return its result on every rank (or raise its error).

    Used so that every rank resumes from the same checkpoint even while another writer is
    committing (issue 7): each rank listing the store itself could see different latest steps.

    Rank obligations: every rank calls this (a collective); ``decide`` must not run collectives
    itself (it runs on rank 0 only), e.g. not :func:`latest_complete_checkpoint`, which is one.

    Raises:
        Exception: the error ``decide`` raised on rank 0, re-raised on every rank (same type and
            message; a ``RuntimeError`` with its text when it cannot be pickled).
    """
    outcome = None
    if group.rank == 0:
        try:
            outcome = (decide(), None)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            outcome = (None, _picklable(exc))
    value, error = group.broadcast(outcome)
    if error is not None:
        raise error
    return value


__all__ = ["RankGroup", "current_group", "decide_on_rank0", "load_collective", "save_collective"]
