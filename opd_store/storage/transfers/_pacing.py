"""How fast a store sends its upload requests: a concurrency limit and a send rate that adapt to
throttling, and a jittered back-off between the part writer's own retries of a throttled request.

Above its request rate a store answers ``503 SlowDown`` (S3) or ``429`` (GCS). If every part in
flight is retried on the same schedule, the retries of hundreds of ranks arrive together and the
store spends its rate refusing them (the retry storm AWS's "Exponential Backoff And Jitter"
describes). :class:`Pacer` is one per store (``storage.transfers.pacer``), shared by every payload
the store uploads, and does what TCP does with congestion (additive increase, multiplicative
decrease):

* at most ``int(limit)`` requests are in flight (:attr:`Pacer.limit`: 1 to ``parts_in_flight``);
  a request waits for a slot (:meth:`Pacer.acquire`). Each success raises the limit by
  ``1/limit`` (one more slot per ``limit`` successes);
* a throttled answer halves the limit and sets a *send rate*: :data:`RATE_CUT` times the rate the
  store sent at over the last :data:`RATE_WINDOW_SECS` (taken as at least one request per
  :data:`BACKOFF_BASE_SECS`, so a store that sent little is not held back long), or times the send
  rate in force (:data:`RATE_CUT_AGAIN` when nothing succeeded since the last cut). While it holds, the store's requests start ``1/rate`` apart
  (jittered by +-50%), so hundreds of ranks, each with a request in flight, slow down together:
  concurrency alone cannot go below one request per rank. The rate grows linearly, doubling in
  :data:`RATE_DOUBLING_SECS`, until the next cut; :data:`RATE_FREE_SECS` without a throttled
  answer end it. Answers to requests sent before the last cut do not cut again, so one burst of
  refusals cuts once;
* a throttled request is sent again after a wait drawn uniformly from ``[0, min(cap, base x
  2^n)]`` ("full jitter", from a private ``random.Random``: never the training thread's stream,
  :mod:`opd_store.runtime._thread_random`; ``n`` counts the request's refusals, the back-off
  schedule only), then waits for its slot and turn like any request (:meth:`Pacer.backoff`). On S3
  botocore leaves these retries to the pacer (:func:`opd_store.storage.s3._multipart.watch_throttling`).

When a throttled request fails: once it is refused ``throttle_timeout_secs`` (default 300 s) or
more after its first refusal (0: at its first refusal), with :class:`~opd_store.errors.ThrottledUploadError`
naming how long. Never by a count of refusals, nor by this store's own progress: every rank has its
own store and pacer, and behind one prefix hundreds of ranks share the bucket's rate, so a rank
waits many refusals for its share while the bucket serves the job at its limit (a count per rank
failed whole 256- and 512-rank saves that were committing at the limit: docs/performance.md).

The store counts its throttled answers and its *throttled time*: from a throttled answer until
:data:`QUIET_SECS` have passed without another one (:meth:`Pacer.stats`); a save compares that
time with its own duration (:mod:`opd_store.commit._attempt`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import threading
import time
from typing import Awaitable, Callable, TypeVar

from ...errors import ThrottledUploadError
from .._backend_errors import describe, is_rate_limited

T = TypeVar("T")

BACKOFF_BASE_SECS = 0.2
"""First back-off's upper bound (seconds); doubled on each retry of the same request."""
BACKOFF_CAP_SECS = 10.0
"""Largest back-off's upper bound (seconds)."""
BACKOFF_DOUBLINGS = 6
"""Retries after which the back-off's bound stops doubling (0.2 s x 2^6 > 10 s)."""
RATE_WINDOW_SECS = 2.0
"""The window over which a store's send rate is measured when a throttled answer cuts it."""
RATE_DOUBLING_SECS = 4.0
"""After a cut, the send rate grows linearly, doubling in this many seconds without another cut."""
RATE_FREE_SECS = 5.0
"""A rate limit ends this long after the last throttled answer."""
RATE_CUT = 0.7
"""A throttled answer multiplies the send rate by this (CUBIC's 0.7: a strict limit's bursts cut
every rank often; halving each time left the ranks together well below the limit)..."""
RATE_CUT_AGAIN = 0.5
"""...and by this when the store had no success since the last cut (far above the limit: hundreds
of ranks must come down to a small share each)."""
MIN_RATE = 0.02
"""The lowest send rate, requests per second (one request per 50 s)."""
QUIET_SECS = 1.0
"""A throttled period ends this long after its last throttled answer."""
DEFAULT_THROTTLE_TIMEOUT_SECS = 300.0
"""Default ``throttle_timeout_secs``: 512 ranks behind one prefix limited to 20 writes/s commit in
about 3 minutes (docs/performance.md); a shorter preemption notice is lost either way."""


@dataclasses.dataclass(frozen=True)
class PacerStats:
    """A store's throttling so far (monotonic counters; subtract two readings for an interval).

    Attributes:
        throttled_answers (int): throttled answers seen (each HTTP attempt, client retries included).
        retries (int): requests the part writer sent again after a back-off.
        throttled_secs (float): throttled time in seconds (module docstring).
        limit (float): the concurrency limit at the reading.
        rate (float | None): the send rate at the reading (``None``: no rate limit).
    """

    throttled_answers: int = 0
    retries: int = 0
    throttled_secs: float = 0.0
    limit: float = 0.0
    rate: float | None = None


class Pacer:
    """The adaptive concurrency limit, send rate and back-off of one store's uploads (module
    docstring).

    Args:
        max_in_flight (int): the most requests in flight (``parts_in_flight``).
        throttle_timeout_secs (float): how long after its first refusal a request still refused
            fails (``throttle_timeout_secs``; module docstring).
        seed (int | None): seed of the private generator of back-offs and spacing (tests);
            ``os.urandom`` by default.
        adaptive (bool): slow down on throttled answers (``False``: count them only: what a store
            without pacing does, ``bench.simulation``'s comparison).
        clock (Callable[[], float]): monotonic seconds (tests pass their own).
        sleep (Callable[[float], Awaitable[None]]): how the pacer waits (``asyncio.sleep``; tests
            pass one that moves their clock).

    Slots are taken and handed over from any thread and any event loop (a waiting coroutine is
    woken on its own loop).
    """

    def __init__(self, max_in_flight: int, *, throttle_timeout_secs: float = DEFAULT_THROTTLE_TIMEOUT_SECS,
                 seed: int | None = None, adaptive: bool = True, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.max_in_flight = max_in_flight
        self._clock = clock
        self._sleep = sleep
        self.adaptive = adaptive
        self.watches_answers = False  # set when every throttled answer is reported as it arrives (S3)
        self.throttle_timeout_secs = throttle_timeout_secs
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._limit = float(max_in_flight)
        self._in_flight = 0
        self._waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = collections.deque()
        self._epoch = 0  # one more at each cut: answers to requests sent before it do not cut again
        self._rate_at_cut: float | None = None  # None: no rate limit
        self._last_cut = 0.0
        self._next_send = 0.0
        self._sent: collections.deque[float] = collections.deque()  # send times within RATE_WINDOW_SECS
        self._throttled_answers = 0
        self._retries = 0
        self._successes = 0
        self._successes_at_cut = 0
        self._throttled_secs = 0.0  # closed throttled periods
        self._period_since: float | None = None  # the open period's start
        self._last_answer = -QUIET_SECS

    # -- slots -----------------------------------------------------------------------------------
    @property
    def limit(self) -> float:
        """The concurrency limit (``1 <= limit <= max_in_flight``); ``int(limit)`` requests fly at once."""
        return self._limit

    def rate(self) -> float | None:
        """The requests per second the store may start now, or ``None`` (no rate limit)."""
        with self._lock:
            return self._rate_locked(self._clock())

    def _rate_locked(self, now: float) -> float | None:
        if self._rate_at_cut is None:
            return None
        if now - self._last_answer >= RATE_FREE_SECS:  # quiet long enough: no rate limit any more
            self._rate_at_cut = None
            return None
        return self._rate_at_cut * (1.0 + (now - self._last_cut) / RATE_DOUBLING_SECS)

    def _allowed(self) -> int:
        return max(1, int(self._limit))

    async def acquire(self) -> int:
        """Wait for a slot and, while a rate limit holds, for this request's turn; return the epoch
        the request is sent in (give it to :meth:`release` and :meth:`throttled`).

        Raises:
            asyncio.CancelledError: cancelled while waiting (no slot is held then).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future | None = None
        with self._lock:
            if not self._waiters and self._in_flight < self._allowed():
                self._in_flight += 1
            else:
                future = loop.create_future()
                self._waiters.append((loop, future))
        try:
            if future is not None:
                await future
            while (wait := self._turn()) > 0:
                await self._sleep(wait)
        except asyncio.CancelledError:
            with self._lock:
                if future is not None and (loop, future) in self._waiters:
                    self._waiters.remove((loop, future))
                else:  # the slot was held (granted at once, or handed over)
                    self._in_flight -= 1
                    self._wake_locked()
            raise
        return self._epoch

    def _turn(self) -> float:
        """0 when the request may start now (its start is recorded), else the seconds to wait. A
        rate limit spaces the store's requests by ``1/rate`` each, jittered by +-50% (ranks cut at
        the same instant do not send in step)."""
        now = self._clock()
        with self._lock:
            rate = self._rate_locked(now)
            if rate is not None:
                if now < self._next_send:
                    return self._next_send - now
                self._next_send = now + self._random.uniform(0.5, 1.5) / rate
            self._sent.append(now)
            while self._sent and self._sent[0] < now - RATE_WINDOW_SECS:
                self._sent.popleft()
            return 0.0

    def next_send_in(self) -> float:
        """Seconds until the store's next request may start (0 without a rate limit)."""
        now = self._clock()
        with self._lock:
            return max(0.0, self._next_send - now) if self._rate_locked(now) is not None else 0.0

    def release(self, epoch: int, *, succeeded: bool) -> None:
        """Give a slot back; a success raises the concurrency limit by ``1/limit``."""
        with self._lock:
            self._in_flight -= 1
            if succeeded:
                self._successes += 1
                if self._limit < self.max_in_flight:
                    self._limit = min(float(self.max_in_flight), self._limit + 1.0 / self._limit)
            self._wake_locked()

    def now(self) -> float:
        """The pacer's clock (monotonic seconds)."""
        return self._clock()

    def _wake_locked(self) -> None:
        while self._waiters and self._in_flight < self._allowed():
            loop, future = self._waiters.popleft()
            self._in_flight += 1
            loop.call_soon_threadsafe(_resolve, future)

    # -- throttling ------------------------------------------------------------------------------
    def throttled(self, epoch: int | None = None, *, count: bool = True) -> None:
        """A throttled answer: halve the concurrency limit and cut the send rate to :data:`RATE_CUT`
        times the rate the store sent at over the last :data:`RATE_WINDOW_SECS` (at least
        ``1/BACKOFF_BASE_SECS``), or times the rate in force if lower, unless the request was sent
        before the last cut (``epoch`` older than the current one) or, without an epoch (an answer
        the client heard), the last cut was less than :data:`BACKOFF_BASE_SECS` ago. ``count``:
        count it among the answers (not when a watcher already reported it)."""
        now = self._clock()
        with self._lock:
            self._throttled_answers += int(count)
            self._close_period_locked(now)  # only if it went quiet before this answer
            if self._period_since is None:
                self._period_since = now
            if not self.adaptive or (epoch is not None and epoch != self._epoch) or (
                    epoch is None and now - self._last_cut < BACKOFF_BASE_SECS):
                self._last_answer = now
                return
            current = self._rate_locked(now)
            sent = max(len(self._sent) / RATE_WINDOW_SECS, 1.0 / BACKOFF_BASE_SECS)
            cut = RATE_CUT if current is None or self._successes > self._successes_at_cut else RATE_CUT_AGAIN
            self._rate_at_cut = max(MIN_RATE, cut * (sent if current is None else min(current, sent)))
            self._successes_at_cut = self._successes
            self._last_answer = now
            self._epoch += 1
            self._last_cut = now
            self._limit = max(1.0, self._limit / 2)
            self._next_send = max(self._next_send, now + self._random.uniform(0.0, 1.0) / self._rate_at_cut)

    def _close_period_locked(self, now: float) -> None:
        """End the open throttled period at ``now`` or :data:`QUIET_SECS` after its last answer,
        whichever is first; one not quiet yet stays open."""
        if self._period_since is None:
            return
        quiet_end = self._last_answer + QUIET_SECS
        if now < quiet_end:
            return
        self._throttled_secs += max(0.0, quiet_end - self._period_since)
        self._period_since = None

    def backoff_secs(self, retry: int) -> float:
        """The wait before retry number ``retry`` (from 0): uniform in ``[0, min(cap, base x 2^retry)]``."""
        with self._lock:
            return self._random.uniform(0.0, min(BACKOFF_CAP_SECS, BACKOFF_BASE_SECS * (2 ** retry)))

    async def backoff(self, retry: int) -> None:
        """Wait out retry number ``retry``'s back-off (counted as a retry)."""
        with self._lock:
            self._retries += 1
        await self._sleep(self.backoff_secs(retry))

    def stats(self) -> PacerStats:
        """The counters so far (a throttled period still open counts up to now)."""
        now = self._clock()
        with self._lock:
            self._close_period_locked(now)
            open_secs = 0.0 if self._period_since is None else now - self._period_since
            return PacerStats(self._throttled_answers, self._retries, self._throttled_secs + open_secs, self._limit,
                              self._rate_locked(now))


async def paced(pacer: "Pacer | None", send: Callable[[], Awaitable[T]]) -> T:
    """``await send()`` (one upload request, the client's retries included) in a slot of
    ``pacer``; a failure for the store's rate (:func:`~opd_store.storage._backend_errors.is_rate_limited`)
    cuts the limit and rate and is sent again after a jittered back-off, until it is refused
    ``pacer.throttle_timeout_secs`` or more after its first refusal (module docstring). Without a
    pacer, ``send()`` as it is.

    Raises:
        ThrottledUploadError: still throttled past the timeout (the last refusal is its cause).
        Exception: whatever ``send()`` raised that is not a refusal for the store's rate.
    """
    if pacer is None:
        return await send()
    retry = 0
    first_refused: float | None = None
    while True:
        epoch = await pacer.acquire()
        try:
            result = await send()
        except Exception as exc:  # noqa: BLE001 - throttled ones are retried, anything else raised
            pacer.release(epoch, succeeded=False)
            if not is_rate_limited(exc):
                raise
            pacer.throttled(epoch, count=not pacer.watches_answers)
            now = pacer.now()
            first_refused = now if first_refused is None else first_refused
            if now - first_refused >= pacer.throttle_timeout_secs:
                raise ThrottledUploadError(
                    f"throttled for {now - first_refused:.0f} s ({retry + 1} refusals), longer than "
                    f"throttle_timeout_secs={pacer.throttle_timeout_secs:g}; last answer: {describe(exc)}"
                ) from exc
            await pacer.backoff(min(retry, BACKOFF_DOUBLINGS))
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


__all__ = ["BACKOFF_BASE_SECS", "BACKOFF_CAP_SECS", "BACKOFF_DOUBLINGS", "DEFAULT_THROTTLE_TIMEOUT_SECS", "MIN_RATE", "Pacer", "PacerStats",
           "QUIET_SECS", "RATE_CUT", "RATE_CUT_AGAIN", "RATE_DOUBLING_SECS", "RATE_FREE_SECS", "RATE_WINDOW_SECS",
           "paced"]
