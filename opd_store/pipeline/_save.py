"""One save, split in two: how it writes (:class:`SaveRequest`) and what it needs once committed
(:class:`AfterCommit`); the stages that run them with one writer (:func:`write_and_commit`,
:func:`run_save`). The stages, and where each mode runs them: ARCHITECTURE.md, "The save path".
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
class AfterCommit:
    """What a save needs once its step is committed: the after-commit stage, whoever committed it
    (one writer, rank 0 of a collective, DCP's coordinator).

    Attributes:
        store (BaseStore): where the step was committed (plain or tiered).
        step (int): the committed step.
        retention (RetentionPolicy | None): applied once the step is durable, or ``None``.
        lineage (RunLineage | None): the saving run (protects its resume parent from retention).
        on_commit (list[Callable[[AfterCommit, str], None]]): callbacks (events), called with this
            object and the committed URL after the retention hook.
    """

    store: BaseStore
    step: int
    retention: RetentionPolicy | None = None
    lineage: RunLineage | None = None
    on_commit: list[Callable[["AfterCommit", str], None]] = dataclasses.field(default_factory=list)

    def run(self, url: str) -> None:
        """The after-commit stage: the retention pass through :meth:`BaseStore.when_durable` (at
        once on a plain store, after the upload on a tiered one), then the callbacks.

        Raises:
            RetentionError: (plain store) the retention pass failed; the step stays committed (a
                tiered store raises it at its next save, ``flush`` or ``close``).
            Exception: whatever a callback raises.
        """
        if self.retention is not None and not self.retention.keeps_all:
            hook = retention_after_commit(self.retention, self.step, lineage=self.lineage, url=url)
            self.store.when_durable(self.step, hook)
        for callback in self.on_commit:
            callback(self, url)


@dataclasses.dataclass
class SaveRequest:
    """One save captured at one instant (the snapshot stage's output).

    Attributes:
        after (AfterCommit): the store, step and after-commit work.
        world_size (int): ranks writing it (recorded in the manifest).
        metadata (dict): the manifest metadata (JSON).
        write (WritePayloads): streams the payloads.
        release (Callable[[], None] | None): frees the snapshot's resources once the write stage ended.
    """

    after: AfterCommit
    world_size: int
    metadata: dict[str, Any]
    write: WritePayloads
    release: Callable[[], None] | None = None

    @property
    def store(self) -> BaseStore:
        """Where it goes (``after.store``)."""
        return self.after.store

    @property
    def step(self) -> int:
        """Its step (``after.step``)."""
        return self.after.step

    def finish_write_stage(self) -> None:
        """Release the snapshot's resources (idempotent)."""
        release, self.release = self.release, None
        if release is not None:
            release()


def write_and_commit(request: SaveRequest, *, cancelled: threading.Event | None = None,
                     before_commit: Callable[[], None] | None = None) -> str:
    """Open the attempt, stream every payload, commit (one writer).

    Args:
        request (SaveRequest): from the snapshot stage.
        cancelled (threading.Event | None): the exit-deadline event; once set, the attempt is abandoned.
        before_commit (Callable[[], None] | None): runs before the manifest create; raising aborts.

    Returns:
        str: the committed checkpoint's URL.

    Raises:
        CommitConflictError: (a ``FileExistsError``) the step is already committed.
        CommitError: (an ``OSError``) the commit failed; nothing is committed.
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


def run_save(request: SaveRequest, *, cancelled: threading.Event | None = None,
             before_commit: Callable[[], None] | None = None) -> str:
    """Write, commit and the after-commit stage in the calling thread.

    Returns:
        str: the committed checkpoint's URL.

    Raises:
        Exception: those of :func:`write_and_commit` and :meth:`AfterCommit.run`.
    """
    url = write_and_commit(request, cancelled=cancelled, before_commit=before_commit)
    request.after.run(url)
    return url


__all__ = ["AfterCommit", "SaveRequest", "WritePayloads", "run_save", "write_and_commit"]
