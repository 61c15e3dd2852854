"""One unit of background work and its outcome, run by :class:`~opd_store.pipeline._worker.BackgroundWorker`;
a failure is raised once by its owner. What the callable holds is dropped on the thread that ran
it, before the outcome is published (docs/spot.md, "Why the worker thread is joined at exit").
"""

from __future__ import annotations

import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Callable

from ..errors import SaveAbandonedError


def _detach_traceback(exc: BaseException) -> None:
    """Replace the frames of ``exc``'s traceback (and its chain's) by their text, as a note: a frame
    keeps the closure holding the task's snapshot alive, which must be freed on the worker thread.
    """
    text = "".join(traceback.format_exception(exc)).rstrip()
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]
    exc.add_note(f"raised in a background worker thread:\n{text}")


class BackgroundTask:
    """One unit of background work and its outcome.

    Attributes:
        label (str): what it is, for messages (``"upload of step 3"``).
        key (Any): the owner's key (a step).
    """

    def __init__(self, label: str, key: Any, run: Callable[[], Any]) -> None:
        self.label = label
        self.key = key
        self._run: Callable[[], Any] | None = run
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
        """Run it (on the worker thread) and record the outcome. The callable, and what it closes
        over, is dropped here, on this thread, before the outcome is published."""
        if not self._future.set_running_or_notify_cancel():
            return
        run, self._run = self._run, None
        try:
            value = run()
        except BaseException as exc:  # noqa: BLE001 - kept for the owner's next sync point
            del run
            _detach_traceback(exc)
            self._future.set_exception(exc)
        else:
            del run
            self._future.set_result(value)

    def settle(self, failure: BaseException) -> None:
        """Finish a task whose thread ended without recording an outcome (no-op when finished)."""
        self._run = None
        if not self._future.done():
            if not self._future.running():
                self._future.set_running_or_notify_cancel()
            self._future.set_exception(failure)

    def abandon(self, reason: str) -> None:
        """Finish a task that never started with :class:`SaveAbandonedError`."""
        self._run = None
        if self._future.set_running_or_notify_cancel():
            self._future.set_exception(SaveAbandonedError(f"{self.label} abandoned before it started: {reason}"))


__all__ = ["BackgroundTask"]
