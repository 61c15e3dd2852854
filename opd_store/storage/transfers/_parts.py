"""Parallel transfers' shared parts: their settings, a pool of reusable part buffers, a reader over
one buffer, and the completion of a publish that runs in the background.

Real object stores give each connection a bounded share of bandwidth (AWS S3: roughly 50-100 MB/s
per connection; its performance guidelines recommend parallel ranged requests and multipart parts
of 8-16 MB); a payload moves at the network's speed only over several connections at once. The
S3 writer and reader (:mod:`opd_store.storage.s3._multipart`, :mod:`opd_store.storage.s3._reads`)
cut a payload into parts of :attr:`TransferSettings.part_size_bytes` and keep up to
:attr:`TransferSettings.parts_in_flight` of them moving at once.

Memory stays bounded: an upload copies the bytes it is handed into part buffers from one
:class:`PartPool` per store, whose ``parts_in_flight`` buffers are reused from save to save, so a
save never holds more than ``parts_in_flight x part_size_bytes`` of upload buffers however large
its payloads are (docs/performance.md measures peak RSS against ``state + K x part + 64 MiB``). A
download fills one preallocated buffer in place (:class:`MemoryReader` serves it without a copy).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import logging
import threading
from typing import Any, Callable

from ._pacing import DEFAULT_THROTTLE_TIMEOUT_SECS, Pacer

logger = logging.getLogger("opd_store.storage")

DEFAULT_PART_SIZE_BYTES = 16 << 20
"""Default part size: within S3's guidance of 8-16 MB parts, well above its 5 MiB minimum."""
DEFAULT_PARTS_IN_FLIGHT = 8
"""Default parts (upload) or ranges (download) in flight per store."""
DEFAULT_THROTTLE_WARN_SHARE = 0.25
"""Default share of a save's time spent throttled above which the save logs a warning."""
MIN_PART_SIZE_BYTES = 5 << 20
"""S3's smallest part (every part of a multipart upload but the last; ``EntityTooSmall`` below it)."""
MAX_PARTS = 10_000
"""S3's most parts in one multipart upload."""


@dataclasses.dataclass(frozen=True)
class TransferSettings:
    """How a remote store moves a payload: storage options ``part_size_bytes``,
    ``parts_in_flight``, ``throttle_timeout_secs`` and ``throttle_warn_share`` (opd_store's own; never
    passed to fsspec).

    Attributes:
        part_size_bytes (int): bytes per multipart part and per ranged GET (>= 5 MiB). A payload of
            at most one part goes up in one request.
        parts_in_flight (int): the most parts (or ranges) moving at once per store, across its
            payloads (>= 1); uploads send fewer while the store throttles
            (:mod:`opd_store.storage.transfers._pacing`). Upload memory is at most
            ``parts_in_flight x part_size_bytes``.
        throttle_timeout_secs (float): seconds from a request's first refusal for the store's rate
            after which a refusal fails it (>= 0; 300 by default): the save then fails like any
            failed part (:mod:`opd_store.storage.transfers._pacing`).
        throttle_warn_share (float): a save that spent more than this share of its time throttled
            logs a warning (0 to 1).
        min_part_size_bytes (int): the server's smallest part, S3's 5 MiB; not a storage option (a
            simulation against a server configured with a smaller one lowers it, ``bench/``).
    """

    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES
    parts_in_flight: int = DEFAULT_PARTS_IN_FLIGHT
    throttle_timeout_secs: float = DEFAULT_THROTTLE_TIMEOUT_SECS
    throttle_warn_share: float = DEFAULT_THROTTLE_WARN_SHARE
    min_part_size_bytes: int = MIN_PART_SIZE_BYTES

    def __post_init__(self) -> None:
        for name, low in (("min_part_size_bytes", 1), ("part_size_bytes", self.min_part_size_bytes),
                          ("parts_in_flight", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"storage option {name} must be an integer >= {low}, got {value!r}")
        timeout = self.throttle_timeout_secs
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
            raise ValueError(f"storage option throttle_timeout_secs must be a number of seconds >= 0, got {timeout!r}")
        share = self.throttle_warn_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"storage option throttle_warn_share must be a number from 0 to 1, got {share!r}")

    @classmethod
    def pop_from(cls, options: dict[str, Any]) -> "TransferSettings":
        """The settings named in ``options`` (defaults for the others), removed from ``options``.

        Without ``part_size_bytes``, s3fs's own upload block option ``default_block_size`` (when
        given, and at least 5 MiB) is the part size: a store keeps the part size its client was
        configured with.

        Raises:
            ValueError: a setting that is not a number in range (the message names the option).
        """
        block = options.get("default_block_size")
        fallback = block if isinstance(block, int) and block >= MIN_PART_SIZE_BYTES else DEFAULT_PART_SIZE_BYTES
        return cls(part_size_bytes=options.pop("part_size_bytes", fallback),
                   parts_in_flight=options.pop("parts_in_flight", DEFAULT_PARTS_IN_FLIGHT),
                   throttle_timeout_secs=options.pop("throttle_timeout_secs", DEFAULT_THROTTLE_TIMEOUT_SECS),
                   throttle_warn_share=options.pop("throttle_warn_share", DEFAULT_THROTTLE_WARN_SHARE))

    def part_size_for(self, size_bytes: int) -> int:
        """The part size for an object of ``size_bytes``: the setting, grown so that the object
        needs at most :data:`MAX_PARTS` parts."""
        part = self.part_size_bytes
        while size_bytes > part * MAX_PARTS:
            part *= 2
        return part


class PartPool:
    """Part buffers (``bytearray`` of ``part_size_bytes``), reused, at most ``count`` in use at once.

    :meth:`acquire` blocks while ``count`` buffers are in use and one of them is in flight (its
    upload will give it back). When every buffer in use is still being filled (several writers
    open in one thread), waiting could never end, so the pool lends one more buffer instead.
    """

    def __init__(self, part_size_bytes: int, count: int) -> None:
        self.part_size_bytes = part_size_bytes
        self.count = count
        self._free: list[bytearray] = []
        self._in_use = 0
        self._in_flight = 0
        self._allocated = 0
        self._peak_in_use = 0
        self._cond = threading.Condition()

    def acquire(self) -> bytearray:
        """A buffer for filling (blocks while ``count`` are in use and one is in flight)."""
        with self._cond:
            while not self._free and self._in_use >= self.count and self._in_flight > 0:
                self._cond.wait()
            self._in_use += 1
            self._peak_in_use = max(self._peak_in_use, self._in_use)
            if self._free:
                return self._free.pop()
            self._allocated += 1
            lending = self._in_use > self.count
        if lending:
            logger.debug("part pool: more than %d buffers in use, none in flight: lending one more", self.count)
        return bytearray(self.part_size_bytes)

    def flying(self) -> None:
        """One buffer that was being filled is now in flight (an upload will :meth:`release` it)."""
        with self._cond:
            self._in_flight += 1

    def release(self, buffer: bytearray, *, was_flying: bool) -> None:
        """Give a buffer back (from any thread); ``was_flying`` when :meth:`flying` was called for it."""
        with self._cond:
            self._in_use -= 1
            if was_flying:
                self._in_flight -= 1
            if len(buffer) == self.part_size_bytes and len(self._free) + self._in_use < self.count:
                self._free.append(buffer)
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        """Buffers ``in_use`` (being filled or in flight), ``in_flight``, ``free`` (kept for reuse),
        ``allocated`` (made since the pool was, reuse excluded) and ``peak_in_use``."""
        with self._cond:
            return {"in_use": self._in_use, "in_flight": self._in_flight, "free": len(self._free),
                    "allocated": self._allocated, "peak_in_use": self._peak_in_use}


class MemoryReader(io.RawIOBase):
    """A seekable binary reader over one buffer (``bytearray``, ``mmap``...), without copying it.

    ``readinto`` copies straight into the caller's buffer, ``read`` returns ``bytes``.

    Args:
        buffer: the bytes to serve (any object with the buffer protocol).
        lend_buffer (bool): the buffer is a ``bytearray`` made for this reader alone (a download)
            and never reused: :meth:`lendable_buffer` hands it out, so that
            :func:`opd_store.format._torch_io.weights_only_load` makes the loaded tensors views of it
            instead of copies. Never set it for a buffer that is reused (a pool's part buffer):
            tensors viewing it would change when it is refilled.
    """

    def __init__(self, buffer, *, lend_buffer: bool = False) -> None:
        super().__init__()
        self._buffer = buffer
        self._view = memoryview(buffer).cast("B")
        self._pos = 0
        self._lend = lend_buffer and isinstance(buffer, bytearray)

    def lendable_buffer(self) -> bytearray | None:
        """The whole buffer, for tensors to view, when the reader was made with ``lend_buffer`` and
        is open; else ``None``. Whoever keeps a view keeps the memory alive (the buffer is freed
        when the last view is), and the reader's own reads are unaffected."""
        return self._buffer if self._lend and not self.closed else None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        if self.closed:
            raise ValueError("read from a closed MemoryReader")
        out = memoryview(target).cast("B")
        count = max(0, min(out.nbytes, self._view.nbytes - self._pos))
        out[:count] = self._view[self._pos:self._pos + count]
        self._pos += count
        return count

    def read(self, size: int = -1) -> bytes:
        if self.closed:
            raise ValueError("read from a closed MemoryReader")
        end = self._view.nbytes if size is None or size < 0 else min(self._view.nbytes, self._pos + size)
        data = bytes(self._view[self._pos:end])
        self._pos = max(self._pos, end)
        return data

    def readall(self) -> bytes:
        return self.read()

    def read_view(self, size: int) -> memoryview:
        """The next ``size`` bytes (fewer at the end, empty past it) as a view of the buffer, without
        a copy; the position moves past them. The view is valid while the buffer is (a pool's part
        buffer: until the request that reads it has settled)."""
        if self.closed:
            raise ValueError("read from a closed MemoryReader")
        end = min(self._view.nbytes, self._pos + max(0, size))
        view = self._view[self._pos:end]
        self._pos = max(self._pos, end)
        return view

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed:
            self._view.release()
            self._buffer = None
        super().close()


class Completion:
    """A publish running in the background: :meth:`wait` returns once the object is published or
    raises why it was not. A synchronous backend's completion is done when it is made."""

    def __init__(self, future: concurrent.futures.Future | None = None) -> None:
        self._future = future

    @classmethod
    def now(cls, publish: Callable[[], None]) -> "Completion":
        """Run ``publish`` now; its exception propagates (nothing runs in the background)."""
        publish()
        return cls(None)

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> None:
        """Block until published.

        Raises:
            Exception: whatever made the publish fail (the object is then not published, and its
                writer has already discarded what it uploaded).
        """
        if self._future is not None:
            self._future.result()


class Transfers:
    """How one store moves payloads: its :class:`TransferSettings`, its two pools of
    ``parts_in_flight`` buffers of ``part_size_bytes`` (allocated on first use), one for uploads and
    one for copy readers (``Storage.open_read_stream``), so a reader never waits for an upload, and
    the pacing of its uploads under throttling.

    A :class:`~opd_store.storage.Storage` holds one (``storage.transfers``); ``open_storage`` gives
    it the settings of the storage options before the first transfer.

    Attributes:
        settings (TransferSettings): part size, parts in flight, throttling settings.
        part_pool (PartPool): the upload part buffers (the bound on upload memory).
        read_pool (PartPool): the copy readers' buffers.
        pacer (Pacer): how many upload requests fly at once, and the back-off of throttled ones.
    """

    def __init__(self, settings: TransferSettings | None = None) -> None:
        self.settings = settings or TransferSettings()
        size, count = self.settings.part_size_bytes, self.settings.parts_in_flight
        self.part_pool = PartPool(size, count)
        self.read_pool = PartPool(size, count)
        self.pacer = Pacer(count, throttle_timeout_secs=self.settings.throttle_timeout_secs)


__all__ = ["Completion", "DEFAULT_PARTS_IN_FLIGHT", "DEFAULT_PART_SIZE_BYTES",
           "DEFAULT_THROTTLE_WARN_SHARE", "MAX_PARTS", "MIN_PART_SIZE_BYTES", "MemoryReader", "PartPool",
           "TransferSettings", "Transfers"]
