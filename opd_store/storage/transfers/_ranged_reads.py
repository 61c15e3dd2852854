"""Parallel ranged reads of one object into one buffer, whatever the backend: :func:`read_checked`.

A backend supplies one coroutine function, ``open_range(start, end) -> RangeBody``, that sends a
ranged GET of bytes ``start .. end - 1`` on its own client (S3: :mod:`opd_store.storage.s3._reads`;
GCS: :mod:`opd_store.storage.gcs._reads`). The rest is shared: the object is cut into ranges of
``part_size_bytes``, up to ``parts_in_flight`` of them are in flight at once (AWS's performance
guidelines recommend parallel ranged requests; GCS's "Request rate and access distribution
guidelines" recommend the same sliced downloads), each body is streamed into its place in one
preallocated buffer (no copy per range), and the CRC32C is computed over the ranges in order as they
land. A range that answers with fewer bytes than it asked for is an
:class:`~opd_store.errors.IntegrityError` naming the object and the range; a body cut mid-way is
read again (at most :data:`RANGE_ATTEMPTS` times; the request itself is retried by the client).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from ...errors import IntegrityError
from ...format import Crc32c
from .._backend_errors import Meaning, classify
from ._parts import MemoryReader, TransferSettings

logger = logging.getLogger("opd_store.storage")

RANGE_ATTEMPTS = 3
"""Attempts per range whose body was cut mid-way (the request itself is retried by the client)."""


class OtherSize(Exception):
    """The object is not as long as expected: its real length (``-1``: unknown, ask the store)."""

    def __init__(self, size_bytes: int) -> None:
        super().__init__(size_bytes)
        self.size_bytes = size_bytes


class RangeBody(Protocol):
    """The answer to one ranged GET, as a backend's ``open_range`` returns it.

    Attributes:
        total_bytes (int): the object's whole length from the answer's ``Content-Range``
            (``-1`` when the answer names none).
    """

    total_bytes: int

    async def readinto(self, view: memoryview) -> int:
        """Copy the next bytes of the body into ``view``; how many (0 at the end of the body)."""

    def close(self) -> None:
        """Release the connection (also when the body was not read to its end)."""


async def _read_range(open_range, url: str, view: memoryview, start: int, size_bytes: int) -> None:
    """Fetch bytes ``start .. start + len(view)`` of the object into ``view``.

    Raises:
        OtherSize: the object is not ``size_bytes`` long.
        IntegrityError: the range came back short.
        Exception: the client's failure after its retries, or a body cut :data:`RANGE_ATTEMPTS` times.
    """
    end = start + view.nbytes
    for attempt in range(1, RANGE_ATTEMPTS + 1):
        body = await open_range(start, end)
        try:
            if body.total_bytes != size_bytes:
                raise OtherSize(body.total_bytes)
            got = 0
            while got < view.nbytes:
                count = await body.readinto(view[got:])
                if count == 0:
                    break
                got += count
            if got != view.nbytes:
                raise IntegrityError(f"{url}: a ranged read of bytes {start}-{end - 1} returned {got} bytes "
                                     f"instead of {view.nbytes}")
            return
        except (IntegrityError, OtherSize):
            raise
        except Exception as exc:  # noqa: BLE001 - a body cut mid-way: the range again
            if attempt == RANGE_ATTEMPTS or classify(exc) in (Meaning.NOT_FOUND, Meaning.DENIED):
                raise
            logger.debug("%s: range %d-%d cut (%r); reading it again", url, start, end - 1, exc)
        finally:
            body.close()


async def read_ranges(open_range, url: str, settings: TransferSettings, size_bytes: int, buffer: bytearray) -> str:
    """Every range of the object (``size_bytes`` > 0) read into ``buffer``; the CRC32C (8 hex digits).

    Raises:
        OtherSize, IntegrityError, Exception: as :func:`_read_range`; the other ranges in flight are
            cancelled first.
    """
    view = memoryview(buffer)
    part = settings.part_size_for(size_bytes)
    starts = list(range(0, size_bytes, part))
    slots = asyncio.Semaphore(settings.parts_in_flight)
    landed = [False] * len(starts)
    crc = Crc32c()
    next_unchecked = 0

    async def one(index: int) -> None:
        nonlocal next_unchecked
        start = starts[index]
        async with slots:
            await _read_range(open_range, url, view[start:start + part], start, size_bytes)
        landed[index] = True
        while next_unchecked < len(starts) and landed[next_unchecked]:  # CRC32C in order, as ranges land
            first = starts[next_unchecked]
            crc.update(view[first:first + part])
            next_unchecked += 1

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(starts))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        view.release()
    return crc.hexdigest()


def read_checked(fs, path: str, url: str, settings: TransferSettings, size_bytes: int,
                 open_range) -> tuple[MemoryReader, int, str]:
    """The object read with parallel ranged GETs into one buffer of ``size_bytes``: a reader over
    it, the object's size and the CRC32C of the bytes read (8 hex digits).

    When the object is not ``size_bytes`` long, the size returned is its real one (from a fresh
    ``info``) and the reader is empty: the caller reports the mismatch.

    Args:
        fs: the store's asynchronous fsspec filesystem (its ``loop`` runs the ranges; its ``info``
            answers the real size).
        path (str): the object in the filesystem's spelling (``bucket/key``).
        url (str): the object's URL (for messages).
        settings (TransferSettings): range size and ranges in flight.
        size_bytes (int): the size expected (the manifest's).
        open_range: ``async (start, end) -> RangeBody``, one ranged GET on ``fs``'s client; it raises
            :class:`OtherSize` for a range the object does not have (HTTP 416).

    Raises:
        IntegrityError: a range came back short (names the object and the range).
        OSError: the backend's failure after its retries (a missing object: ``FileNotFoundError``).
    """
    from fsspec.asyn import sync

    if not size_bytes:
        fs.invalidate_cache(path)
        actual = int(fs.info(path).get("size") or 0)
        return MemoryReader(b""), actual, Crc32c().hexdigest()
    buffer = bytearray(size_bytes)
    try:
        crc = sync(fs.loop, read_ranges, open_range, url, settings, size_bytes, buffer)
    except OtherSize as other:
        actual = other.size_bytes
        if actual < 0:
            fs.invalidate_cache(path)
            actual = int(fs.info(path).get("size") or 0)
        return MemoryReader(b""), actual, ""
    return MemoryReader(buffer, lend_buffer=True), size_bytes, crc


__all__ = ["OtherSize", "RANGE_ATTEMPTS", "RangeBody", "read_checked", "read_ranges"]
