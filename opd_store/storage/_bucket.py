"""Object stores (S3, GCS): their shared base :class:`BucketStorage`, and the store's clock.

A bucket store's manifest is one conditional request (each backend's module says which), and its
payloads move over several connections: uploads through :mod:`opd_store.storage.transfers`' part
writer, reads as parallel ranged GETs into one buffer and, for copies,
:mod:`opd_store.storage.transfers._range_stream`.

**The store's clock** is the ``Date`` header of a response from the server (S3 and GCS send one on
every response, RFC 9110: the time the response was generated), truncated to the second, so the
clock reads at most one second early: an age computed against it is never overstated.
"""

from __future__ import annotations

import email.utils
import logging
import time
from typing import TYPE_CHECKING, BinaryIO

from ._fsspec import FsspecStorage

if TYPE_CHECKING:
    from ._base import Storage

logger = logging.getLogger("opd_store.storage")


class BucketStorage(FsspecStorage):
    """An object store whose fsspec ``pipe_file(mode="create")`` is one conditional request."""

    atomic_create = True
    bucketed = True

    def create_exclusive(self, rel: str, data: bytes) -> None:
        # Small data only (a manifest): both s3fs and gcsfs send it as one request, to which the
        # precondition applies; above their chunk sizes they would switch to multipart/resumable.
        self.fs.pipe_file(self.path(rel), data, mode="create")
        self.refresh()

    def _range_stream(self, rel: str, size_bytes: int, range_opener) -> BinaryIO:
        """:meth:`open_read_stream` over the backend's ``range_opener(fs, bucket, key)``: ranges in
        flight into the read pool's buffers (:mod:`opd_store.storage.transfers._range_stream`); an empty
        object is one plain stream (its size checked by the caller)."""
        if not size_bytes:
            return self.open_read(rel)
        from .transfers import RangeStream, range_fetcher

        bucket, _, key = self.path(rel).partition("/")
        url = self.url(rel)
        return RangeStream(self.fs.loop, range_fetcher(range_opener(self.fs, bucket, key), url, size_bytes), url,  # type: ignore[return-value]
                           size_bytes, self.transfers.read_pool, self.transfers.settings.parts_in_flight,
                           translate=lambda exc: self.unreachable_error(rel, "read", exc))

    # Payload writers are parallel part writers (opd_store.storage.transfers._part_writer): publishing runs in
    # the background, discarding removes what was uploaded.
    def start_finish(self, handle, rel: str):
        return handle.finish()

    def abort_write(self, handle, rel: str) -> None:
        handle.discard()

    def _expected_size(self, rel: str, size_bytes: int | None) -> int:
        """``size_bytes``, or the object's size asked of the store when the caller has none.

        Raises:
            FileNotFoundError: no such object.
        """
        if size_bytes is None:
            size_bytes = self.size(rel)
            if size_bytes is None:
                raise FileNotFoundError(f"{self.url(rel)}: no such object")
        return size_bytes


def bucket_and_prefix(storage: "Storage") -> tuple[str, str]:
    """The bucket of a bucket store and its key prefix (``""`` or ``"run/x/"``, ending in ``/``)."""
    bucket, _, prefix = storage.root.partition("/")
    return bucket, f"{prefix}/" if prefix else ""


def date_header_secs(value: str | None) -> float | None:
    """Seconds since the epoch of an HTTP ``Date`` header, or ``None`` when absent or malformed."""
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def server_clock(storage: "Storage", value: str | None) -> float:
    secs = date_header_secs(value)
    if secs is None:
        logger.warning("%s: the server sent no Date header; ages are measured on this machine's clock",
                       storage.url_root)
        return time.time()
    return secs


__all__ = ["BucketStorage", "bucket_and_prefix", "date_header_secs", "server_clock"]
