"""Asynchronous OPD saves: the snapshot on the caller's thread, the rest in the background
(ARCHITECTURE.md, "The save path"; usage and guarantees: docs/spot.md).

Tensors are copied into reused :class:`~opd_store.opd._staging.StagingBuffers` (pinned when on
CUDA); :class:`opd_store.pipeline.BackgroundSaves` owns the rest (one save in flight, failures at
the next sync point, the exit deadline).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..errors import BackgroundSaveError
from ..pipeline import WHEN_BUSY, BackgroundSaves, BackgroundTask, run_save
from ._distributed import current_group
from ._rng import preserve_global_rng
from ._save import save_request
from ._snapshot import snapshot_opd_checkpoint
from ._staging import StagingBuffers

logger = logging.getLogger("opd_store.opd")

DEFAULT_EXIT_TIMEOUT_SECS = 60.0


class SaveHandle:
    """One asynchronous save: its step, state and result.

    Attributes:
        step (int): the checkpoint's step (``successful_updates``).
        blocked_secs (float): seconds the caller was blocked by the snapshot (wall clock).
        staged_bytes (int): bytes of tensors copied by the snapshot.
    """

    def __init__(self, step: int, blocked_secs: float, staged_bytes: int, task: BackgroundTask) -> None:
        self.step = step
        self.blocked_secs = blocked_secs
        self.staged_bytes = staged_bytes
        self.task = task

    def done(self) -> bool:
        """Whether the save has finished (committed, failed or abandoned)."""
        return self.task.done()

    @property
    def url(self) -> str | None:
        """The committed checkpoint's URL, or ``None`` while in flight or when it failed."""
        return self.task.value

    def result(self, timeout_secs: float | None = None) -> str:
        """Wait for the commit; return the checkpoint's URL.

        Args:
            timeout_secs (float | None): seconds to wait; ``None`` waits until it finishes.

        Raises:
            TimeoutError: still in flight after ``timeout_secs``.
            Exception: the background failure itself (``CommitConflictError``, ``CommitError``, a backend
                ``OSError``, ``SaveAbandonedError``, or ``RetentionError`` after a commit); it then
                counts as reported.
        """
        if not self.task.wait(timeout_secs):
            raise TimeoutError(f"asynchronous save of step {self.step} still in flight after {timeout_secs} s")
        return self.task.result()


class AsyncCheckpointer:
    """Saves OPD checkpoints asynchronously, at most one in flight; one per training process, used
    from the training thread (a ``with`` block's exit waits for the last save and raises its failure).

    Args:
        when_busy (str): ``"wait"`` (default) for a save in flight, or ``"raise"``
            ``SaveInFlightError``.
        exit_timeout_secs (float): at interpreter exit, seconds an in-flight save gets before it is
            abandoned (default 60; keep it below the platform's notice: AWS 120 s, GCE 30 s).
        pin_memory (bool | None): stage CUDA tensors in pinned memory (``None``: when CUDA is available).

    Raises:
        ValueError: ``when_busy`` is not ``"wait"``/``"raise"``, or ``exit_timeout_secs`` < 0.
    """

    def __init__(
        self,
        *,
        when_busy: str = "wait",
        exit_timeout_secs: float = DEFAULT_EXIT_TIMEOUT_SECS,
        pin_memory: bool | None = None,
    ) -> None:
        if when_busy not in WHEN_BUSY:
            raise ValueError(f"when_busy must be one of {WHEN_BUSY}, got {when_busy!r}")
        self.when_busy = when_busy
        self.saves = BackgroundSaves(f"opd-async-save-{id(self):x}", exit_timeout_secs=exit_timeout_secs)
        self.exit_timeout_secs = self.saves.exit_timeout_secs
        self._staging = StagingBuffers(pin_memory)
        self._pending: SaveHandle | None = None
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> SaveHandle | None:
        """The save in flight, or ``None``."""
        pending = self._pending
        return pending if pending is not None and not pending.done() else None

    def save(self, **save_kwargs: Any) -> SaveHandle:
        """Snapshot the state now and run the rest of the save in the background.

        Takes :func:`~opd_store.opd._save.save_opd_checkpoint`'s keyword arguments (its rules;
        single-writer: rank 0 only). Once it returns, training may change anything, RNGs included, without
        changing what is saved; every global RNG is left as found.

        Returns:
            SaveHandle: ``result(timeout_secs)``, ``done()``, ``url``.

        Raises:
            SaveInFlightError: a save is in flight and ``when_busy="raise"``.
            BackgroundSaveError: (an ``OSError``) the previous save failed unreported (``__cause__``);
                this save is not started.
            ValueError: a rule is broken (nothing written; ``UnsafeCheckpointError`` for unloadable
                state), or several ranks and no ``rank_rng_states``.
            RuntimeError: the checkpointer is closed.
        """
        with self._lock:
            if self.saves.closed:
                raise RuntimeError("AsyncCheckpointer is closed")
            if save_kwargs.get("rank_rng_states") is None and current_group() is not None:
                raise ValueError(
                    "AsyncCheckpointer saves from one writer: with a torch.distributed process group of "
                    "several ranks use save_opd_checkpoint on every rank (multi-rank saves), or pass "
                    "rank_rng_states on rank 0 (single-writer mode)"
                )
            self.saves.sync("the next save", when_busy=self.when_busy)
            started = time.perf_counter()
            self._staging.begin()
            with preserve_global_rng():
                snapshot = snapshot_opd_checkpoint(**save_kwargs, stage=self._staging.stage)
            self._staging.finish()
            request = save_request(snapshot)
            task = self.saves.submit(f"asynchronous save of step {snapshot.step}", snapshot.step,
                                     lambda: run_save(request, cancelled=self.saves.cancelled))
            handle = SaveHandle(snapshot.step, time.perf_counter() - started, self._staging.staged_bytes, task)
            self._pending = handle
            return handle

    def wait(self, timeout_secs: float | None = None) -> str | None:
        """Wait for the save in flight (if any) and return the last save's committed URL.

        Raises:
            TimeoutError: still in flight after ``timeout_secs``.
            BackgroundSaveError: the last save failed and the failure was not reported yet.
        """
        with self._lock:
            self.saves.sync("wait()", timeout_secs=timeout_secs)
            return None if self._pending is None else self._pending.url

    def close(self, timeout_secs: float | None = None) -> str | None:
        """Wait for the save in flight, then refuse further saves and stop the worker.

        Args:
            timeout_secs (float | None): past that the save is abandoned uncommitted (it may still commit
                if inside the manifest create).

        Returns:
            str | None: the last save's committed URL, or ``None`` when none committed.

        Raises:
            TimeoutError: still in flight after ``timeout_secs`` (abandoned).
            BackgroundSaveError: the last save failed (or was abandoned), unreported.
        """
        with self._lock:
            if self.saves.closed:
                return None
            self.saves.close(timeout_secs)
            return None if self._pending is None else self._pending.url

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except BackgroundSaveError as failure:
                logger.error("%s (while handling %r)", failure, exc)


__all__ = ["AsyncCheckpointer", "SaveHandle", "StagingBuffers"]
