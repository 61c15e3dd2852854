"""The one background worker: one thread under every owner of background saves.

A :class:`BackgroundWorker` runs tasks in order with: failures kept for the owner's next sync
point (:meth:`BackgroundWorker.take_unreported`), never only logged; Python ``random`` draws of the
worker and fsspec's I/O thread routed to a private generator
(:func:`~opd_store.runtime.route_background_random`: botocore and gcsfs retry back-offs must not
move the training's stream); a task's snapshot freed on this thread; and an exit sequence (wait,
cancel, stop and join, report) run by :func:`finish_all_at_exit` in ascending exit stage. Why
threads are joined and the sequence's steps: docs/spot.md, "Exit deadline" and "Why the worker
thread is joined at exit".
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import sys
import threading
import time
import weakref
from typing import Any, Callable

from ..errors import SaveAbandonedError
from ..runtime import check_secs, register_exit_hook, route_background_random
from ._task import BackgroundTask

logger = logging.getLogger("opd_store.pipeline")

ExitReport = Callable[[str, list["BackgroundTask"]], None]
"""``on_exit(event, tasks)``: ``event`` is ``waiting``, ``abandoned`` or ``finished``."""

EXIT_STAGE_SAVES = 0
"""Exit stage of workers that run saves (a save may queue a tier upload when it commits)."""
EXIT_STAGE_UPLOADS = 1
"""Exit stage of workers that upload committed steps: finished after every save worker."""


class _StoppedAtExit(SaveAbandonedError):
    """Raised in a worker thread whose task overran the exit deadline (see the module docstring)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("stopped by the exit sequence: the exit deadline passed; nothing more is "
                                    "committed by this task",)))


_live: "weakref.WeakSet[BackgroundWorker]" = weakref.WeakSet()  # threads not known to have ended
_created = itertools.count()  # creation order, for the exit routine
_exit_hook = threading.Lock()
_exit_hook_registered = False


def _register_exit_routine() -> None:
    """Register :func:`finish_all_at_exit` once (see the module docstring)."""
    global _exit_hook_registered
    with _exit_hook:
        if not _exit_hook_registered:
            register_exit_hook(finish_all_at_exit)
            _exit_hook_registered = True


class BackgroundWorker:
    """One thread running submitted tasks in order.

    Args:
        name (str): the thread's name.
        exit_timeout_secs (float): at interpreter exit, seconds tasks get before they are abandoned.
        exit_join_secs (float | None): seconds the thread then gets to stop (default: the deadline
            again, at most 10 s).
        on_exit (ExitReport | None): reports the exit sequence's steps.
        exit_stage (int): exit order; a worker whose tasks submit to another needs a lower stage.

    Raises:
        ValueError: a negative, NaN or infinite ``exit_timeout_secs`` (TypeError: not a number).
    """

    def __init__(self, name: str, *, exit_timeout_secs: float, exit_join_secs: float | None = None,
                 on_exit: ExitReport | None = None, exit_stage: int = EXIT_STAGE_SAVES) -> None:
        self.name = name
        self.exit_timeout_secs = check_secs(exit_timeout_secs, "exit_timeout_secs")
        self.exit_join_secs = min(10.0, max(1.0, self.exit_timeout_secs)) if exit_join_secs is None else exit_join_secs
        self.on_exit = on_exit
        self.exit_order = (exit_stage, next(_created))
        self.cancelled = threading.Event()
        self._cond = threading.Condition()
        self._queue: collections.deque[BackgroundTask] = collections.deque()
        self._running: BackgroundTask | None = None
        self._failed: list[BackgroundTask] = []  # finished with a failure, maybe not reported yet
        self._thread: threading.Thread | None = None
        self._closed = False
        self._exited = False  # the exit sequence ran
        _live.add(self)

    # -- submitting --------------------------------------------------------------------------
    def submit(self, label: str, key: Any, run: Callable[[], Any]) -> BackgroundTask:
        """Queue ``run()`` (on the worker thread, with ``random`` routed away from the caller).

        Raises:
            ValueError: the worker is closed.
        """
        task = BackgroundTask(label, key, run)
        with self._cond:
            if self._closed:
                raise ValueError(f"background worker {self.name} is closed")
            self._queue.append(task)
            if self._thread is None or not self._thread.is_alive():
                _register_exit_routine()
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
                _live.add(self)
            self._cond.notify_all()
        return task

    def _loop(self) -> None:
        try:
            while self._run_next():
                pass
        except _StoppedAtExit:
            # Raised into this thread by the exit sequence just as its task ended (outside the
            # task's own handler): the worker is stopping; finish_at_exit settles what is left.
            pass

    def _run_next(self) -> bool:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return False
            task = self._queue.popleft()
            self._running = task
        if self.cancelled.is_set():
            task.abandon("the exit deadline passed")
        else:
            with route_background_random():
                task.execute()
        with self._cond:
            self._running = None
            if task.failure() is not None:
                self._failed.append(task)
            self._cond.notify_all()
        return True

    # -- state ---------------------------------------------------------------------------------
    def pending(self) -> list[BackgroundTask]:
        """Tasks running or queued, in order."""
        with self._cond:
            return ([self._running] if self._running is not None else []) + list(self._queue)

    def wait_until(self, condition: Callable[[], bool], timeout_secs: float | None = None) -> bool:
        """Wait until ``condition()`` holds, re-checked each time a task finishes; False on timeout.
        ``condition`` runs with the worker's lock held, so it must not block or call back in."""
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        with self._cond:
            while not condition():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def idle(self) -> bool:
        """True when nothing is queued or running (call with or without the lock)."""
        return not self._queue and self._running is None

    def wait_idle(self, timeout_secs: float | None = None) -> None:
        """Block until nothing is queued or running.

        Raises:
            TimeoutError: tasks still pending after ``timeout_secs`` (named).
        """
        if not self.wait_until(self.idle, timeout_secs):
            raise TimeoutError(f"{', '.join(t.label for t in self.pending())} still running after {timeout_secs} s")

    def take_unreported(self) -> list[BackgroundTask]:
        """Finished tasks that failed and whose failure no caller saw yet, oldest first; each is
        marked reported (the caller raises them now)."""
        with self._cond:
            failed = [task for task in self._failed if not task.reported]
            self._failed = []
        for task in failed:
            task.mark_reported()
        return failed

    # -- stopping --------------------------------------------------------------------------------
    def close(self, timeout_secs: float | None = None) -> None:
        """Wait for queued tasks, then stop and join the thread; new tasks are refused. Safe twice.

        Raises:
            TimeoutError: tasks still pending after ``timeout_secs``; the thread stops once they finish,
                or the exit sequence joins it.
        """
        try:
            self.wait_idle(timeout_secs)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
                thread = self._thread
            if thread is not None and thread is not threading.current_thread() and self.idle():
                thread.join()  # idle and told to stop: it returns at once
            if thread is None or not thread.is_alive():
                _live.discard(self)

    def finish_at_exit(self) -> None:
        """The exit sequence (module docstring): wait, cancel, stop and join, report. Runs once."""
        with self._cond:
            if self._exited or (self._closed and (self._thread is None or not self._thread.is_alive())):
                self._exited = True
                return
            self._exited = self._closed = True
            tasks = ([self._running] if self._running is not None else []) + list(self._queue)
            self._cond.notify_all()
        if tasks and self.on_exit is not None:
            self.on_exit("waiting", tasks)
        if not self.wait_until(self.idle, self.exit_timeout_secs):
            unfinished = [task for task in tasks if not task.done()]
            self.cancelled.set()
            if self.on_exit is not None:
                self.on_exit("abandoned", unfinished)
        self._stop_thread()
        if self.on_exit is not None:
            self.on_exit("finished", tasks)

    def _stop_thread(self) -> None:
        """Step 4 of the exit sequence: join the thread, raising :class:`_StoppedAtExit` in a task
        that ignores the cancellation."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._cond.notify_all()
        thread.join(self.exit_join_secs / 2 if self.cancelled.is_set() else self.exit_join_secs)
        if thread.is_alive() and self.cancelled.is_set():
            # Under the lock: the thread cannot leave _loop meanwhile, so the exception lands in the
            # task (its failure) or in _loop's handler, never in threading's own code.
            with self._cond:
                if self._running is not None and not self._running.done() and thread.ident is not None:
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                               ctypes.py_object(_StoppedAtExit))
            thread.join(self.exit_join_secs / 2)
        if thread.is_alive():
            print(f"opd_store: background thread {thread.name} is still inside a backend call at exit; "
                  "its step stays uncommitted", file=sys.stderr, flush=True)
            return
        _live.discard(self)
        with self._cond:  # the thread ended: settle what a stray stop left behind
            left = ([self._running] if self._running is not None else []) + list(self._queue)
            self._running = None
            self._queue.clear()
            self._cond.notify_all()
        for task in left:
            task.settle(_StoppedAtExit())


def finish_all_at_exit() -> None:
    """The one exit routine: every live worker's exit sequence in exit order (one made meanwhile
    too); errors go to stderr, nobody is left to raise to.
    """
    finished: set[BackgroundWorker] = set()
    while True:
        workers = sorted((w for w in list(_live) if w not in finished), key=lambda w: w.exit_order)
        if not workers:
            return
        worker = workers[0]
        finished.add(worker)
        try:
            worker.finish_at_exit()
        except Exception as exc:  # noqa: BLE001 - nobody is left to raise to at exit
            print(f"opd_store: at exit, background worker {worker.name}: {exc!r}", file=sys.stderr, flush=True)


__all__ = ["EXIT_STAGE_SAVES", "EXIT_STAGE_UPLOADS", "BackgroundTask", "BackgroundWorker", "ExitReport",
           "finish_all_at_exit"]
