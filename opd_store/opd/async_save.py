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
* at interpreter exit an in-flight save is given ``exit_timeout_secs`` to commit; past that it
  is abandoned: the manifest is not created (the step stays uncommitted, invisible to readers)
  and one line on stderr says so. The hook runs as the interpreter starts to exit, while remote
  stores still work (:mod:`opd_store.exit_hooks`);
* the writer thread has ended before :meth:`~AsyncCheckpointer.close` returns and before the
  interpreter finalizes (:func:`_end_writer` says why a thread that touches torch must not
  outlive the exit hooks).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import torch

from .. import exit_hooks
from ..errors import BackgroundSaveError, SaveAbandonedError, SaveInFlightError
from ..thread_random import route_background_random
from .checkpoint import snapshot_opd_checkpoint, write_opd_checkpoint
from .distributed import current_group
from .rng import preserve_global_rng

logger = logging.getLogger("opd_store.opd.async_save")

DEFAULT_EXIT_TIMEOUT_SECS = 60.0
# After an abandoned save's deadline: how long the exit hook waits for its writer thread to end once
# SaveAbandonedError was raised in it. fsspec's sync() wakes a waiting writer every second, so a
# writer stuck on a remote request takes the exception within about a second.
END_WRITER_GRACE_SECS = 3.0
WHEN_BUSY = ("wait", "raise")


class StagingBuffers:
    """Copies of a state's tensors in reusable host buffers (the snapshot's copy).

    :meth:`stage` maps a state tree (dict, ``OrderedDict``, ``Counter``, list, tuple, set; as
    produced by :func:`~opd_store.opd.safe_load.sanitize_state`) to an equal tree whose tensors are
    private copies on the CPU. The n-th tensor staged since :meth:`begin` reuses the n-th buffer of
    the previous snapshot when dtype and shape match, so a steady-state save allocates nothing.
    Only reuse buffers after the write of the previous snapshot has finished (the checkpointer
    has at most one in flight).

    Args:
        pin_memory (bool | None): allocate pinned host memory for tensors that come from CUDA
            (``None``: when CUDA is available).
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._buffers: list[torch.Tensor] = []
        self._cursor = 0
        self._cuda_sources = False
        self.staged_bytes = 0

    def begin(self) -> None:
        """Start a new snapshot (rewind to the first buffer)."""
        self._cursor = 0
        self._cuda_sources = False
        self.staged_bytes = 0

    def finish(self) -> None:
        """Wait for the device-to-host copies of this snapshot (no-op without CUDA sources)."""
        if self._cuda_sources:
            torch.cuda.synchronize()
        del self._buffers[self._cursor:]

    def stage(self, value: Any) -> Any:
        """An equal tree with every tensor copied into a staging buffer (containers rebuilt)."""
        kind = type(value)
        if isinstance(value, torch.Tensor):
            return self._stage_tensor(value)
        if kind in (dict, collections.OrderedDict, collections.Counter):
            copy = kind()
            for key, item in value.items():
                copy[key] = self.stage(item)
            return copy
        if kind is list:
            return [self.stage(item) for item in value]
        if kind is tuple:
            return tuple(self.stage(item) for item in value)
        if kind is set:
            return {self.stage(item) for item in value}
        return value

    def _buffer(self, source: torch.Tensor) -> torch.Tensor:
        index = self._cursor
        self._cursor += 1
        pinned = self.pin_memory and source.is_cuda
        if index < len(self._buffers):
            buffer = self._buffers[index]
            if buffer.dtype == source.dtype and buffer.shape == source.shape and buffer.is_pinned() == pinned:
                return buffer
        buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer

    def _stage_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        if source.layout != torch.strided or source.device.type not in ("cpu", "cuda"):
            copy = source.to("cpu", copy=True)  # sparse or exotic: a plain private copy
        else:
            copy = self._buffer(source)
            copy.copy_(source, non_blocking=source.is_cuda)
            self._cuda_sources = self._cuda_sources or source.is_cuda
        self.staged_bytes += copy.numel() * copy.element_size()
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
        return copy


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


_live: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()  # not closed: reported at exit
_writers: dict[threading.Thread, SaveHandle] = {}  # writer threads not joined yet, with their saves
_writers_lock = threading.Lock()
_exit_hook_registered = False  # by the first checkpointer (see AsyncCheckpointer.__init__)


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
        self._thread: threading.Thread | None = None  # the writer of self._pending
        self._abandon = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        _live.add(self)
        global _exit_hook_registered
        with _writers_lock:
            if not _exit_hook_registered:
                # Registered when the first checkpointer is made, not at import: exit hooks run
                # last-registered first, so saves into a TieredStore made before it finish before
                # that store's exit hook closes it.
                exit_hooks.register(_finish_in_flight_saves)
                _exit_hook_registered = True

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
            self._join_finished_writer()  # its staging buffers are reused below
            started = time.perf_counter()
            self._staging.begin()
            with preserve_global_rng():
                snapshot = snapshot_opd_checkpoint(**save_kwargs, stage=self._staging.stage)
            self._staging.finish()
            handle = SaveHandle(snapshot.step, time.perf_counter() - started, self._staging.staged_bytes)
            self._pending = handle
            self._thread = threading.Thread(
                target=self._write, args=(snapshot, handle), name=f"opd-async-save-{snapshot.step:06d}", daemon=True
            )
            with _writers_lock:
                _writers[self._thread] = handle
            self._thread.start()
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
        """Wait for the save in flight and for its writer thread to end, then refuse further saves.

        Args:
            timeout_secs (float | None): seconds to wait; past that the save is abandoned
                uncommitted (it may still commit if it is inside the manifest create), and the
                exit hook ends its writer thread (see :func:`_end_writer`).

        Returns:
            str | None: the last save's committed URL, or ``None`` when none committed.

        Raises:
            TimeoutError: the save is still in flight after ``timeout_secs``.
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
            finally:
                self._join_finished_writer()
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

    def _join_finished_writer(self) -> None:
        """Join the writer thread once its save has finished (a no-op while it is in flight).

        After the handle's result is set the thread still drops its snapshot, which frees tensors
        (see :func:`_end_writer`); that takes milliseconds and never blocks on I/O."""
        thread, pending = self._thread, self._pending
        if thread is not None and pending is not None and pending.done():
            thread.join()
            with _writers_lock:
                _writers.pop(thread, None)

    def _finish_at_exit(self) -> None:
        """At exit: give the save in flight ``exit_timeout_secs`` to commit, else abandon it."""
        pending = self._pending
        if self._closed or pending is None:
            return
        self._closed = True
        self._report_at_exit(pending)

    def _report_at_exit(self, pending: SaveHandle) -> None:
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


def _end_writer(thread: threading.Thread, handle: SaveHandle) -> None:
    """At exit: make sure a writer thread has ended before the interpreter finalizes.

    Why: once ``Py_FinalizeEx`` has run the exit hooks, a daemon thread that takes the GIL is ended
    with ``pthread_exit`` (CPython <= 3.13, ``take_gil``; the C-API docs of
    ``PyEval_RestoreThread``: "calling this function from a thread when the runtime is finalizing
    will terminate the thread"). ``pthread_exit`` unwinds the thread's stack; when the GIL was
    re-taken inside torch's C++ (the destructor of the ``pybind11::gil_scoped_release`` with which
    ``THPVariable_clear``, torch/csrc/autograd/python_variable.cpp, frees every tensor, or the
    ones around the storage writes of ``torch.save``), the unwinding meets a ``noexcept`` frame and
    C++ calls ``std::terminate``: "terminate called without an active exception", SIGABRT (exit
    status -6), after the save had committed. The writer thread frees its snapshot (the staged
    tensors) when it returns, that is after it set the handle's result and the exit hook stopped
    waiting for it.

    So a finished writer is joined. A writer still in flight (the exit deadline passed, or
    ``close(timeout_secs)`` timed out) gets :class:`~opd_store.errors.SaveAbandonedError` raised in
    it at its next Python instruction (``PyThreadState_SetAsyncExc``; a writer waiting on a remote
    request runs one every second in fsspec's ``sync``), so it leaves torch's frames through the
    ordinary failure path (the payload is discarded, nothing is committed) while the interpreter
    is whole, and it is given :data:`END_WRITER_GRACE_SECS` to end. A writer blocked where no
    Python runs (a lock that is never released) stays blocked and never takes the GIL again.
    """
    if not thread.is_alive():
        return
    if not handle.done() and thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SaveAbandonedError))
    thread.join(END_WRITER_GRACE_SECS)


def _finish_in_flight_saves() -> None:
    """The exit hook (:mod:`opd_store.exit_hooks`): report every open checkpointer's last save
    (waiting up to its ``exit_timeout_secs``), then end every writer thread (:func:`_end_writer`)."""
    for checkpointer in list(_live):
        checkpointer._finish_at_exit()  # noqa: SLF001
    with _writers_lock:
        writers = list(_writers.items())
        _writers.clear()
    for thread, handle in writers:
        _end_writer(thread, handle)


__all__ = ["AsyncCheckpointer", "SaveHandle", "StagingBuffers"]
