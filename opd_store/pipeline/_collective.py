"""A save on every rank of a process group: each rank writes its part, rank 0 commits, and one
function (:func:`agree`) gathers every rank's outcome and fails every rank the same way.

The three collectives are tabled in docs/protocol.md ("Several ranks, one commit"); where they sit
among the save's stages, in ARCHITECTURE.md ("The save path"). The group is any object with
``rank``, ``world_size``, ``all_gather(obj)`` and ``broadcast(obj)`` (rank 0's ``obj`` on every
rank), e.g. :class:`opd_store.opd.RankGroup` over ``torch.distributed``.

**Deferred commit** (``defer``: an asynchronous multi-rank save): rank 0 writes nothing in the
write collective; it records the other ranks' entries and hands ``finish`` (write rank 0's
payloads into the attempt, commit, run the after-commit stage) to ``defer``, and every rank
returns at once. The other ranks' parts are sealed by then, so they never wait for rank 0's
upload; a failure of ``finish`` deletes the attempt with every rank's part and reaches rank 0's
caller at its background owner's next sync point (:class:`~opd_store.pipeline._background.BackgroundSaves`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..errors import (
    AmbiguousCommitError,
    CommitConflictError,
    DistributedAmbiguousCommitError,
    DistributedCommitConflictError,
    DistributedPermissionError,
    DistributedSaveError,
    DistributedUnreachableError,
    StoragePermissionError,
    StoreUnreachableError,
)
from ..format import PayloadEntry
from ._save import SaveRequest

Failure = tuple[str, str, "str | None"]
"""``(type name, message, meaning)``: a rank's failure as every rank receives it; ``meaning`` is
the kind of :data:`MEANINGS` the error is (``None``: another error)."""

MEANINGS: dict[str, tuple[type[BaseException], type[DistributedSaveError]]] = {
    "conflict": (CommitConflictError, DistributedCommitConflictError),
    "ambiguous": (AmbiguousCommitError, DistributedAmbiguousCommitError),
    "permission": (StoragePermissionError, DistributedPermissionError),
    "unreachable": (StoreUnreachableError, DistributedUnreachableError),
}
"""What a failure means, and the error every rank raises when every failing rank's failure means
it: a caller that handles a commit conflict, an ambiguous commit, a refused permission or an
unreachable store handles the multi-rank form the same way (docs/protocol.md, "Errors")."""


def describe_failure(error: BaseException | None) -> Failure | None:
    """The :data:`Failure` of a local error (picklable, the same on every rank), or ``None``."""
    if error is None:
        return None
    meaning = next((kind for kind, (cls, _distributed) in MEANINGS.items() if isinstance(error, cls)), None)
    return type(error).__name__, str(error), meaning


def failure_text(failures: dict[int, Failure]) -> str:
    """One line naming each failing rank and its error, in rank order."""
    return "; ".join(f"rank {rank} failed: {name}: {message}" for rank, (name, message, _c) in sorted(failures.items()))


def save_failure(url: str | None, step: Any, failures: dict[int, Failure]) -> DistributedSaveError:
    """The error every rank raises for a multi-rank save that was not committed (or, ambiguous,
    may have been), naming the URL, the step and each failing rank (``failures``): a
    :class:`DistributedSaveError`, of the class of :data:`MEANINGS` that keeps the failures' meaning
    when they all share one (:class:`DistributedCommitConflictError`,
    :class:`DistributedAmbiguousCommitError`, :class:`DistributedPermissionError`,
    :class:`DistributedUnreachableError`)."""
    meanings = {meaning for _n, _m, meaning in failures.values()}
    only = next(iter(meanings)) if len(meanings) == 1 else None
    cls = MEANINGS[only][1] if only is not None else DistributedSaveError
    where = f"{url}: " if url else ""
    return cls.from_failures(
        f"{where}step {step} was not committed: {failure_text(failures)}",
        {rank: f"{name}: {message}" for rank, (name, message, _c) in sorted(failures.items())},
    )


def agree(group: Any, value: Any, error: BaseException | None, *, url: str | None = None, step: Any = None,
          same: Any = None, same_name: str = "") -> list[Any]:
    """One collective of a multi-rank save: every rank's ``value``, or the same error everywhere.

    Every rank gathers ``(value, url, step, same, its failure)``. When a rank failed, or the ranks
    disagree on the step (or on ``same``: a value every rank must share, ``same_name`` in words),
    every rank raises the same :func:`save_failure`, naming the first URL and step a rank knew,
    chained to its own error. Without a group (``None``: one process), ``error`` is raised as it is.

    Rank obligations: every rank of ``group`` calls it at the same point, failed or not.

    Returns:
        list: every rank's ``value``, index = rank.

    Raises:
        DistributedSaveError: (a ``CommitError``) as above;
            :class:`DistributedCommitConflictError` when every failure is a commit conflict.
        RuntimeError: the collective itself failed (a rank died, the group timed out).
    """
    if group is None:
        if error is not None:
            raise error
        return [value]
    reports = group.all_gather((value, url, step, same, describe_failure(error)))
    url = next((report[1] for report in reports if report[1] is not None), None)
    step = next((report[2] for report in reports if report[2] is not None), None)
    failures = {rank: report[4] for rank, report in enumerate(reports) if report[4] is not None}
    if not failures and len({(report[2], report[3]) for report in reports}) > 1:
        named = f"the step or {same_name}" if same_name else "the step"
        seen = ", ".join(f"rank {rank}: step {report[2]}" + (f", {same_name} {report[3]}" if same_name else "")
                         for rank, report in enumerate(reports))
        failures = {0: ("ValueError", f"ranks disagree on {named} ({seen})", None)}
    if failures:
        raise save_failure(url, step, failures) from error
    return [report[0] for report in reports]


FinishCommit = Callable[..., str]
"""``finish(cancelled=None) -> url``: the rest of rank 0's deferred save (module docstring);
``cancelled`` is the running worker's exit-deadline event."""


def run_save_collective(group: Any, prepare: Callable[[], SaveRequest], *,
                        defer: Callable[[FinishCommit], None] | None = None) -> str | None:
    """Save one checkpoint with every rank writing its part; commit once all parts are durable;
    rank 0 then runs the after-commit stage (:meth:`AfterCommit.run`).

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
        str | None: the committed checkpoint's URL, the same on every rank; ``None`` with
        ``defer`` (the commit is still to come).

    Raises:
        opd_store.errors.DistributedCommitConflictError: (a ``FileExistsError``) the step is
            already committed, or another writer committed it first; on every rank.
        opd_store.errors.DistributedSaveError: (a ``CommitError``, an ``OSError``) any rank failed
            to prepare or write its part, ranks disagreed on the step, or the manifest create
            failed; on every rank, naming each failing rank and its error. Nothing is committed,
            except after an ambiguous create (:class:`~opd_store.errors.DistributedAmbiguousCommitError`,
            an ``AmbiguousCommitError``). Failures that all mean one thing keep that meaning
            (:func:`save_failure`).
        RetentionError: (rank 0, plain store) the step committed and its retention pass failed.
        RuntimeError: a collective failed (a rank died or the process group timed out); the
            attempt is discarded by rank 0 when it can still run.
    """
    url, request = _write_and_commit(group, prepare, defer)
    if url is not None and group.rank == 0:
        request.after.run(url)
    return url


def _write_and_commit(group: Any, prepare: Callable[[], SaveRequest],
                      defer: Callable[[FinishCommit], None] | None) -> tuple[str | None, SaveRequest]:
    """The three collectives of :func:`run_save_collective`: ``(url or None, this rank's request)``."""
    request = txn = None
    committing = handed_over = False
    deferred = defer is not None and group.rank == 0
    local_error: BaseException | None = None
    try:
        try:
            request = prepare()
            if group.rank == 0:
                txn = request.store.begin(request.step, world_size=group.world_size, metadata=request.metadata, rank=0)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
            local_error = exc
        url = None if request is None else request.store.step_url(request.step)
        step = None if request is None else request.step
        attempt_ids = agree(group, None if txn is None else txn.attempt_id, local_error, url=url, step=step)

        entries: list[dict] | None = None
        try:
            if group.rank == 0:
                if not deferred:
                    request.write(txn, True)
            else:
                with request.store.begin_part(
                    request.step, attempt_id=attempt_ids[0], rank=group.rank, world_size=group.world_size
                ) as part:
                    request.write(part, False)
                entries = [entry.model_dump() for entry in part.entries]
        except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
            local_error = exc
        finally:
            if not deferred:
                request.finish_write_stage()
        parts = agree(group, entries, local_error, url=url, step=request.step)

        outcome = None
        if group.rank == 0:
            try:
                for rank_entries in parts[1:]:
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
            raise save_failure(url, request.step, {0: outcome[1]}) from local_error
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
    """Rank 0's deferred save (module docstring): its payloads, the manifest, the after-commit stage."""

    def finish(cancelled: threading.Event | None = None) -> str:
        try:
            with txn:  # commits on a clean exit; aborts (every rank's part) on an exception
                if cancelled is not None:
                    txn.cancel_when(cancelled)
                request.write(txn, True)
        finally:
            request.finish_write_stage()
        request.after.run(txn.committed_url)
        return txn.committed_url

    return finish


__all__ = ["Failure", "FinishCommit", "agree", "describe_failure", "failure_text", "run_save_collective",
           "save_failure"]
