"""The write and commit stages of a multi-rank save: every rank writes its part, rank 0 commits.

The stages of :mod:`opd_store.pipeline._save`, run on every rank of a process group as three
collectives over the group's object collectives (``all_gather``, ``broadcast``; the group is any
object with ``rank``, ``world_size``, ``all_gather(obj)`` and ``broadcast(obj)``, e.g.
:class:`opd_store.opd._distributed.RankGroup` over ``torch.distributed``):

1. **Prepare.** Every rank runs its snapshot stage; rank 0 also opens the transaction
   (``store.begin``: refuses a committed step) and so chooses the attempt id. All ranks gather
   ``(step, attempt id, error)``: any failure, or ranks disagreeing on the step, ends the save on
   every rank with the same :class:`~opd_store.errors.DistributedSaveError`.
2. **Write.** Rank 0 writes the shared payloads and its own part into its transaction; every other
   rank writes its part under the same attempt through ``store.begin_part`` and seals it (durable;
   entries with size and CRC32C). All ranks gather ``(entries, error)``. Any failure: rank 0
   deletes the attempt, every rank raises the same error.
3. **Commit.** Rank 0 records the other ranks' entries (``Transaction.add_entry``), creates the
   manifest and broadcasts the outcome: every rank returns the committed URL or raises the same
   error.

**Deferred commit** (``defer``, an asynchronous multi-rank save): rank 0 writes nothing in stage 2;
in stage 3 it records the other ranks' entries and hands ``finish`` (write rank 0's payloads into
the attempt, commit) to ``defer``, e.g. a :class:`~opd_store.pipeline._worker.BackgroundWorker`
task, and every rank returns at once. The other ranks' parts are sealed by then, so they never
wait for rank 0's upload; a failure of ``finish`` deletes the attempt with every rank's part and
reaches rank 0's caller through ``defer``'s owner (its next sync point).

A rank that dies (SIGKILL, OOM) makes the collectives fail on the others (gloo: connection closed)
or time out (the process group's ``timeout``); rank 0 then never reaches the manifest create, so
nothing is committed. Every rank calls the collectives in the same order whatever happens locally,
so a local failure never leaves another rank waiting.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..errors import CommitConflictError, DistributedCommitConflictError, DistributedSaveError
from ..format import PayloadEntry
from ._save import SaveRequest


def describe_failure(error: BaseException | None) -> tuple[str, str, bool] | None:
    """``(type name, message, is a commit conflict)`` of a local failure: picklable, same everywhere."""
    if error is None:
        return None
    return type(error).__name__, str(error), isinstance(error, CommitConflictError)


def failure_text(failures: dict[int, tuple[str, str, bool]]) -> str:
    """One line naming each failing rank and its error."""
    return "; ".join(f"rank {rank} failed: {name}: {message}" for rank, (name, message, _c) in sorted(failures.items()))


def _save_error(url: str | None, step: Any, failures: dict[int, tuple[str, str, bool]]) -> DistributedSaveError:
    cls = DistributedCommitConflictError if all(c for _n, _m, c in failures.values()) else DistributedSaveError
    where = f"{url}: " if url else ""
    return cls.from_failures(
        f"{where}step {step} was not committed: {failure_text(failures)}",
        {rank: f"{name}: {message}" for rank, (name, message, _c) in failures.items()},
    )


FinishCommit = Callable[..., str]
"""``finish(cancelled=None) -> url``: rank 0's deferred write and commit (see the module docstring);
``cancelled`` is the running worker's exit-deadline event."""


def write_and_commit_collective(group: Any, prepare: Callable[[], SaveRequest], *,
                                defer: Callable[[FinishCommit], None] | None = None) -> tuple[str | None, SaveRequest]:
    """Save one checkpoint with every rank writing its part; commit once all parts are durable.

    Rank obligations: every rank of ``group`` calls this for the same step, in the same order as
    its other collectives, after the update has ended on every rank. Payload names must not
    collide across ranks. ``defer`` is given on every rank or on none.

    Args:
        group: the process group (``rank``, ``world_size``, ``all_gather``, ``broadcast``).
        prepare (Callable[[], SaveRequest]): this rank's snapshot stage. Runs on every rank.
        defer (Callable[[FinishCommit], None] | None): (rank 0) takes ``finish`` and runs it later
            (the deferred commit of the module docstring); ``finish`` releases the request's
            snapshot and aborts the attempt when it fails. Ignored on other ranks.

    Returns:
        tuple[str | None, SaveRequest]: the committed checkpoint's URL (the same on every rank;
        ``None`` with ``defer``: the commit is still to come) and this rank's request (rank 0 runs
        the after-commit hooks with it, after ``finish`` when deferred).

    Raises:
        opd_store.errors.DistributedCommitConflictError: (a ``FileExistsError``) the step is
            already committed, or another writer committed it first; on every rank.
        opd_store.errors.DistributedSaveError: (a ``CommitError``, an ``OSError``) any rank failed
            to prepare or write its part, ranks disagreed on the step, or the manifest create
            failed; on every rank, naming each failing rank and its error. Nothing is committed.
        RuntimeError: a collective failed (a rank died or the process group timed out); the
            attempt is discarded by rank 0 when it can still run.
    """
    request = txn = None
    committing = handed_over = False
    deferred = defer is not None and group.rank == 0
    local_error: BaseException | None = None
    try:
        try:
            request = prepare()
            if group.rank == 0:
                txn = request.store.begin(request.step, world_size=group.world_size, metadata=request.metadata, rank=0)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_error = exc
        reports = group.all_gather(
            (
                None if request is None else request.step,
                None if request is None else request.store.step_url(request.step),
                None if txn is None else txn.attempt_id,
                describe_failure(local_error),
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
                if not deferred:
                    request.write(txn, True)
            else:
                with request.store.begin_part(
                    request.step, attempt_id=attempt_id, rank=group.rank, world_size=group.world_size
                ) as part:
                    request.write(part, False)
                entries = [entry.model_dump() for entry in part.entries]
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_error = exc
        finally:
            if not deferred:
                request.finish_write_stage()
        reports = group.all_gather((entries, describe_failure(local_error)))
        failures = {rank: report[1] for rank, report in enumerate(reports) if report[1] is not None}
        if failures:
            raise _save_error(url, step, failures) from local_error

        outcome = None
        if group.rank == 0:
            try:
                for rank_entries, _error in reports[1:]:
                    for entry in rank_entries:
                        txn.add_entry(PayloadEntry(**entry))
                if deferred:
                    defer(_finish_later(request, txn))
                    handed_over = True
                    outcome = (None, None)
                else:
                    committing = True
                    outcome = (txn.commit(), None)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                local_error = exc
                outcome = (None, describe_failure(exc))
        outcome = group.broadcast(outcome)
        if outcome[1] is not None:
            raise _save_error(url, step, {0: outcome[1]}) from local_error
        return outcome[0], request
    except BaseException:
        # Before the manifest create nothing names the attempt: rank 0 deletes it (every rank's
        # parts). After a failed create the payloads stay (a delayed create may still land).
        if txn is not None and not committing and not handed_over:
            txn.abort()
        if request is not None and not handed_over:
            request.finish_write_stage()
        raise


def _finish_later(request: SaveRequest, txn: Any) -> FinishCommit:
    """Rank 0's deferred stages 2 and 3 (module docstring): its payloads, then the manifest."""

    def finish(cancelled: threading.Event | None = None) -> str:
        try:
            with txn:  # commits on a clean exit; aborts (every rank's part) on an exception
                if cancelled is not None:
                    txn.cancel_when(cancelled)
                request.write(txn, True)
        finally:
            request.finish_write_stage()
        return txn.committed_url

    return finish


__all__ = ["FinishCommit", "describe_failure", "failure_text", "write_and_commit_collective"]
