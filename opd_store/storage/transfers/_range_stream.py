"""A streaming reader of one object over several connections at once, in bounded memory:
:class:`RangeStream`.

A copy of a checkpoint (``opd-store cp``, the local tier's upload, ``opd-store migrate``) moves each
payload from one store to another without holding it whole: a 16 GB payload must not need 16 GB
of memory. One GET is one connection, and a real object store gives each connection a bounded
share of bandwidth (AWS S3: roughly 50-100 MB/s; its performance guidelines recommend parallel
ranged requests), so the reader here fetches the object as consecutive ranges of
``part_size_bytes``, keeps up to ``parts_in_flight`` of them in flight at once on the client's
event loop, each into its own part buffer, and hands the bytes out in order through
:meth:`RangeStream.readinto` and :meth:`RangeStream.read`. Memory is at most ``parts_in_flight x
part_size_bytes`` of part buffers, taken from and given back to the store's read pool
(:meth:`opd_store.storage._base.Storage.read_pool`, a :class:`~opd_store.storage.transfers._parts.PartPool`), so
a copy of many payloads reuses the same buffers; a range is fetched again into the buffer the
reader has just finished with.

The reader is generic over one asynchronous function, :data:`FetchRange`: ``await fetch(start,
view)`` fills ``view`` with the object's bytes ``[start, start + len(view))`` or raises.
:func:`range_fetcher` makes one from a backend's ``open_range`` (the interface of
:mod:`opd_store.storage.transfers._ranged_reads`: S3's in :mod:`opd_store.storage.s3._reads`, GCS's in
:mod:`opd_store.storage.gcs._reads`), run on that client's event loop.

The reader checks no checksum: the copy computes the CRC32C over the bytes it is handed and
compares size and CRC32C with the manifest before anything is committed
(:func:`opd_store.store._copy.copy_checkpoint`). It does check the length of every range: a short
range, or an object that is not ``size_bytes`` long, is an :class:`~opd_store.errors.IntegrityError`
naming the object and the range (raised by the fetcher).

Closing the reader (at the end, or early after a failure) cancels the ranges still in flight and
waits on the event loop until every one of them has settled, so that no task is left running, no
buffer is written after it went back to the pool and no coroutine is left unawaited.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import io
from typing import Any, Awaitable, Callable

from ...errors import IntegrityError
from ._parts import PartPool

FetchRange = Callable[[int, memoryview], Awaitable[None]]
"""``await fetch(start, view)``: fill ``view`` (``memoryview`` of unsigned bytes) with the object's
bytes ``[start, start + view.nbytes)``. Raises :class:`~opd_store.errors.IntegrityError` for a short
range or an object of another size, and the backend's own failures otherwise."""


@dataclasses.dataclass
class _Range:
    """One range of the object: where it starts, the pool buffer it lands in, its view (the
    buffer cut to the range's length), the asyncio task fetching it and a thread-safe future set
    when that task settles."""

    start: int
    buffer: bytearray
    view: memoryview
    done: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    task: "asyncio.Task | None" = None


def _settle_into(done: concurrent.futures.Future, task: "asyncio.Task") -> None:
    """Copy a finished task's outcome into ``done`` (on the event loop's thread)."""
    if task.cancelled():
        done.cancel()
    elif task.exception() is not None:
        done.set_exception(task.exception())
    else:
        done.set_result(None)


async def _launch(fetch: FetchRange, piece: _Range) -> "asyncio.Task":
    task = asyncio.ensure_future(fetch(piece.start, piece.view))
    task.add_done_callback(functools.partial(_settle_into, piece.done))
    return task


async def _cancel_all(tasks: list["asyncio.Task"]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class RangeStream(io.RawIOBase):
    """A forward-only binary reader of ``size_bytes`` of one object, fetched as parallel ranges.

    The first ``parts_in_flight`` ranges start when the reader is made; each range the reader has
    handed out completely frees its buffer for the next range.

    Args:
        loop (asyncio.AbstractEventLoop): the event loop ``fetch`` runs on, running in another
            thread (s3fs's or gcsfs's ``fs.loop``).
        fetch (FetchRange): fills one range.
        url (str): the object's URL (for messages).
        size_bytes (int): bytes to read (the manifest's size of the payload), >= 0.
        pool (PartPool): where the part buffers come from (their size is the range size).
        parts_in_flight (int): ranges fetched at once (>= 1).
        translate (Callable[[BaseException], BaseException | None] | None): turns a fetch's
            failure into the error raised to the reader (``None``: raise it as it is); the store's
            translation of an unreachable endpoint
            (:meth:`opd_store.storage._fsspec.FsspecStorage.unreachable_error`).

    Reads raise:
        IntegrityError: a range came back short, or the object is not ``size_bytes`` long
            (naming the object and the range).
        OSError: the backend's failure after its retries (a missing object: ``FileNotFoundError``;
            an unreachable endpoint: :class:`~opd_store.errors.StoreUnreachableError` when
            ``translate`` says so).
        ValueError: a read after :meth:`close`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, fetch: FetchRange, url: str, size_bytes: int,
                 pool: PartPool, parts_in_flight: int, *,
                 translate: Callable[[BaseException], BaseException | None] | None = None) -> None:
        super().__init__()
        if size_bytes < 0 or parts_in_flight < 1:
            raise ValueError(f"{url}: cannot stream {size_bytes} bytes with {parts_in_flight} ranges in flight")
        self.url = url
        self.size_bytes = size_bytes
        self._loop = loop
        self._fetch = fetch
        self._pool = pool
        self._parts_in_flight = parts_in_flight
        self._translate = translate
        self._ranges: collections.deque[_Range] = collections.deque()
        self._next_start = 0  # first byte of the next range to launch
        self._offset = 0  # bytes of the head range already handed out
        self._position = 0
        self._failure: BaseException | None = None
        self.ranges_started = 0
        self._fill()

    # -- ranges --------------------------------------------------------------------------------
    def _fill(self) -> None:
        """Launch ranges until ``parts_in_flight`` are held or the object is covered."""
        from fsspec.asyn import sync

        part_size = self._pool.part_size_bytes
        while len(self._ranges) < self._parts_in_flight and self._next_start < self.size_bytes:
            start = self._next_start
            buffer = self._pool.acquire()
            piece = _Range(start, buffer, memoryview(buffer)[:min(part_size, self.size_bytes - start)])
            self._ranges.append(piece)  # before launching: close() must see every buffer taken
            self._next_start += piece.view.nbytes
            piece.task = sync(self._loop, _launch, self._fetch, piece)
            self.ranges_started += 1

    def _head(self) -> _Range:
        """The range the reader is at, once fetched; its failure raised (translated)."""
        head = self._ranges[0]
        try:
            head.done.result()
        except BaseException as exc:
            translated = self._translate(exc) if self._translate is not None and isinstance(exc, Exception) else None
            self._failure = translated or exc
            if translated is not None:
                raise translated from exc
            raise
        return head

    # -- file protocol -------------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        """Copy the next bytes into ``target`` (filled whole unless the object ends first).

        Returns:
            int: bytes copied; 0 at the end of the object.

        Raises:
            See the class docstring.
        """
        if self.closed:
            raise ValueError(f"read from a closed range reader ({self.url})")
        if self._failure is not None:
            raise self._failure
        out = memoryview(target).cast("B")
        written = 0
        while written < out.nbytes and self._ranges:
            head = self._head()
            count = min(out.nbytes - written, head.view.nbytes - self._offset)
            out[written:written + count] = head.view[self._offset:self._offset + count]
            written += count
            self._offset += count
            if self._offset == head.view.nbytes:
                self._ranges.popleft()
                self._offset = 0
                head.view.release()
                self._pool.release(head.buffer, was_flying=False)
                self._fill()
        self._position += written
        return written

    def read(self, size: int = -1) -> bytes:
        """The next ``size`` bytes (all the rest when ``size`` is negative); ``b""`` at the end."""
        left = self.size_bytes - self._position
        buffer = bytearray(left if size is None or size < 0 else min(size, left))
        count = self.readinto(buffer)
        del buffer[count:]
        return bytes(buffer)

    def readall(self) -> bytes:
        return self.read()

    def tell(self) -> int:
        return self._position

    def close(self) -> None:
        """Cancel the ranges in flight, wait until each has settled, give every buffer back."""
        if self.closed:
            return
        try:
            tasks = [piece.task for piece in self._ranges if piece.task is not None and not piece.done.done()]
            if tasks and self._loop.is_running() and not self._loop.is_closed():
                from fsspec.asyn import sync

                sync(self._loop, _cancel_all, tasks)
        finally:
            while self._ranges:
                piece = self._ranges.popleft()
                piece.view.release()
                self._pool.release(piece.buffer, was_flying=False)
            super().close()


def range_fetcher(open_range: Callable[[int, int], Awaitable[Any]], url: str, size_bytes: int) -> FetchRange:
    """The :data:`FetchRange` of an object of ``size_bytes`` over a backend's ``open_range(start,
    end)`` (:mod:`opd_store.storage.transfers._ranged_reads`: S3's ``GetObject``, GCS's ``alt=media``
    download, with their clients' retries): each range read by the shared range loop, a body cut
    mid-way read again.

    The fetcher raises :class:`~opd_store.errors.IntegrityError` naming ``url`` and the range when
    the range comes back short or ``Content-Range`` says the object is not ``size_bytes`` long.
    """
    from ._ranged_reads import OtherSize, _read_range

    async def fetch(start: int, view: memoryview) -> None:
        try:
            await _read_range(open_range, url, view, start, size_bytes)
        except OtherSize as other:
            found = f"has {other.size_bytes} bytes" if other.size_bytes >= 0 else "ends before it"
            raise IntegrityError(f"{url}: a ranged read of bytes {start}-{start + view.nbytes - 1} found that the "
                                 f"object {found}, expected {size_bytes}") from None

    return fetch


__all__ = ["FetchRange", "RangeStream", "range_fetcher"]
