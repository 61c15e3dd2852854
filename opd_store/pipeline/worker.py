"""The one background worker: asynchronous saves and tier uploads run on it.

A :class:`BackgroundWorker` owns one thread that runs submitted tasks in order. It gives every
background stage of a save the same three guarantees:

* **Deferred failure.** A task's exception is kept in its :class:`BackgroundTask`; the owner raises
  it at its next sync point (the next save, ``flush``, ``close``, ``result``) through
  :meth:`BackgroundWorker.take_unreported`, once. It is never only logged.
* **RNG isolation.** Each task runs inside :func:`~opd_store.thread_random.route_background_random`:
  the worker's and fsspec's I/O thread's draws from Python's ``random`` (botocore and gcsfs retry
  back-offs) go to a private generator, so the training thread's stream is the one it would have
  had without the save (exact resume).
* **Exit deadline.** At interpreter exit the worker runs its exit sequence (:meth:`finish_at_exit`).

Exit sequence (what happens at ``atexit``, in order):

1. New tasks are refused.
2. If tasks are queued or running, the owner's ``on_exit("waiting", tasks)`` is called and the
   worker waits up to ``exit_timeout_secs`` for all of them.
3. If they are not done by then, :attr:`BackgroundWorker.cancelled` is set: tasks not started are
   dropped (abandoned) and the running one stops at its next payload write or before its commit
   (transactions and copies watch that event), leaving its step uncommitted; the owner's
   ``on_exit("abandoned", tasks)`` is called.
4. The thread is told to stop and is joined, for at most ``exit_join_secs`` more: a task blocked
   inside a backend call cannot be interrupted from Python, so a thread still alive after that is
   reported on stderr (and left to the interpreter). In every other case no worker thread is left
   running when the interpreter finalises.
5. The owner's ``on_exit("finished", tasks)`` reports what committed or failed (``tasks`` may be
   empty: the owner may report a task that finished before exit).

The thread is a daemon: the interpreter joins non-daemon threads *before* ``atexit`` handlers run,
so an idle non-daemon worker would keep the process alive forever. The ``atexit`` hook is
re-registered each time a worker thread starts, so it runs before the ``atexit`` handlers of
libraries imported earlier (``atexit`` runs last-registered first) while the backends still work.
"""

from __future__ import annotations

import atexit
import collections
import logging
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Callable

from ..errors import SaveAbandonedError
from ..thread_random import route_background_random

logger = logging.getLogger("opd_store.pipeline.worker")

ExitReport = Callable[[str, list["BackgroundTask"]], None]
"""``on_exit(event, tasks)``: ``event`` is ``waiting``, ``abandoned`` or ``finished``."""


class BackgroundTask:
    """One unit of background work and its outcome.

    Attributes:
        label (str): what it is, for messages (``"upload of step 3"``).
        key (Any): the owner's key (a step).
    """

    def __init__(self, label: str, key: Any, run: Callable[[], Any]) -> None:
        self.label = label
        self.key = key
        self._run = run
        self._future: Future = Future()
        self._reported = False

    def done(self) -> bool:
        """Whether it finished (succeeded, failed or was abandoned)."""
        return self._future.done()

    @property
    def value(self) -> Any:
        """Its return value, or ``None`` while running or when it failed."""
        if not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()

    @property
    def reported(self) -> bool:
        """Whether its failure (if any) reached a caller already."""
        return self._reported

    def wait(self, timeout_secs: float | None = None) -> bool:
        """Wait until it finished; True when it did within ``timeout_secs``. Reports nothing."""
        try:
            self._future.exception(timeout=timeout_secs)
        except FutureTimeoutError:
            return False
        return True

    def failure(self) -> BaseException | None:
        """Its exception once finished, else ``None`` (reports nothing)."""
        return self._future.exception() if self._future.done() else None

    def result(self, timeout_secs: float | None = None) -> Any:
        """Wait for it and return its value; its failure is raised here and counts as reported.

        Raises:
            TimeoutError: still running after ``timeout_secs``.
            BaseException: whatever the task raised.
        """
        try:
            value = self._future.result(timeout=timeout_secs)
        except FutureTimeoutError as exc:
            raise TimeoutError(f"{self.label} still in flight after {timeout_secs} s") from exc
        except BaseException:
            self._reported = True
            raise
        return value

    def mark_reported(self) -> None:
        """Count its failure as reported (the owner raised it another way)."""
        self._reported = True

    def execute(self) -> None:
        """Run it (on the worker thread) and record the outcome."""
        if not self._future.set_running_or_notify_cancel():
            return
        try:
            value = self._run()
        except BaseException as exc:  # noqa: BLE001 - kept for the owner's next sync point
            self._future.set_exception(exc)
        else:
            self._future.set_result(value)

    def abandon(self, reason: str) -> None:
        """Finish a task that never started with :class:`SaveAbandonedError`."""
        if self._future.set_running_or_notify_cancel():
            self._future.set_exception(SaveAbandonedError(f"{self.label} abandoned before it started: {reason}"))


_live: "weakref.WeakSet[BackgroundWorker]" = weakref.WeakSet()


class BackgroundWorker:
    """One thread running submitted tasks in order (see the module docstring).

    Args:
        name (str): the thread's name.
        exit_timeout_secs (float): at interpreter exit, seconds queued and running tasks are
            given to finish before they are abandoned.
        exit_join_secs (float | None): seconds the thread is then given to stop (default: the
            exit deadline again, at most 10 s).
        on_exit (ExitReport | None): reports the exit sequence's steps (the owner's messages).

    Raises:
        ValueError: a negative ``exit_timeout_secs``.
    """

    def __init__(self, name: str, *, exit_timeout_secs: float, exit_join_secs: float | None = None,
                 on_exit: ExitReport | None = None) -> None:
        if exit_timeout_secs < 0:
            raise ValueError(f"exit_timeout_secs must be >= 0, got {exit_timeout_secs!r}")
        self.name = name
        self.exit_timeout_secs = float(exit_timeout_secs)
        self.exit_join_secs = min(10.0, max(1.0, self.exit_timeout_secs)) if exit_join_secs is None else exit_join_secs
        self.on_exit = on_exit
        self.cancelled = threading.Event()
        self._cond = threading.Condition()
        self._queue: collections.deque[BackgroundTask] = collections.deque()
        self._running: BackgroundTask | None = None
        self._failed: list[BackgroundTask] = []  # finished with a failure, maybe not reported yet
        self._thread: threading.Thread | None = None
        self._closed = False
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
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
                atexit.unregister(_finish_all_at_exit)
                atexit.register(_finish_all_at_exit)
            self._cond.notify_all()
        return task

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
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
        """Wait for queued tasks (see :meth:`wait_idle`), then stop and join the thread; new
        tasks are refused afterwards. Safe to call twice.

        Raises:
            TimeoutError: tasks still pending after ``timeout_secs``; the thread is stopped
                once they finish.
        """
        try:
            self.wait_idle(timeout_secs)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
                thread = self._thread
            if thread is not None and thread is not threading.current_thread() and self.idle():
                thread.join(timeout_secs)
            _live.discard(self)

    def finish_at_exit(self) -> None:
        """The exit sequence (module docstring): wait, cancel, stop and join, report."""
        with self._cond:
            if self._closed and self._thread is None:
                return
            self._closed = True
            tasks = ([self._running] if self._running is not None else []) + list(self._queue)
            self._cond.notify_all()
        if tasks and self.on_exit is not None:
            self.on_exit("waiting", tasks)
        if not self.wait_until(self.idle, self.exit_timeout_secs):
            unfinished = [task for task in tasks if not task.done()]
            self.cancelled.set()
            if self.on_exit is not None:
                self.on_exit("abandoned", unfinished)
        thread = self._thread
        if thread is not None and thread.is_alive():
            with self._cond:
                self._cond.notify_all()
            thread.join(self.exit_join_secs)
            if thread.is_alive():
                print(f"opd_store: background thread {thread.name} is still inside a backend call at exit; "
                      "its step stays uncommitted", file=sys.stderr, flush=True)
        if self.on_exit is not None:
            self.on_exit("finished", tasks)


def _finish_all_at_exit() -> None:
    for worker in list(_live):
        try:
            worker.finish_at_exit()
        except Exception as exc:  # noqa: BLE001 - nobody is left to raise to at exit
            print(f"opd_store: at exit, background worker {worker.name}: {exc!r}", file=sys.stderr, flush=True)


__all__ = ["BackgroundTask", "BackgroundWorker", "ExitReport"]
