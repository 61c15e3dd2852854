"""Asynchronous OPD saves: snapshot now, serialise, upload and commit in the background (issue 8, item 1).

:class:`AsyncCheckpointer.save` takes the arguments of
:func:`~opd_store.opd.checkpoint.save_opd_checkpoint` and splits the save in two:

1. **Snapshot** (on the caller's thread, inside :func:`~opd_store.opd.rng.preserve_global_rng`):
   the seed's rules are checked, this process's RNG state, the trainer, optimizer, scheduler and
   teacher states and the adapter's trainable tensors are captured and every tensor is copied into
   a staging buffer (CPU; pinned host memory when the source is on CUDA, followed by one stream
   synchronisation). Buffers are kept and reused by the next save of the same shapes, so a
   steady-state snapshot is one ``copy_`` per tensor and no allocation. When it returns, training
   may change anything: parameters, optimizer state, RNG.
2. **Write** (on a daemon thread): :func:`~opd_store.opd.checkpoint.write_opd_checkpoint` streams the
   payloads and creates the manifest, with background ``random`` draws routed away from the
   caller's generator (:mod:`opd_store.thread_random`).

Guarantees:

* at most one save in flight per checkpointer: a new save waits for the previous one
  (``when_busy="wait"``) or raises :class:`~opd_store.errors.SaveInFlightError` (``"raise"``);
* a failure in the background is raised by :meth:`SaveHandle.result`, else by the next
  :meth:`AsyncCheckpointer.save`, :meth:`~AsyncCheckpointer.wait` or
  :meth:`~AsyncCheckpointer.close` (as :class:`~opd_store.errors.BackgroundSaveError`), once;
  it is never only logged (issue 5, scenario 15);
* at interpreter exit (``atexit``) an in-flight save is given ``exit_timeout_secs`` to commit;
  past that it is abandoned: the manifest is not created (the step stays uncommitted, invisible
  to readers) and one line on stderr says so.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any


from ..errors import BackgroundSaveError, SaveAbandonedError, SaveInFlightError
from ..thread_random import route_background_random
from .checkpoint import snapshot_opd_checkpoint, write_opd_checkpoint
from .distributed import current_group
from .rng import preserve_global_rng
from .staging import StagingBuffers

logger = logging.getLogger("opd_store.opd.async_save")

DEFAULT_EXIT_TIMEOUT_SECS = 60.0
WHEN_BUSY = ("wait", "raise")


class SaveHandle:
    """One asynchronous save: its step, state and result.

    Attributes:
        step (int): the checkpoint's step (``successful_updates``).
        blocked_secs (float): seconds the caller was blocked by the snapshot (wall clock).
        staged_bytes (int): bytes of tensors copied by the snapshot.
    """

    def __init__(self, step: int, blocked_secs: float, staged_bytes: int) -> None:
        self.step = step
        self.blocked_secs = blocked_secs
        self.staged_bytes = staged_bytes
        self._future: Future[str] = Future()
        self._delivered = False

    def done(self) -> bool:
        """Whether the save has finished (committed, failed or abandoned)."""
        return self._future.done()

    @property
    def url(self) -> str | None:
        """The committed checkpoint's URL, or ``None`` while in flight or when it failed."""
        if not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()

    def result(self, timeout_secs: float | None = None) -> str:
        """Wait for the commit; return the checkpoint's URL (as ``save_opd_checkpoint`` does).

        Args:
            timeout_secs (float | None): seconds to wait; ``None`` waits until it finishes.

        Raises:
            TimeoutError: still in flight after ``timeout_secs``.
            Exception: the background failure itself (the exception ``write_opd_checkpoint``
                raised: ``CommitConflictError``, ``CommitError``, an ``OSError`` of the backend,
                or :class:`~opd_store.errors.SaveAbandonedError`); it counts as reported, so
                the next save does not raise it again.
        """
        try:
            url = self._future.result(timeout=timeout_secs)
        except FutureTimeoutError as exc:
            raise TimeoutError(f"asynchronous save of step {self.step} still in flight after {timeout_secs} s") from exc
        except BaseException:
            self._delivered = True
            raise
        return url

    def _undelivered_failure(self) -> BaseException | None:
        if not self._future.done() or self._delivered:
            return None
        return self._future.exception()


_live: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


class AsyncCheckpointer:
    """Saves OPD checkpoints asynchronously, at most one in flight (issue 8, item 1).

    Use one per training process, from the training thread::

        with AsyncCheckpointer() as checkpointer:
            for ...:
                train_one_update()
                handle = checkpointer.save(checkpoints_dir=..., model=..., ...)   # returns after the snapshot
            # close() waits for the last save and raises its failure

    Args:
        when_busy (str): what :meth:`save` does while a save is in flight: ``"wait"`` (default)
            for it to finish, or ``"raise"`` :class:`~opd_store.errors.SaveInFlightError`.
        exit_timeout_secs (float): at interpreter exit, seconds an in-flight save is given to
            commit before it is abandoned uncommitted (default 60; AWS gives 120 s of spot notice,
            GCE 30 s, so set it below what the platform leaves).
        pin_memory (bool | None): stage CUDA tensors in pinned host memory (``None``: when CUDA
            is available).

    Raises:
        ValueError: ``when_busy`` is not one of ``"wait"``, ``"raise"``, or ``exit_timeout_secs``
            is negative.
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
        if exit_timeout_secs < 0:
            raise ValueError(f"exit_timeout_secs must be >= 0, got {exit_timeout_secs!r}")
        self.when_busy = when_busy
        self.exit_timeout_secs = float(exit_timeout_secs)
        self._staging = StagingBuffers(pin_memory)
        self._pending: SaveHandle | None = None
        self._abandon = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        _live.add(self)

    @property
    def in_flight(self) -> SaveHandle | None:
        """The save in flight, or ``None``."""
        pending = self._pending
        return pending if pending is not None and not pending.done() else None

    def save(self, **save_kwargs: Any) -> SaveHandle:
        """Snapshot the state now and write it in the background.

        Takes exactly the keyword arguments of
        :func:`~opd_store.opd.checkpoint.save_opd_checkpoint` (same rules, same rank obligations:
        rank 0 only, in single-writer mode). Returns once the snapshot is taken: tensors are
        copied to host buffers and every other value captured, so training may change the model,
        optimizer, scheduler, states and RNGs at once without changing what is saved. Every
        global RNG is left as found (snapshot under ``preserve_global_rng``; background draws
        routed away from the caller's thread).

        Returns:
            SaveHandle: ``result(timeout_secs)``, ``done()``, ``url``.

        Raises:
            SaveInFlightError: a save is in flight and ``when_busy="raise"``.
            BackgroundSaveError: (an ``OSError``) the previous save failed and nobody saw it yet
                (its exception is the ``__cause__``); this save is not started.
            ValueError: a rule of ``save_opd_checkpoint`` is broken (checked now, nothing written),
                or a process group of several ranks is initialised and no ``rank_rng_states`` are
                given (asynchronous saves are single-writer);
                ``UnsafeCheckpointError`` for state weights-only loading cannot restore.
            RuntimeError: the checkpointer is closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncCheckpointer is closed")
            if save_kwargs.get("rank_rng_states") is None and current_group() is not None:
                raise ValueError(
                    "AsyncCheckpointer saves from one writer: with a torch.distributed process group of "
                    "several ranks use save_opd_checkpoint on every rank (issue 7), or pass rank_rng_states "
                    "on rank 0 (single-writer mode)"
                )
            self._wait_for_pending(for_what="a new save")
            started = time.perf_counter()
            self._staging.begin()
            with preserve_global_rng():
                snapshot = snapshot_opd_checkpoint(**save_kwargs, stage=self._staging.stage)
            self._staging.finish()
            handle = SaveHandle(snapshot.step, time.perf_counter() - started, self._staging.staged_bytes)
            self._pending = handle
            thread = threading.Thread(
                target=self._write, args=(snapshot, handle), name=f"opd-async-save-{snapshot.step:06d}", daemon=True
            )
            thread.start()
            return handle

    def _write(self, snapshot: Any, handle: SaveHandle) -> None:
        try:
            with route_background_random():
                url = write_opd_checkpoint(snapshot, before_commit=lambda: self._check_abandoned(snapshot))
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the caller through the handle
            logger.info("asynchronous save of step %d failed: %r", snapshot.step, exc)
            handle._future.set_exception(exc)  # noqa: SLF001
        else:
            handle._future.set_result(url)  # noqa: SLF001

    def _check_abandoned(self, snapshot: Any) -> None:
        if self._abandon.is_set():
            raise SaveAbandonedError(
                f"asynchronous save of step {snapshot.step} to {snapshot.store.url} abandoned before its "
                "commit (exit deadline passed); the step stays uncommitted"
            )

    def _wait_for_pending(self, *, for_what: str, timeout_secs: float | None = None) -> SaveHandle | None:
        pending = self._pending
        if pending is None:
            return None
        if not pending.done():
            if self.when_busy == "raise" and for_what == "a new save":
                raise SaveInFlightError(
                    f"the asynchronous save of step {pending.step} is still in flight; wait for it "
                    "(handle.result()) before saving again, or use when_busy='wait'"
                )
            try:
                pending._future.exception(timeout=timeout_secs)  # noqa: SLF001 - waits, raises nothing
            except FutureTimeoutError as exc:
                raise TimeoutError(
                    f"asynchronous save of step {pending.step} still in flight after {timeout_secs} s"
                ) from exc
        failure = pending._undelivered_failure()  # noqa: SLF001
        if failure is not None:
            pending._delivered = True  # noqa: SLF001
            raise BackgroundSaveError(
                f"the asynchronous save of step {pending.step} failed in the background (reported at "
                f"{for_what}): {type(failure).__name__}: {failure}"
            ) from failure
        return pending

    def wait(self, timeout_secs: float | None = None) -> str | None:
        """Wait for the save in flight (if any) and return the last save's committed URL.

        Raises:
            TimeoutError: still in flight after ``timeout_secs``.
            BackgroundSaveError: the last save failed and the failure was not reported yet.
        """
        with self._lock:
            pending = self._wait_for_pending(for_what="wait()", timeout_secs=timeout_secs)
        return None if pending is None else pending.url

    def close(self, timeout_secs: float | None = None) -> str | None:
        """Wait for the save in flight, then refuse further saves.

        Args:
            timeout_secs (float | None): seconds to wait; past that the save is abandoned
                uncommitted (it may still commit if it is inside the manifest create).

        Returns:
            str | None: the last save's committed URL, or ``None`` when none committed.

        Raises:
            BackgroundSaveError: the last save failed (or was abandoned) and the failure was not
                reported yet.
        """
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            _live.discard(self)
            try:
                pending = self._wait_for_pending(for_what="close()", timeout_secs=timeout_secs)
            except TimeoutError:
                self._abandon.set()
                raise
        return None if pending is None else pending.url

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

    def _finish_at_exit(self) -> None:
        """atexit: give the save in flight ``exit_timeout_secs`` to commit, else abandon it."""
        pending = self._pending
        if self._closed or pending is None:
            return
        self._closed = True
        if not pending.done():
            print(
                f"opd_store: waiting up to {self.exit_timeout_secs:g} s for the asynchronous save of step "
                f"{pending.step} to commit",
                file=sys.stderr,
                flush=True,
            )
        try:
            pending._future.exception(timeout=self.exit_timeout_secs)  # noqa: SLF001
        except FutureTimeoutError:
            self._abandon.set()
            print(
                f"opd_store: abandoned the asynchronous save of step {pending.step} after "
                f"{self.exit_timeout_secs:g} s; it stays uncommitted",
                file=sys.stderr,
                flush=True,
            )
            return
        failure = pending._undelivered_failure()  # noqa: SLF001
        if failure is not None:
            print(
                f"opd_store: the asynchronous save of step {pending.step} failed: {type(failure).__name__}: {failure}",
                file=sys.stderr,
                flush=True,
            )
        elif pending.url is not None:
            print(f"opd_store: asynchronous save of step {pending.step} committed: {pending.url}", file=sys.stderr,
                  flush=True)


@atexit.register
def _finish_in_flight_saves() -> None:
    for checkpointer in list(_live):
        checkpointer._finish_at_exit()  # noqa: SLF001


__all__ = ["AsyncCheckpointer", "SaveHandle", "StagingBuffers"]
