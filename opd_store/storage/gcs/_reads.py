"""Parallel GCS reads over gcsfs's event loop and aiohttp session: :func:`read_checked`.

gcsfs's ``cat_file`` reads a whole answer into ``bytes`` (``await response.read()``) and joins
concurrent ranges into one more copy. Here an object is read with ranged media downloads (``GET
.../download/storage/v1/b/B/o/K?alt=media`` with a ``Range`` header; GCS docs, "Download objects":
ranged downloads answer ``206`` with ``Content-Range``), sent on gcsfs's own aiohttp session with its
credentials, endpoint and request timeout, and retried as gcsfs retries its own requests (5xx, 408
and 429, a connection error: up to 6 times with backoff). Each body is streamed from the socket into
its place in one preallocated buffer by the shared loop of :mod:`opd_store.storage.transfers._ranged_reads`
(ranges in flight, CRC32C as they land, short ranges and cut bodies).
"""

from __future__ import annotations

from ..transfers import MemoryReader, OtherSize, TransferSettings
from ..transfers import read_checked as read_all_checked

RANGE_NOT_SATISFIABLE = 416
"""A range that starts past the object's end (RFC 9110; GCS answers it so): the object is shorter."""


class _GCSRangeBody:
    """One ranged download's response as a :class:`~opd_store.storage.transfers._ranged_reads.RangeBody`."""

    def __init__(self, response) -> None:
        self._response = response
        self.total_bytes = int(response.headers.get("Content-Range", "").rpartition("/")[2] or -1)

    async def readinto(self, view: memoryview) -> int:
        # At most what the view holds, as aiohttp received it (no copy but the one into the buffer).
        data = await self._response.content.read(view.nbytes)
        view[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._response.release()


def _headers(fs, start: int, end: int) -> dict[str, str]:
    """The ranged download's headers with gcsfs's credentials applied."""
    headers = {"Range": f"bytes={start}-{end - 1}"}
    fs.credentials.apply(headers)
    return headers


def read_checked(fs, bucket: str, key: str, url: str, settings: TransferSettings,
                 size_bytes: int, requests=None) -> tuple[MemoryReader, int, str]:
    """The object read with parallel ranged downloads into one buffer of ``size_bytes``: a reader
    over it, the object's size and the CRC32C of the bytes read (8 hex digits).

    When the object is not ``size_bytes`` long, the size returned is its real one (from a fresh
    ``info``) and the reader is empty: the caller reports the mismatch.

    Args:
        fs: the store's ``gcsfs.GCSFileSystem``.
        bucket (str), key (str): the object.
        url (str): the object's URL (for messages).
        settings (TransferSettings): range size and ranges in flight.
        size_bytes (int): the size expected (the manifest's).
        requests (RequestTally | None): counts each ranged download (:func:`range_opener`).

    Raises:
        IntegrityError: a range came back short (names the object and the range).
        OSError: the backend's failure after gcsfs's retries (a missing object:
            ``FileNotFoundError``; a refusal: ``OSError("Forbidden: ...")``).
    """
    return read_all_checked(fs, f"{bucket}/{key}", url, settings, size_bytes,
                            range_opener(fs, bucket, key, requests=requests))


def range_opener(fs, bucket: str, key: str, requests=None):
    """``open_range(start, end)`` of the GCS object ``bucket/key`` (one ranged ``alt=media``
    download on gcsfs's session, with gcsfs's retries; 416 raises ``OtherSize(-1)``): the
    :mod:`opd_store.storage.transfers._ranged_reads` interface, shared with the copies' reader
    (:mod:`opd_store.storage.transfers._range_stream`). ``requests`` (a
    :class:`~opd_store.storage._request_tally.RequestTally`) counts one ``get`` per range, its
    retries included once: these downloads bypass gcsfs's ``_request``, where the store counts
    the rest."""
    from gcsfs.retry import retry_request, validate_response

    path = f"{bucket}/{key}"
    media_url = fs.url(path)

    @retry_request(retries=fs.retries)
    async def open_range(start: int, end: int) -> _GCSRangeBody:
        session = await fs._set_session()
        params = {}
        if fs.requester_pays:  # as gcsfs bills a requester-pays bucket's reads
            params["userProject"] = fs.requester_pays if isinstance(fs.requester_pays, str) else fs.project
        response = await session.get(media_url, headers=_headers(fs, start, end), params=params,
                                     timeout=fs.requests_timeout)
        if response.status >= 400:
            try:
                if response.status == RANGE_NOT_SATISFIABLE:
                    raise OtherSize(-1)
                validate_response(response.status, await response.read(), path)
            finally:
                response.release()
        return _GCSRangeBody(response)

    if requests is None:
        return open_range

    async def counted_range(start: int, end: int) -> _GCSRangeBody:
        requests.add("get")
        return await open_range(start, end)

    return counted_range



__all__ = ["range_opener", "read_checked"]
