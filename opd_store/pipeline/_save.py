"""The one save sequence: snapshot, write parts under an attempt, commit, after-commit hooks.

Every save of opd_store runs these stages; the modes differ only in *where* each runs:

================  ====================  ==========================  ==================================
mode              snapshot              write parts + commit        after-commit hooks
================  ====================  ==========================  ==================================
synchronous       caller's thread       caller's thread             caller's thread (plain store)
asynchronous      caller's thread       the background worker       the background worker
multi-rank        every rank            every rank its part;        rank 0
                                        rank 0 commits
multi-rank,       every rank            every other rank its part;  the background worker (rank 0)
asynchronous                            rank 0 its own and the
                                        commit on the background
                                        worker
tiered            as the mode above     as the mode above, on the   the tier's upload worker, after
                                        local tier                  the upload (retention)
================  ====================  ==========================  ==================================

1. **Snapshot** (the caller's, e.g. :func:`opd_store.opd._snapshot.snapshot_opd_checkpoint`): check
   the rules, capture the RNG state first, then everything else; the result is a
   :class:`SaveRequest`. A save's retention policy is checked against the store here
   (:meth:`BaseStore.check_save_retention <opd_store.store._api.BaseStore.check_save_retention>`),
   before anything is written.
2. **Write parts under an attempt**: :meth:`BaseStore.begin` opens the attempt; one writer writes
   every payload (:func:`write_and_commit`), or each rank its own part under the committing rank's
   attempt (:func:`opd_store.pipeline._collective.write_and_commit_collective`).
3. **Commit**: the manifest, created only if absent (the transaction). On a tiered store the
   transaction's commit also queues the step's upload (the tier upload hook).
4. **After-commit hooks** (:func:`after_commit`): the retention pass, run through
   :meth:`BaseStore.when_durable <opd_store.store._api.BaseStore.when_durable>` so that it runs once
   the step is durable and against the durable store; then the request's ``on_commit`` callbacks
   (events). A hook failure reaches the caller at the next sync point: a synchronous save raises it
   (the step stays committed), an asynchronous one at ``result``/the next save/``close``, a tiered
   store at the next save/``flush``/``close``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from ..retention import RetentionPolicy, RunLineage, retention_after_commit
from ..store import BaseStore

logger = logging.getLogger("opd_store.pipeline")

WritePayloads = Callable[[Any, bool], None]
"""``write(txn, shared)``: stream a save's payloads into ``txn`` (a transaction or a rank's part);
``shared`` is True on the committing rank (payloads written once) and False elsewhere."""


@dataclasses.dataclass
class SaveRequest:
    """One save, captured at one instant: the output of the snapshot stage.

    Attributes:
        store (BaseStore): where it goes (plain or tiered).
        step (int): the step.
        world_size (int): ranks writing it (recorded in the manifest).
        metadata (dict): the manifest metadata (JSON).
        write (WritePayloads): streams the payloads.
        retention (RetentionPolicy | None): applied once the step is durable, or ``None``.
        lineage (RunLineage | None): the saving run (protects its resume parent).
        release (Callable[[], None] | None): frees what the snapshot holds (a staged adapter
            directory); called once the write stage ended, whatever happened.
        on_commit (list[Callable[[SaveRequest, str], None]]): after-commit callbacks (events),
            called with the committed URL after the retention hook.
    """

    store: BaseStore
    step: int
    world_size: int
    metadata: dict[str, Any]
    write: WritePayloads
    retention: RetentionPolicy | None = None
    lineage: RunLineage | None = None
    release: Callable[[], None] | None = None
    on_commit: list[Callable[["SaveRequest", str], None]] = dataclasses.field(default_factory=list)

    def finish_write_stage(self) -> None:
        """Release the snapshot's resources (idempotent)."""
        release, self.release = self.release, None
        if release is not None:
            release()


def write_and_commit(request: SaveRequest, *, cancelled: threading.Event | None = None,
                     before_commit: Callable[[], None] | None = None) -> str:
    """Stages 2 and 3 with one writer: open the attempt, stream every payload, commit.

    Args:
        request (SaveRequest): from the snapshot stage.
        cancelled (threading.Event | None): the background worker's exit-deadline event; once
            set, the attempt is abandoned uncommitted.
        before_commit (Callable[[], None] | None): called after the last payload, before the
            manifest create; an exception it raises aborts the save uncommitted.

    Returns:
        str: the committed checkpoint's URL.

    Raises:
        CommitConflictError: the step is already committed (``FileExistsError``).
        CommitError: the commit failed (an ``OSError``); nothing is committed.
        SaveAbandonedError: ``cancelled`` was set before the commit.
        OSError: a payload could not be written; nothing is committed.
    """
    try:
        with request.store.begin(request.step, world_size=request.world_size, metadata=request.metadata) as txn:
            if cancelled is not None:
                txn.cancel_when(cancelled)
            request.write(txn, True)
            if before_commit is not None:
                before_commit()
    finally:
        request.finish_write_stage()  # also when begin() refused the step
    logger.info("committed %s (step %d, world size %d)", txn.committed_url, request.step, request.world_size)
    return txn.committed_url


def after_commit(request: SaveRequest, url: str) -> None:
    """Stage 4: the after-commit hooks of a committed save (see the module docstring).

    Raises:
        RetentionError: (plain store) the retention pass failed; the step stays committed.
    """
    if request.retention is not None and not request.retention.keeps_all:
        hook = retention_after_commit(request.retention, request.step, lineage=request.lineage, url=url)
        request.store.when_durable(request.step, hook)
    for callback in request.on_commit:
        callback(request, url)


def run_save(request: SaveRequest, *, cancelled: threading.Event | None = None,
             before_commit: Callable[[], None] | None = None) -> str:
    """Stages 2 to 4 in the calling thread (a synchronous save, or the body of a background one).

    Returns:
        str: the committed checkpoint's URL.

    Raises:
        The errors of :func:`write_and_commit` and :func:`after_commit`.
    """
    url = write_and_commit(request, cancelled=cancelled, before_commit=before_commit)
    after_commit(request, url)
    return url


__all__ = ["SaveRequest", "WritePayloads", "after_commit", "run_save", "write_and_commit"]
