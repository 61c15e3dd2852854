"""Events between a test and a program it started: JSON lines on the child's stdout, replies on its stdin.

A child (a training start the test kills at an exact point) calls :func:`emit` for each event and,
where the test must decide before it goes on, :func:`wait_reply`. Everything else the child prints
(the Trainer's log lines, warnings) stays on the same stream and is kept as the child's output for
error messages. The parent wraps the process (:class:`subprocess.Popen` or a fork-server child,
started with ``stdin=PIPE, stdout=PIPE, stderr=STDOUT, text=True``) in an :class:`EventStream`.
Synchronisation is by these messages, never by sleeping.
"""

from __future__ import annotations

import collections
import json
import queue
import sys
import threading
from typing import Any, Callable

_TIMED_OUT: dict[str, Any] = {"event": "timed out"}
PREFIX = "@opd-event "
"""What starts an event line (a line of the child's own output never does)."""


def emit(event: dict[str, Any]) -> None:
    """Child side: write one event (a JSON object) to stdout, flushed."""
    sys.stdout.write(PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def wait_reply() -> str:
    """Child side: block until the parent replies (one line on stdin); ``""`` once stdin closed."""
    return sys.stdin.readline().strip()


class EventStream:
    """Parent side: the events of one child, read by a thread so that waits can time out.

    Args:
        process: the child (``stdout`` a text pipe carrying its stdout and stderr; ``stdin`` a text
            pipe when the test replies).
        keep_lines (int): lines of the child's other output kept for error messages.
    """

    def __init__(self, process: Any, *, keep_lines: int = 200) -> None:
        self.process = process
        self.output: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="child-events", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in self.process.stdout:
                if line.startswith(PREFIX):
                    self._events.put(json.loads(line[len(PREFIX):]))
                else:
                    self.output.append(line.rstrip("\n"))
        except (OSError, ValueError):  # the stream was closed under the reader (the test ended)
            pass
        finally:
            self._events.put(None)  # end of stream

    def next(self, timeout_secs: float = 300) -> dict[str, Any] | None:
        """The next event; ``None`` once the child's output ended (it exited or was killed).

        Raises:
            AssertionError: no event within ``timeout_secs`` (the child is killed; its last output
                is in the message), or the child reported ``{"event": "error"}`` (its traceback).
        """
        try:
            event = self._events.get(timeout=timeout_secs)
        except queue.Empty:
            event = _TIMED_OUT
            self.process.kill()
        assert event is not _TIMED_OUT, (f"no event from {self.process.args} within {timeout_secs} s; its "
                                         "output:\n" + "\n".join(self.output))
        if event is None:
            self._events.put(None)  # stays ended for later calls
            return None
        assert event.get("event") != "error", f"{self.process.args} failed:\n{event.get('traceback')}"
        return event

    def until(self, stop: Callable[[dict[str, Any]], bool], *, reply_to: str | None = None,
              timeout_secs: float = 300) -> list[dict[str, Any]]:
        """Read events until ``stop(event)`` holds or the output ends; return every event read
        (the stopping one last). Each event named ``reply_to`` read before that is answered with
        :meth:`reply` (the child waits for it)."""
        seen = []
        while (event := self.next(timeout_secs)) is not None:
            seen.append(event)
            if stop(event):
                break
            if reply_to is not None and event.get("event") == reply_to:
                self.reply()
        return seen

    def reply(self, text: str = "go") -> None:
        """Answer the child's :func:`wait_reply`."""
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def rest(self) -> list[dict[str, Any]]:
        """Every event still to come, once the child has ended (after a kill: what it wrote first)."""
        self.process.wait()
        self._reader.join(60)
        events = []
        while (event := self._events.get_nowait()) is not None:
            events.append(event)
        self._events.put(None)
        return events


__all__ = ["PREFIX", "EventStream", "emit", "wait_reply"]
