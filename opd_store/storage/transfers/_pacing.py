"""How fast a store sends its upload requests: a concurrency limit that adapts to throttling, and
a jittered back-off between the part writer's own retries of a throttled request.

Above its request rate a store answers ``503 SlowDown`` (S3) or ``429`` (GCS). If every
part in flight is retried on the same schedule, the retries of hundreds of ranks arrive together
and the store spends its rate refusing them (the retry storm AWS's "Exponential Backoff And Jitter"
describes). :class:`Pacer` is one per store (``storage.transfers.pacer``), shared by every payload
the store uploads, and does what TCP does with congestion (additive increase, multiplicative
decrease):

* at most :attr:`Pacer.limit` parts are in flight (between 1 and ``parts_in_flight``); a request
  waits for a slot (:meth:`Pacer.acquire`);
* each throttled answer halves the limit (:meth:`Pacer.throttled`; answers to requests sent
  before the last cut do not cut again, so one burst of refusals halves it once); each request
  that succeeds raises it by ``1/limit`` (one more slot per ``limit`` successes) back to
  ``parts_in_flight``;
* a request the client's own retries gave up on while throttled waits a delay drawn uniformly
  from ``[0, min(cap, base x 2^n)]`` ("full jitter", from a private ``random.Random``: never
  the training thread's stream, :mod:`opd_store.runtime._thread_random`) and is sent again, at
  most ``throttle_retries`` times (:meth:`Pacer.backoff`).

The store counts its throttled answers and its *throttled time*: from a throttled answer until
the limit is back at ``parts_in_flight`` or :data:`QUIET_SECS` have passed without another one
(:meth:`Pacer.stats`); a save compares that time with its own duration
(:mod:`opd_store.commit._attempt`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import threading
import time
from typing import Awaitable, Callable, TypeVar

from .._backend_errors import is_rate_limited

T = TypeVar("T")

BACKOFF_BASE_SECS = 0.2
"""First back-off's upper bound (seconds); doubled on each retry of the same request."""
BACKOFF_CAP_SECS = 10.0
"""Largest back-off's upper bound (seconds)."""
QUIET_SECS = 1.0
"""A throttled period ends this long after its last throttled answer (or when the limit is back
at its maximum, if sooner)."""


@dataclasses.dataclass(frozen=True)
class PacerStats:
    """A store's throttling so far (monotonic counters; subtract two readings for an interval).

    Attributes:
        throttled_answers (int): throttled answers seen (each HTTP attempt, client retries included).
        retries (int): requests the part writer sent again after a back-off.
        throttled_secs (float): throttled time in seconds (module docstring).
        limit (float): the limit at the reading.
    """

    throttled_answers: int = 0
    retries: int = 0
    throttled_secs: float = 0.0
    limit: float = 0.0


class Pacer:
    """The adaptive concurrency limit and back-off of one store's uploads (module docstring).

    Args:
        max_in_flight (int): the most requests in flight (``parts_in_flight``).
        throttle_retries (int): how many times the part writer sends a throttled request again
            after the client's own retries gave up (``throttle_retries``).
        seed (int | None): seed of the back-off's private generator (tests); ``os.urandom`` by default.

    Slots are taken and handed over from any thread and any event loop (a waiting coroutine is
    woken on its own loop).
    """

    def __init__(self, max_in_flight: int, *, throttle_retries: int = 0, seed: int | None = None) -> None:
        self.max_in_flight = max_in_flight
        self.watches_answers = False  # set when every throttled answer is reported as it arrives (S3)
        self.throttle_retries = throttle_retries
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._limit = float(max_in_flight)
        self._in_flight = 0
        self._waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = collections.deque()
        self._epoch = 0  # one more at each cut: answers to requests sent before it do not cut again
        self._last_cut = 0.0
        self._throttled_answers = 0
        self._retries = 0
        self._throttled_secs = 0.0  # closed throttled periods
        self._period_since: float | None = None  # the open period's start
        self._last_answer = 0.0

    # -- slots -----------------------------------------------------------------------------------
    @property
    def limit(self) -> float:
        """The current limit (``1 <= limit <= max_in_flight``); ``int(limit)`` requests fly at once."""
        return self._limit

    def _allowed(self) -> int:
        return max(1, int(self._limit))

    async def acquire(self) -> int:
        """Wait for a slot; return the epoch the request is sent in (give it to :meth:`release`).

        Raises:
            asyncio.CancelledError: cancelled while waiting (no slot is held then).
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self._in_flight < self._allowed():
                self._in_flight += 1
                return self._epoch
            future = loop.create_future()
            self._waiters.append((loop, future))
        try:
            await future
        except asyncio.CancelledError:
            with self._lock:
                try:
                    self._waiters.remove((loop, future))
                except ValueError:  # the slot was handed over just before the cancellation
                    self._in_flight -= 1
                    self._wake_locked()
            raise
        return self._epoch

    def release(self, epoch: int, *, succeeded: bool) -> None:
        """Give a slot back; a success raises the limit by ``1/limit`` (to ``max_in_flight``)."""
        with self._lock:
            self._in_flight -= 1
            if succeeded and self._limit < self.max_in_flight:
                self._limit = min(float(self.max_in_flight), self._limit + 1.0 / self._limit)
                if self._limit >= self.max_in_flight:
                    self._close_period_locked(time.monotonic())
            self._wake_locked()

    def _wake_locked(self) -> None:
        while self._waiters and self._in_flight < self._allowed():
            loop, future = self._waiters.popleft()
            self._in_flight += 1
            loop.call_soon_threadsafe(_resolve, future)

    # -- throttling ------------------------------------------------------------------------------
    def throttled(self, epoch: int | None = None, *, count: bool = True) -> None:
        """A throttled answer: halve the limit, unless the request was sent before the last cut
        (``epoch`` older than the current one) or no epoch is known and the limit was cut in the
        last :data:`BACKOFF_BASE_SECS` (an answer seen by the client, not by a slot). ``count``:
        count it among the answers (not when a watcher already reported it)."""
        now = time.monotonic()
        with self._lock:
            self._throttled_answers += int(count)
            self._close_period_locked(now)  # only if it went quiet before this answer
            if self._period_since is None:
                self._period_since = now
            self._last_answer = now
            if epoch is not None and epoch != self._epoch:
                return
            if epoch is None and now - self._last_cut < BACKOFF_BASE_SECS:
                return
            self._epoch += 1
            self._last_cut = now
            self._limit = max(1.0, self._limit / 2)

    def _close_period_locked(self, now: float) -> None:
        """End the open throttled period at ``now`` or at its quiet end, whichever is first; a
        period not quiet yet at ``now`` stays open unless the limit is back at its maximum."""
        if self._period_since is None:
            return
        quiet_end = self._last_answer + QUIET_SECS
        if now < quiet_end and self._limit < self.max_in_flight:
            return
        self._throttled_secs += max(0.0, min(now, quiet_end) - self._period_since)
        self._period_since = None

    def backoff_secs(self, retry: int) -> float:
        """The wait before retry number ``retry`` (from 0): uniform in ``[0, min(cap, base x 2^retry)]``."""
        with self._lock:
            return self._random.uniform(0.0, min(BACKOFF_CAP_SECS, BACKOFF_BASE_SECS * (2 ** retry)))

    async def backoff(self, retry: int) -> None:
        """Wait out retry number ``retry``'s back-off (counted as a retry)."""
        with self._lock:
            self._retries += 1
        await asyncio.sleep(self.backoff_secs(retry))

    def stats(self) -> PacerStats:
        """The counters so far (a throttled period still open counts up to now)."""
        now = time.monotonic()
        with self._lock:
            self._close_period_locked(now)
            open_secs = 0.0 if self._period_since is None else now - self._period_since
            return PacerStats(self._throttled_answers, self._retries, self._throttled_secs + open_secs, self._limit)


async def paced(pacer: "Pacer | None", send: Callable[[], Awaitable[T]]) -> T:
    """``await send()`` (one upload request, the client's retries included) in a slot of
    ``pacer``; a failure for the store's rate (:func:`~opd_store.storage._backend_errors.is_rate_limited`)
    cuts the limit and, ``pacer.throttle_retries`` times at most, is sent again after a jittered
    back-off (module docstring). Without a pacer, ``send()`` as it is.

    Raises:
        Exception: whatever the last ``send()`` raised (a throttled one once the retries are spent).
    """
    if pacer is None:
        return await send()
    retry = 0
    while True:
        epoch = await pacer.acquire()
        try:
            result = await send()
        except Exception as exc:  # noqa: BLE001 - throttled ones are retried, anything else raised
            pacer.release(epoch, succeeded=False)
            if not is_rate_limited(exc):
                raise
            pacer.throttled(epoch, count=not pacer.watches_answers)
            if retry >= pacer.throttle_retries:
                raise
            await pacer.backoff(retry)
            retry += 1
            continue
        except BaseException:
            pacer.release(epoch, succeeded=False)
            raise
        pacer.release(epoch, succeeded=True)
        return result


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


__all__ = ["BACKOFF_BASE_SECS", "BACKOFF_CAP_SECS", "Pacer", "PacerStats", "QUIET_SECS", "paced"]
