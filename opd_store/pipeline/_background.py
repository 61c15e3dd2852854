"""The one owner of background saves: asynchronous OPD saves, the Hugging Face callback's uploads
and a tiered store's uploads all run through a :class:`BackgroundSaves`.

Its contract for every caller: at most one save in flight where asked (``when_busy``: wait, or
``SaveInFlightError``); a failure nobody saw is raised once, at the next :meth:`~BackgroundSaves.sync`
or :meth:`~BackgroundSaves.close`, as ``BackgroundSaveError`` (a tiered store's: ``UploadError``),
never only logged; one exit report on stderr (docs/spot.md, "Exit deadline").
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable

from ..errors import BackgroundSaveError, SaveInFlightError
from ._task import BackgroundTask
from ._worker import EXIT_STAGE_SAVES, BackgroundWorker

WHEN_BUSY = ("wait", "raise")


class BackgroundSaves:
    """The background saves of one caller.

    Args:
        name (str): the worker thread's name (``opd-...``).
        exit_timeout_secs (float): at interpreter exit, seconds saves get to commit before abandonment.
        exit_stage (int): the worker's exit stage (``EXIT_STAGE_SAVES`` or ``EXIT_STAGE_UPLOADS``).
        owner (str | None): names the caller in errors (a store URL).
        error (type[BackgroundSaveError]): the class of the errors raised at sync points.
        abandoned_note (str): what the exit report adds about an abandoned save.

    Raises:
        ValueError: a negative ``exit_timeout_secs``.
    """

    def __init__(self, name: str, *, exit_timeout_secs: float, exit_stage: int = EXIT_STAGE_SAVES,
                 owner: str | None = None, error: type[BackgroundSaveError] = BackgroundSaveError,
                 abandoned_note: str = "it stays uncommitted") -> None:
        self.worker = BackgroundWorker(name, exit_timeout_secs=exit_timeout_secs, on_exit=self._report_exit,
                                       exit_stage=exit_stage)
        self.owner = owner
        self.error = error
        self.abandoned_note = abandoned_note
        self._lock = threading.Lock()
        self._last: BackgroundTask | None = None  # the newest save
        self._follow_ups: "weakref.WeakSet[BackgroundTask]" = weakref.WeakSet()  # tasks that follow a save
        self._closed = False

    @property
    def cancelled(self) -> threading.Event:
        """Set once the saves are abandoned (exit deadline, or a timed-out :meth:`close`): a
        transaction or copy watching it stops before its commit."""
        return self.worker.cancelled

    @property
    def exit_timeout_secs(self) -> float:
        return self.worker.exit_timeout_secs

    @property
    def closed(self) -> bool:
        return self._closed

    # -- submitting ------------------------------------------------------------------------------
    def submit(self, label: str, key: Any, run: Callable[[], Any], *, follow_up: bool = False) -> BackgroundTask:
        """Queue ``run()`` on the worker (in order, ``random`` routed away from the caller).

        Args:
            label (str): the save in words (``"asynchronous save of step 3"``).
            key (Any): the caller's key (a step).
            run (Callable[[], Any]): the save, returning its URL; it should watch :attr:`cancelled`.
            follow_up (bool): work after a save (a durable-step hook): failures reported alike, but no
                exit line waits for it.

        Raises:
            ValueError: the owner is closed.
        """
        if self._closed:
            raise ValueError(f"{self.worker.name} is closed")
        task = self.worker.submit(label, key, run)
        with self._lock:
            if follow_up:
                self._follow_ups.add(task)
            else:
                self._last = task
        return task

    # -- state -----------------------------------------------------------------------------------
    @property
    def last(self) -> BackgroundTask | None:
        """The newest save submitted, or ``None``."""
        return self._last

    def in_flight(self) -> BackgroundTask | None:
        """The newest save while it is queued or running, else ``None``."""
        last = self._last
        return last if last is not None and not last.done() else None

    def pending(self) -> list[BackgroundTask]:
        """Tasks queued or running, in order."""
        return self.worker.pending()

    def wait_until(self, condition: Callable[[], bool], timeout_secs: float | None = None) -> bool:
        """:meth:`BackgroundWorker.wait_until <opd_store.pipeline._worker.BackgroundWorker.wait_until>`."""
        return self.worker.wait_until(condition, timeout_secs)

    # -- sync points -----------------------------------------------------------------------------
    def wait(self, timeout_secs: float | None = None) -> None:
        """Block until nothing is queued or running; reports nothing.

        Raises:
            TimeoutError: tasks still pending after ``timeout_secs`` (named).
        """
        if not self.worker.wait_until(self.worker.idle, timeout_secs):
            labels = ", ".join(task.label for task in self.pending())
            raise TimeoutError(f"{labels} still in flight after {timeout_secs} s")

    def raise_unreported(self, at: str) -> None:
        """Raise every failure nobody saw yet, once, as one :attr:`error` (``at``: the sync point in
        words, ``"close()"``); the first failure is the ``__cause__``, all are named."""
        failed = self.worker.take_unreported()
        if not failed:
            return
        first = failed[0].failure()
        if len(failed) == 1:
            message = (f"the {failed[0].label} failed in the background (reported at {at}): "
                       f"{type(first).__name__}: {first}")
        else:
            message = f"{len(failed)} background failures (reported at {at}): " + "; ".join(
                f"the {task.label} failed: {type(task.failure()).__name__}: {task.failure()}" for task in failed)
        raise self.error(f"{self.owner}: {message}" if self.owner else message) from first

    def sync(self, at: str, *, timeout_secs: float | None = None, when_busy: str = "wait") -> None:
        """A sync point: wait for every task, then :meth:`raise_unreported`.

        Args:
            at (str): the sync point in words, for the error (``"the next save"``).
            timeout_secs (float | None): seconds to wait.
            when_busy (str): ``"raise"`` refuses to wait for a save in flight.

        Raises:
            SaveInFlightError: a save is in flight and ``when_busy="raise"``.
            TimeoutError: still in flight after ``timeout_secs``.
            BackgroundSaveError: (:attr:`error`) a failure nobody saw.
        """
        busy = self.in_flight()
        if when_busy == "raise" and busy is not None:
            raise SaveInFlightError(f"the {busy.label} is still in flight; wait for it (handle.result()) before "
                                    "saving again, or use when_busy='wait'")
        self.wait(timeout_secs)
        self.raise_unreported(at)

    def close(self, timeout_secs: float | None = None, *, at: str = "close()") -> None:
        """Refuse new saves, wait for queued ones, stop and join the worker, then raise unseen failures.
        Safe to call twice.

        Raises:
            TimeoutError: still in flight after ``timeout_secs``: abandoned (:attr:`cancelled` set; one
                inside its manifest create may still commit).
            BackgroundSaveError: (:attr:`error`) a failure nobody saw.
        """
        self._closed = True
        try:
            self.wait(timeout_secs)
        except TimeoutError:
            self.worker.cancelled.set()
            raise
        finally:
            if self.worker.idle():
                self.worker.close()
        self.raise_unreported(at)

    # -- the exit report -----------------------------------------------------------------------
    def _report_exit(self, event: str, tasks: list[BackgroundTask]) -> None:
        """The worker's exit sequence on stderr (module docstring): nobody is left to raise to."""
        if self._closed:
            return
        saves = [task for task in tasks if task not in self._follow_ups]
        seconds = f"{self.worker.exit_timeout_secs:g}"
        lines: list[str] = []
        if event == "waiting":
            lines = [f"waiting up to {seconds} s for the {task.label} to commit" for task in saves if not task.done()]
        elif event == "abandoned":
            lines = [f"abandoned the {task.label} after {seconds} s; {self.abandoned_note}"
                     for task in saves if not task.done()]
        elif event == "finished":
            lines = [f"the {task.label} failed: {type(task.failure()).__name__}: {task.failure()}"
                     for task in self.worker.take_unreported()]
            last = self._last
            told = saves + ([last] if last is not None and last not in saves else [])
            lines += [f"{task.label} committed: {task.value}" for task in told
                      if task.done() and task.failure() is None and isinstance(task.value, str)]
        for line in lines:
            print(f"opd_store: {line}", file=sys.stderr, flush=True)


__all__ = ["WHEN_BUSY", "BackgroundSaves"]
