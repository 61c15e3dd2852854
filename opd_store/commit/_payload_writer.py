"""``PayloadWriter``: a write-only file for one payload, checksummed while the bytes stream through.

Size and CRC32C are computed on the bytes as they pass, never in a second pass; the writer hands
the backend zero-copy slices of at most ``storage.write_slice_bytes``. A writer never publishes
an object whose bytes did not all reach the backend (see :meth:`PayloadWriter.write`).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

from ..errors import OpdStoreError, PayloadUploadError, SaveAbandonedError, StoragePermissionError, StoreUnreachableError
from ..format import Crc32c, PayloadEntry
from ..runtime import kill_points
from ..storage import Meaning, backend_operation, classify

if TYPE_CHECKING:
    from ..storage import Storage
    from ..storage.transfers import Completion

logger = logging.getLogger("opd_store.commit")


class PayloadWriter:
    """A write-only binary file for one payload of a save attempt.

    ``torch.save(obj, writer)`` streams straight into the backend object: no full serialised copy
    is held in memory (s3fs/gcsfs buffer one upload block, local files write through).

    Attributes:
        name (str): the payload's name inside the attempt.
        step (int): the step being saved.

    Use as a context manager: a clean exit publishes the object and records its manifest entry
    (``on_closed(entry)``); an exception discards it (``on_failed(name)``). Created by
    :meth:`Transaction.open <opd_store.commit._transaction.Transaction.open>`.

    Args:
        storage (Storage): the store's storage.
        name (str): the payload's name inside the attempt.
        rel (str): the object's path relative to the store root.
        entry_path (str): the entry's path relative to the step prefix (``<attempt_id>/<name>``).
        step (int): the step being saved (for messages).
        prefix (str | None): the entry's spread prefix (``None``: the step prefix itself;
            :mod:`opd_store.format._layout`).
        on_closed (Callable[[PayloadEntry], None]): receives the entry once the object is published.
        on_failed (Callable[[str], None]): receives the name once the writer is discarded or failed.
        on_publishing (Callable[[PayloadWriter, Completion], None] | None): receives the writer and
            its completion when the backend publishes in the background (parallel remote
            writers): the attempt then calls :meth:`settle` before its commit. Without it every
            publish is waited for in :meth:`close`.
        cancelled (threading.Event | None): once set, later writes fail without any I/O (the save
            was abandoned at an exit deadline).
    """

    def __init__(self, storage: "Storage", name: str, rel: str, entry_path: str, step: int, handle, *,
                 on_closed: Callable[[PayloadEntry], None], on_failed: Callable[[str], None],
                 cancelled: threading.Event | None = None,
                 on_publishing: Callable[["PayloadWriter", "Completion"], None] | None = None,
                 prefix: str | None = None) -> None:
        self._storage = storage
        self.name = name
        self._rel = rel
        self._entry_path = entry_path
        self._prefix = prefix
        self.step = step
        self._handle = handle
        self._on_closed = on_closed
        self._on_failed = on_failed
        self._on_publishing = on_publishing
        self._cancelled = cancelled
        self._crc = Crc32c()
        self._state = "open"
        # The first backend error of a write(), raised by close(). torch.save cannot report an
        # exception from write(): its zip writer then fails its own position check while writing
        # the end records and raises "RuntimeError: unexpected pos", hiding the cause (found with
        # a 403 on S3 multipart uploads). So write() records the error and drops every later
        # byte; close() discards the object and raises the error; nothing can publish.
        self._write_error: Exception | None = None

    # file protocol ------------------------------------------------------------------------
    def write(self, data) -> int:
        """Write a buffer (``bytes``, ``bytearray`` or ``memoryview``); return its byte count.

        A backend failure (after the backend's own retries) is not raised here but by
        :meth:`close` (or the ``with`` block's exit): ``torch.save`` cannot pass an exception from
        ``write`` through its zip writer (it would report ``RuntimeError: unexpected pos``
        instead). Bytes written after a failure, or after the save was cancelled, are dropped;
        the payload is never published.

        Raises:
            ValueError: the writer is closed, aborted or failed.
        """
        if self._state != "open":
            raise ValueError(f"write to a {self._state} payload writer {self.name!r}")
        if self._write_error is None and self._cancelled is not None and self._cancelled.is_set():
            self._write_error = SaveAbandonedError(
                f"{self._storage.url(self._rel)}: the save of step {self.step} was abandoned (exit deadline); "
                "the step stays uncommitted")
        if self._write_error is not None:
            return memoryview(data).nbytes  # dropped: this payload already failed (see __init__)
        view = data if isinstance(data, memoryview) else memoryview(data)
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        kill_points.payload_bytes(self.step, self.name, self._crc.size_bytes, view, self._handle.write)  # the soak
        count = self._crc.update(view)
        slice_bytes = self._storage.write_slice_bytes  # zero-copy slices (see Storage)
        try:
            for offset in range(0, count, slice_bytes):
                self._handle.write(view[offset:offset + slice_bytes])
        except Exception as exc:  # noqa: BLE001 - raised by close(), see __init__
            # A remote writer uploads as it goes (S3: CreateMultipartUpload, UploadPart).
            self._write_error = exc
            logger.debug("payload %s: write failed (%r); raised at close", self._rel, exc)
        return count

    def _reported(self, exc: BaseException) -> BaseException:
        """``exc``, or the typed error naming the payload and the step: a
        :class:`StoragePermissionError` naming the refused backend operation when the table of
        backend failures says the backend denied it, a :class:`StoreUnreachableError` when the
        store could not be reached (no credentials, no connection, no answer within the timeout); a
        :class:`PayloadUploadError` of the storage layer (which knows the object's URL only) named
        with the payload and the step, its cause kept."""
        if isinstance(exc, PayloadUploadError) and f"of step {self.step}" not in str(exc):
            named = type(exc)(f"{exc}; payload {self.name!r} of step {self.step} is not committed")
            named.__cause__ = exc.__cause__
            return named
        if isinstance(exc, OpdStoreError):
            return exc
        meaning = classify(exc)
        where = f"{self._storage.url(self._rel)}: "
        if meaning in (Meaning.UNREACHABLE, Meaning.NO_CREDENTIALS):
            return StoreUnreachableError(
                f"{where}cannot write payload {self.name!r} of step {self.step}: {self._storage.explain(exc)}; "
                f"step {self.step} is not committed")
        if meaning is not Meaning.DENIED:
            return exc
        operation = backend_operation(exc) or "the write"
        return StoragePermissionError(
            f"{where}permission denied: the backend refused {operation} while "
            f"writing payload {self.name!r} of step {self.step} ({exc}); step {self.step} is not committed"
        )

    def tell(self) -> int:
        return self._crc.size_bytes

    def flush(self) -> None:
        if self._state == "open" and self._write_error is None:
            self._handle.flush()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._state != "open"

    @property
    def size_bytes(self) -> int:
        return self._crc.size_bytes

    @property
    def failed(self) -> bool:
        """A :meth:`write` failed (or the save was cancelled): the bytes after it were dropped and
        :meth:`close` raises the backend's error, typed. A caller comparing :attr:`size_bytes` with
        what it wrote asks this first, so a refused upload is not reported as a short source."""
        return self._write_error is not None

    def close(self) -> None:
        """Publish the object and record its entry (size_bytes, crc32c) in the transaction.

        A backend that publishes in the background (S3, GCS: the last parts still uploading) hands
        its completion to the attempt instead (``on_publishing``): the entry is recorded, and a
        failure raised, when the attempt settles it before its commit.

        Raises:
            StoragePermissionError: the backend refused an upload request, now or during an
                earlier :meth:`write` (S3: the credentials may not ``CreateMultipartUpload`` or
                ``UploadPart``); names the operation.
            SaveAbandonedError: the save was cancelled (exit deadline) while it streamed.
            OSError: any other backend failure, now or during an earlier :meth:`write`; the object
                is discarded (no open multipart upload is left).
        """
        if self._state != "open":
            return
        if self._write_error is not None:
            failed = self._write_error
            self.abort()
            reported = self._reported(failed)
            if reported is failed:
                raise failed
            raise reported from failed
        try:
            completion = self._storage.start_finish(self._handle, self._rel)
            if not completion.done() and self._on_publishing is not None:
                # The backend publishes in the background (the last parts still uploading): the
                # caller streams the next payload meanwhile; the attempt settles it before its commit.
                self._state = "publishing"
                self._on_publishing(self, completion)
                return
            completion.wait()
        except BaseException as exc:
            self._fail(exc)
        self._state = "closed"
        self._on_closed(self.entry())

    def entry(self) -> PayloadEntry:
        """The manifest entry of the bytes written (size_bytes and crc32c of every byte)."""
        return PayloadEntry(name=self.name, path=self._entry_path, size_bytes=self._crc.size_bytes,
                            crc32c=self._crc.hexdigest(), prefix=self._prefix)

    def settle(self, completion: "Completion") -> None:
        """Wait for a background publish started by :meth:`close` and record the entry.

        Raises:
            StoragePermissionError: the backend refused an upload request.
            PayloadUploadError: the upload failed after the client's retries (it was aborted).
        """
        if self._state != "publishing":
            return
        try:
            completion.wait()
        except BaseException as exc:
            self._fail(exc)
        self._state = "closed"
        self._on_closed(self.entry())

    def _fail(self, exc: BaseException) -> None:
        """Record a failed publish, discard what the backend holds, raise the reported error."""
        self._state = "failed"
        self._on_failed(self.name)
        # A failed publish must leave nothing that could publish later or keep costing (an open S3
        # multipart upload whose completion failed): discard the handle, best effort.
        try:
            self._storage.abort_write(self._handle, self._rel)
        except Exception:  # noqa: BLE001 - the close error is the one to report
            logger.warning("could not discard the failed payload writer %s", self._rel, exc_info=True)
        reported = self._reported(exc)
        if reported is exc:
            raise exc
        raise reported from exc

    def abort(self) -> None:
        """Discard the object without publishing it."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._storage.abort_write(self._handle, self._rel)
        self._on_failed(self.name)

    def __enter__(self) -> "PayloadWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


__all__ = ["PayloadWriter"]
