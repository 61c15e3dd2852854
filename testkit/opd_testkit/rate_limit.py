"""S3's request-rate limits on loopback: a proxy that answers ``503 SlowDown`` above them.

S3 serves at least 3,500 ``PUT``/``COPY``/``POST``/``DELETE`` and 5,500 ``GET``/``HEAD`` requests per
second per *partitioned prefix* and answers ``503 SlowDown`` above that; a new prefix starts in one
partition and S3 splits a hot key range over tens of minutes; some S3-compatible stores cap a whole
bucket at a few hundred writes per second (field notes, "S3 request limits"). A server on loopback
enforces none of it. :class:`RateLimits` says what to enforce; :class:`RequestRateLimiter` decides
each request with token buckets on a monotonic clock (a clock the caller passes, in tests: the same
requests at the same instants get the same answers); :class:`RateLimitProxy` is an
:class:`~opd_testkit.proxies.S3Proxy` (every request recorded, with its operation and the fault
applied) that forwards a request the limiter admits and answers any other one itself with S3's
``503 SlowDown`` XML error, without reaching the server; :class:`RateLimitProxyProcess` runs it in
a process of its own (``python -m opd_testkit.rate_limit``), so that a benchmark's clients and the
proxy do not share a GIL.

The model of partitions is static: ``partitions`` lists the partitioned prefixes (``bucket/key
prefix``, as S3 would have split them); a key under none of them lies in the bucket's unpartitioned
range, which is one partition too. Each partition has a bucket of tokens for writes and one for
reads, each refilled at its rate and holding at most ``burst_secs`` of it (at least one request);
``bucket_writes_per_sec`` and ``bucket_reads_per_sec`` cap the whole bucket on top. A request is
admitted when every bucket it draws on has a token; it then takes one from each. Refused requests
take nothing (they cost the client a round trip, not the server's rate).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Any, Callable
from urllib.parse import parse_qs, unquote

from .control import ControlledProcess
from .proxies import Request, S3Proxy

AWS_PREFIX_WRITES_PER_SEC = 3500.0
"""S3's write rate per partitioned prefix (PUT/COPY/POST/DELETE)."""
AWS_PREFIX_READS_PER_SEC = 5500.0
"""S3's read rate per partitioned prefix (GET/HEAD)."""
UNPARTITIONED = ""
"""The name of the bucket's unpartitioned key range in statistics."""
_WRITES = frozenset({"PUT", "POST", "DELETE"})


@dataclasses.dataclass(frozen=True)
class RateLimits:
    """What the limiter enforces (``None``: no limit of that kind).

    Attributes:
        prefix_writes_per_sec (float | None): writes per second per partition.
        prefix_reads_per_sec (float | None): reads per second per partition.
        bucket_writes_per_sec (float | None): writes per second for the whole bucket.
        bucket_reads_per_sec (float | None): reads per second for the whole bucket.
        partitions (tuple[str, ...]): partitioned prefixes, ``bucket/key-prefix`` (module docstring).
        burst_secs (float): how many seconds of its rate a bucket of tokens holds (at least one
            request's worth).
    """

    prefix_writes_per_sec: float | None = AWS_PREFIX_WRITES_PER_SEC
    prefix_reads_per_sec: float | None = AWS_PREFIX_READS_PER_SEC
    bucket_writes_per_sec: float | None = None
    bucket_reads_per_sec: float | None = None
    partitions: tuple[str, ...] = ()
    burst_secs: float = 0.1

    def __post_init__(self) -> None:
        for name in ("prefix_writes_per_sec", "prefix_reads_per_sec", "bucket_writes_per_sec", "bucket_reads_per_sec"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        if not self.burst_secs > 0:
            raise ValueError(f"burst_secs must be > 0, got {self.burst_secs!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RateLimits":
        data = json.loads(text)
        data["partitions"] = tuple(data.get("partitions") or ())
        return cls(**data)


class _Tokens:
    """A token bucket: ``rate`` tokens per second, at most ``capacity`` held; starts full."""

    __slots__ = ("capacity", "last", "rate", "tokens")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.last = now

    def refill(self, now: float) -> None:
        if now > self.last:
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
            self.last = now


def request_key(method: str, path: str, query: str) -> str:
    """``bucket/key`` of a path-style request (``/bucket/key?query``); for a listing or a bucket
    operation, ``bucket/<its prefix parameter>``."""
    bucket, _, key = path.lstrip("/").partition("/")
    if not key:
        key = (parse_qs(query).get("prefix") or [""])[0]
    return f"{bucket}/{unquote(key)}"


class RequestRateLimiter:
    """Decides each request against :class:`RateLimits` (module docstring); thread-safe.

    Args:
        limits (RateLimits): what to enforce.
        clock (Callable[[], float]): seconds, monotonic (``time.monotonic`` by default; tests pass
            their own to get the same answers every run).
    """

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], _Tokens] = {}
        # Longest first: a key belongs to the longest partitioned prefix it starts with.
        self._partitions = sorted(limits.partitions, key=len, reverse=True)

    def partition_of(self, key: str) -> str:
        """The partition of ``bucket/key``: the longest partitioned prefix it starts with, else
        :data:`UNPARTITIONED`."""
        return next((p for p in self._partitions if key.startswith(p)), UNPARTITIONED)

    def _tokens(self, scope: str, kind: str, rate: float, now: float) -> _Tokens:
        bucket = self._buckets.get((scope, kind))
        if bucket is None:
            bucket = self._buckets[(scope, kind)] = _Tokens(rate, max(1.0, rate * self.limits.burst_secs), now)
        bucket.refill(now)
        return bucket

    def admit(self, method: str, path: str, query: str = "") -> tuple[bool, str, str]:
        """Whether the request may go to the server now: ``(admitted, partition, kind)``,
        ``kind`` ``write`` or ``read``; an admitted request takes its tokens."""
        kind = "write" if method in _WRITES else "read"
        partition = self.partition_of(request_key(method, path, query))
        limits = self.limits
        rates = ((f"prefix:{partition}", limits.prefix_writes_per_sec if kind == "write" else limits.prefix_reads_per_sec),
                 ("bucket", limits.bucket_writes_per_sec if kind == "write" else limits.bucket_reads_per_sec))
        with self._lock:
            now = self._clock()
            buckets = [self._tokens(scope, kind, rate, now) for scope, rate in rates if rate is not None]
            if any(bucket.tokens < 1.0 for bucket in buckets):
                return False, partition, kind
            for bucket in buckets:
                bucket.tokens -= 1.0
        return True, partition, kind


class RateLimitProxy(S3Proxy):
    """An S3 proxy enforcing :class:`RateLimits` (module docstring); ``503 SlowDown`` above them.

    Args:
        upstream (str): the S3 server's endpoint URL.
        limits (RateLimits): what to enforce (:meth:`set_limits` changes it; the buckets start full).
        clock (Callable[[], float]): the limiter's clock.

    Attributes:
        requests (list[Request]): every request; a refused one has ``fault == "503 SlowDown"``.
    """

    def __init__(self, upstream: str, limits: RateLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.limiter = RequestRateLimiter(limits or RateLimits(), clock)
        self._counts: collections.Counter[tuple[str, str, str, bool]] = collections.Counter()
        self._first_secs: float | None = None
        self._last_secs: float | None = None
        super().__init__(upstream)

    def set_limits(self, limits: RateLimits) -> None:
        """Enforce ``limits`` from now on (with full buckets)."""
        with self.lock:
            self.limiter = RequestRateLimiter(limits, self._clock)

    def _decide(self, record: Request) -> tuple | None:
        with self.lock:
            limiter = self.limiter
        admitted, partition, kind = limiter.admit(record.method, record.path, record.query)
        now = self._clock()
        with self.lock:
            self._counts[(record.op, partition, kind, admitted)] += 1
            self._first_secs = now if self._first_secs is None else self._first_secs
            self._last_secs = now
        return None if admitted else ("status", 503, "SlowDown")

    def stats(self) -> dict[str, Any]:
        """Counts since the last :meth:`reset`: ``requests``, ``throttled``, ``writes``,
        ``throttled_writes``, ``by_op`` and ``throttled_by_op`` (operation -> count),
        ``by_partition`` (partition -> admitted writes), ``span_secs`` (first to last request)."""
        with self.lock:
            counts = dict(self._counts)
            span = (self._last_secs - self._first_secs) if self._first_secs is not None else 0.0
        out: dict[str, Any] = {"requests": 0, "throttled": 0, "writes": 0, "throttled_writes": 0, "by_op": {},
                               "throttled_by_op": {}, "by_partition": {}, "span_secs": span}
        for (op, partition, kind, admitted), n in counts.items():
            out["requests"] += n
            out["by_op"][op] = out["by_op"].get(op, 0) + n
            if kind == "write":
                out["writes"] += n
            if admitted:
                if kind == "write":
                    out["by_partition"][partition] = out["by_partition"].get(partition, 0) + n
            else:
                out["throttled"] += n
                out["throttled_by_op"][op] = out["throttled_by_op"].get(op, 0) + n
                if kind == "write":
                    out["throttled_writes"] += n
        return out

    def reset(self) -> None:
        """Forget the recorded requests and counts (the limits and their buckets stay)."""
        with self.lock:
            self.requests.clear()
            self._counts.clear()
            self._first_secs = self._last_secs = None


class RateLimitProxyProcess:
    """:class:`RateLimitProxy` in a process of its own; :meth:`stats`, :meth:`reset` and
    :meth:`set_limits` talk to it over its stdin/stdout (it keeps no per-request records, only
    the counts).

    Args:
        upstream (str): the S3 server's endpoint URL.
        limits (RateLimits): what to enforce.

    Attributes:
        endpoint_url (str): where clients connect.
        pid (int): the proxy's process id.
    """

    def __init__(self, upstream: str, limits: RateLimits) -> None:
        self._control = ControlledProcess([sys.executable, "-m", "opd_testkit.rate_limit", upstream, limits.to_json()],
                                          "rate-limit proxy")
        self.process, self.endpoint_url, self.pid = self._control.process, self._control.endpoint_url, self._control.pid

    def _ask(self, command: str) -> str:
        return self._control.ask(command)

    def stats(self) -> dict[str, Any]:
        return json.loads(self._ask("stats"))

    def reset(self) -> None:
        self._ask("reset")

    def set_limits(self, limits: RateLimits) -> None:
        self._ask("limits " + limits.to_json())

    def stop(self) -> None:
        self._control.stop()


class _CountingOnly(RateLimitProxy):
    """The proxy of :class:`RateLimitProxyProcess`: counts, but keeps no per-request records
    (tens of thousands of requests per benchmark run)."""

    def _decide(self, record: Request) -> tuple | None:
        decision = super()._decide(record)
        with self.lock:
            self.requests.clear()
        return decision


def main(argv: list[str] | None = None) -> None:
    """``python -m opd_testkit.rate_limit UPSTREAM LIMITS_JSON``: serve until stdin closes; prints
    ``PORT <n>``, then answers ``stats`` (one JSON line), ``reset`` and ``limits <json>``."""
    parser = argparse.ArgumentParser(prog="python -m opd_testkit.rate_limit")
    parser.add_argument("upstream")
    parser.add_argument("limits")
    args = parser.parse_args(argv)
    proxy = _CountingOnly(args.upstream, RateLimits.from_json(args.limits))
    print(f"PORT {proxy.endpoint_url.rsplit(':', 1)[1]}", flush=True)
    for line in sys.stdin:
        command, _, rest = line.strip().partition(" ")
        if command == "stats":
            print(json.dumps(proxy.stats()), flush=True)
        elif command == "reset":
            proxy.reset()
            print("ok", flush=True)
        elif command == "limits":
            proxy.set_limits(RateLimits.from_json(rest))
            print("ok", flush=True)
    proxy.stop()
    os._exit(0)


__all__ = ["AWS_PREFIX_READS_PER_SEC", "AWS_PREFIX_WRITES_PER_SEC", "UNPARTITIONED", "RateLimitProxy",
           "RateLimitProxyProcess", "RateLimits", "RequestRateLimiter", "request_key"]

if __name__ == "__main__":
    main()
