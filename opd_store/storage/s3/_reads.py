"""Parallel S3 reads over s3fs's asynchronous API: :func:`read_checked`.

s3fs's ``cat_file`` is one GET, or ranges gathered into per-range copies. Here an object is read
with ranged ``GetObject`` requests on s3fs's own event loop and client (its credentials, endpoint,
timeouts and botocore's retries), each body streamed into its place in one preallocated buffer by
the shared loop of :mod:`opd_store.storage.transfers._ranged_reads` (ranges in flight, CRC32C as they land,
short ranges and cut bodies).
"""

from __future__ import annotations

from .._backend_errors import s3_error_code
from ..transfers import MemoryReader, OtherSize, TransferSettings
from ..transfers import read_checked as read_all_checked


class _S3RangeBody:
    """One ``GetObject`` answer as a :class:`~opd_store.storage.transfers._ranged_reads.RangeBody`."""

    def __init__(self, answer: dict) -> None:
        self._body = answer["Body"]
        self.total_bytes = int(str(answer.get("ContentRange", "")).rpartition("/")[2] or -1)

    async def readinto(self, view: memoryview) -> int:
        return await self._body.readinto(view)

    def close(self) -> None:
        self._body.close()


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

    return read_all_checked(fs, f"{bucket}/{key}", url, settings, size_bytes, range_opener(fs, bucket, key))


def range_opener(fs, bucket: str, key: str):
    """``open_range(start, end)`` of the S3 object ``bucket/key`` (one ranged ``GetObject`` on
    s3fs's client; a range past the object's end raises ``OtherSize(-1)``): the
    :mod:`opd_store.storage.transfers._ranged_reads` interface, shared with the copies' reader
    (:mod:`opd_store.storage.transfers._range_stream`)."""

    async def open_range(start: int, end: int) -> _S3RangeBody:
        try:
            answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        except Exception as exc:  # noqa: BLE001 - a range past the end: the object is shorter
            if s3_error_code(exc) == "InvalidRange":
                raise OtherSize(-1) from exc
            raise
        return _S3RangeBody(answer)

    return open_range

__all__ = ["range_opener", "read_checked"]
