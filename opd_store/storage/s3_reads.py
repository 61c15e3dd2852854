"""Parallel S3 reads over s3fs's asynchronous API: :func:`read_checked`.

s3fs's ``cat_file`` is one GET, or ranges gathered into per-range copies. Here an object is read
with ranged GETs of ``part_size_bytes``, up to ``parts_in_flight`` at once, on s3fs's own event
loop and client (its credentials, endpoint, timeouts and retries), each streamed into its place in
one preallocated buffer (no copy per range; AWS's performance guidelines recommend parallel ranged
requests). The CRC32C is computed over the ranges in order as they land. A range that answers with
fewer bytes than it asked for is an :class:`~opd_store.errors.IntegrityError` naming the object
and the range; a body cut mid-way is read again (at most :data:`_RANGE_ATTEMPTS` times).
"""

from __future__ import annotations

import asyncio
import logging

from ..checksum import Crc32c
from ..errors import IntegrityError
from .backend_errors import Meaning, classify, s3_error_code
from .parts import MemoryReader, TransferSettings

logger = logging.getLogger("opd_store.storage")

_RANGE_ATTEMPTS = 3
"""Attempts per range whose body was cut mid-way (the request itself is retried by botocore)."""


class _OtherSize(Exception):
    """The object is not as long as expected: its real length (``-1``: unknown)."""

    def __init__(self, size_bytes: int) -> None:
        super().__init__(size_bytes)
        self.size_bytes = size_bytes


async def _read_range(fs, bucket: str, key: str, url: str, view: memoryview, start: int, size_bytes: int) -> None:
    """Fetch bytes ``start .. start + len(view)`` of the object into ``view``.

    Raises:
        _OtherSize: the object is not ``size_bytes`` long.
        IntegrityError: the range came back short.
    """
    end = start + view.nbytes
    for attempt in range(1, _RANGE_ATTEMPTS + 1):
        try:
            answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        except Exception as exc:  # noqa: BLE001 - a range past the end: the object is shorter
            if s3_error_code(exc) == "InvalidRange":
                raise _OtherSize(-1) from exc
            raise
        body = answer["Body"]
        try:
            total = int(str(answer.get("ContentRange", "")).rpartition("/")[2] or -1)
            if total != size_bytes:
                raise _OtherSize(total)
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
        except (IntegrityError, _OtherSize):
            raise
        except Exception as exc:  # noqa: BLE001 - a body cut mid-way: the range again
            if attempt == _RANGE_ATTEMPTS or classify(exc) in (Meaning.NOT_FOUND, Meaning.DENIED):
                raise
            logger.debug("%s: range %d-%d cut (%r); reading it again", url, start, end - 1, exc)
        finally:
            body.close()


async def _read_all(fs, bucket: str, key: str, url: str, settings: TransferSettings, size_bytes: int,
                    buffer: bytearray) -> str:
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
            await _read_range(fs, bucket, key, url, view[start:start + part], start, size_bytes)
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


def read_checked(fs, bucket: str, key: str, url: str, settings: TransferSettings,
                 size_bytes: int) -> tuple[MemoryReader, int, str]:
    """The object read with parallel ranged GETs into one buffer of ``size_bytes``: a reader over
    it, the object's size and the CRC32C of the bytes read (8 hex digits).

    When the object is not ``size_bytes`` long, the size returned is its real one (from a fresh
    ``HeadObject``) and the reader is empty: the caller reports the mismatch.

    Raises:
        IntegrityError: a range came back short (names the object and the range).
        OSError: the backend's failure after its retries (a missing object: ``FileNotFoundError``).
    """
    from fsspec.asyn import sync

    if not size_bytes:
        actual = int(fs.info(f"{bucket}/{key}", refresh=True).get("size") or 0)
        return MemoryReader(b""), actual, Crc32c().hexdigest()
    buffer = bytearray(size_bytes)
    try:
        crc = sync(fs.loop, _read_all, fs, bucket, key, url, settings, size_bytes, buffer)
    except _OtherSize as other:
        actual = other.size_bytes
        if actual < 0:
            fs.invalidate_cache()
            actual = int(fs.info(f"{bucket}/{key}", refresh=True).get("size") or 0)
        return MemoryReader(b""), actual, ""
    return MemoryReader(buffer), size_bytes, crc


__all__ = ["read_checked"]
