"""One background thread that runs uploads in order, with the failure raised at the next sync point.

Used by the integrations' asynchronous saves: the training thread hands over a job (upload and
commit one checkpoint) and goes on; :meth:`Uploader.submit` first waits for the previous job, so at
most one checkpoint is in flight and they commit in order. A failure is kept and raised by the next
:meth:`submit`, :meth:`wait` or :meth:`close` on the training thread (an error the training thread
never sees would let a run believe it is protected). Each job runs inside
:func:`opd_store.thread_random.route_background_random`, so S3/GCS retry back-offs drawing from
Python's ``random`` never move the training thread's random stream (a resumed run must draw what
the uninterrupted run drew).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import UploadError
from ..thread_random import route_background_random

logger = logging.getLogger("opd_store.integrations.background")


def _routed(job: Callable[[], Any]) -> Any:
    with route_background_random():
        return job()


class Uploader:
    """A single-thread executor of upload jobs (see module docs).

    Args:
        name (str): thread name prefix (shows in stack dumps).
    """

    def __init__(self, name: str = "opd-store-upload") -> None:
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._pending_label = ""
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """Whether a job is queued or running."""
        return self._pending is not None and not self._pending.done()

    def submit(self, job: Callable[[], Any], label: str) -> None:
        """Wait for the previous job (raising its failure), then start ``job`` in the background.

        Raises:
            UploadError: the previous job failed (its exception is the ``__cause__``).
        """
        self.wait()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
            self._pending = self._executor.submit(_routed, job)
            self._pending_label = label

    def wait(self) -> Any:
        """Block until the job in flight (if any) has finished; return its result.

        Raises:
            UploadError: it failed (its exception is the ``__cause__``); raised once.
        """
        with self._lock:
            pending, label = self._pending, self._pending_label
            self._pending = None
        if pending is None:
            return None
        try:
            return pending.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
            raise UploadError(f"background upload of {label} failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Wait for the job in flight, stop the thread, and raise the job's failure, if any."""
        try:
            self.wait()
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)


__all__ = ["Uploader"]
