"""The storage seam: the few verbs opd_store needs from a backend, declared abstract.

Everything above this package speaks in paths relative to the store root
(``step-000001/manifest.json``) and never touches a backend client. :class:`Storage` declares the
verbs with :mod:`abc`, so a backend that forgets one fails when it is constructed (``TypeError``
naming the missing verbs), not when a commit first needs it:

==========================  =========================================================================
reads                       :meth:`~Storage.list_children`, :meth:`~Storage.list_tree`,
                            :meth:`~Storage.size`, :meth:`~Storage.read_bytes`
writes, overwrite mode      :meth:`~Storage.open_write` (a streaming writer; published by
                            :meth:`~Storage.finish_write`, discarded by :meth:`~Storage.abort_write`)
writes, create-only mode    :meth:`~Storage.create_exclusive` (the commit point of every checkpoint)
deletes                     :meth:`~Storage.delete`, :meth:`~Storage.delete_tree`
multipart uploads           :meth:`~Storage.list_uploads`, :meth:`~Storage.abort_upload` (a backend
                            without them says so with :class:`NoMultipartUploads`)
==========================  =========================================================================

The other verbs have defaults built on these. Every verb that can decide a checkpoint's state
(list, size, read) must answer from the backend as it is now (see
:class:`~opd_store.storage.fsspec_storage.FsspecStorage`). ``tests/core/test_storage_conformance.py``
checks every verb of every backend against the backend's own client.
"""

from __future__ import annotations

import abc
import io
import logging
import posixpath
from typing import Any, BinaryIO

logger = logging.getLogger("opd_store.storage")


class Storage(abc.ABC):
    """One backend rooted at a prefix.

    Args:
        fs (Any): the backend client (an ``fsspec.AbstractFileSystem`` for every backend here).
        root (str): the root in the client's own path spelling; a trailing ``/`` is dropped.
        url_root (str): the root as a URL (a plain absolute path for local stores).

    Attributes:
        commit_primitive (str): one line naming how :meth:`create_exclusive` is create-only.
        atomic_create (bool): :meth:`create_exclusive` is atomic (two racing creates: one wins).
        write_slice_bytes (int): the largest single ``write()`` a payload writer hands this
            backend's writer (zero-copy slices of larger buffers).
        bucketed (bool): the root's first component is a bucket.
        probe_bucket (bool): :meth:`check_reachable` asks for the bucket before listing the root.
    """

    commit_primitive = "none"
    atomic_create = False
    # fsspec's buffered files copy each whole write() into their part buffer before uploading: one
    # 1 GiB tensor would cost ~3 GiB of RSS. 8 MiB slices keep it to one part.
    write_slice_bytes = 8 << 20
    bucketed = False
    probe_bucket = True

    def __init__(self, fs: Any, root: str, url_root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        stripped = url_root.rstrip("/")
        # A store at a filesystem's root ("memory:///") keeps its slashes: "memory:" is no URL.
        self.url_root = stripped if stripped and not stripped.endswith(":") else url_root

    # -- names -------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The backend path of ``rel`` (relative to the root)."""
        if not rel:
            return self.root
        return self.root + rel if self.root.endswith("/") else f"{self.root}/{rel}"

    def url(self, rel: str = "") -> str:
        """URL of ``rel``, spelled like :attr:`url_root`."""
        if not rel:
            return self.url_root
        return self.url_root + rel if self.url_root.endswith("/") else f"{self.url_root}/{rel}"

    def describe(self) -> str:
        return f"{type(self).__name__}({self.url_root})"

    __repr__ = describe

    # -- reads (abstract; always fresh) --------------------------------------------------------
    @abc.abstractmethod
    def list_children(self, rel: str = "") -> tuple[list[str], dict[str, int]]:
        """Immediate children of ``rel``: (sub-prefix names, {object name: size_bytes}).

        One delimiter listing (paginated by the backend). A missing prefix lists as empty.
        """

    @abc.abstractmethod
    def list_tree(self, rel: str = "") -> dict[str, int]:
        """Every object below ``rel``, recursively: {path relative to ``rel``: size_bytes}.

        One flat listing (no per-object request). A missing prefix lists as empty.
        """

    @abc.abstractmethod
    def size(self, rel: str) -> int | None:
        """Size in bytes of the object ``rel``, or ``None`` when it does not exist (or is a prefix)."""

    @abc.abstractmethod
    def read_bytes(self, rel: str, *, small: bool = False, max_bytes: int | None = None) -> bytes:
        """The whole object ``rel``, or its first ``max_bytes + 1`` bytes.

        Args:
            rel (str): object path relative to the root.
            small (bool): the object is known to be small (a manifest): a backend that would first
                ask for its size to plan a parallel download skips that request.
            max_bytes (int | None): fetch at most ``max_bytes + 1`` bytes (one ranged request), so
                a caller with a size limit sees that the object is over it without fetching it all.

        Raises:
            FileNotFoundError: no such object.
        """

    # -- writes (abstract) ---------------------------------------------------------------------
    @abc.abstractmethod
    def open_write(self, rel: str) -> BinaryIO:
        """A new binary writer for the object ``rel`` (overwrite mode); the object appears when
        :meth:`finish_write` publishes it. Callers discard it with :meth:`abort_write` instead
        when anything went wrong."""

    @abc.abstractmethod
    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create the small object ``rel`` holding ``data`` only if it does not exist (create-only
        mode: the commit point of a checkpoint, and of a pin).

        Raises:
            OSError: the create failed; :func:`~opd_store.storage.backend_errors.classify` gives
                ``LOST_RACE`` when the object exists (or another create of it is in flight) and
                anything else for an outcome that is unknown until the object is read back.
            UnsupportedBackendError: the backend has no create-only write.
        """

    @abc.abstractmethod
    def delete(self, rel: str) -> None:
        """Delete the object ``rel``; a missing object is not an error."""

    @abc.abstractmethod
    def delete_tree(self, rel: str) -> None:
        """Delete every object below ``rel``; a missing prefix is not an error."""

    # -- multipart uploads (abstract) ----------------------------------------------------------
    @abc.abstractmethod
    def list_uploads(self) -> list[tuple[str, str, float]]:
        """Unfinished multipart uploads under the root: ``(rel, upload_id, initiated_secs)``.

        They are invisible to listings but billed (S3), so garbage collection aborts old ones.
        """

    @abc.abstractmethod
    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Abort one unfinished multipart upload from :meth:`list_uploads`."""

    # -- defaults built on the verbs above -----------------------------------------------------
    def refresh(self) -> None:
        """Drop whatever the backend client cached (listings, sizes); nothing by default."""

    def finish_write(self, handle: BinaryIO, rel: str) -> None:
        """Publish a writer from :meth:`open_write` (durably, where the backend needs a flush)."""
        handle.close()

    def abort_write(self, handle: BinaryIO, rel: str) -> None:
        """Throw away a writer from :meth:`open_write` without publishing it (best effort)."""
        discard = getattr(handle, "discard", None)
        try:
            if discard is not None:
                discard()
                # fsspec buffered files upload on close() and close themselves at garbage
                # collection; a discarded writer must never publish its partial bytes.
                handle.closed = True
            else:
                handle.close()
                self.delete(rel)
        except Exception:  # noqa: BLE001 - cleanup of an already failing save
            logger.warning("could not discard partial object %s", self.url(rel), exc_info=True)

    def sync_prefix(self, rel: str) -> None:
        """Make the names of objects written under ``rel`` durable (local: fsync the directories);
        nothing to do on backends whose writes are durable when published."""

    def open_read(self, rel: str) -> BinaryIO:
        """A binary reader of the object ``rel`` (for copies; backends that can stream override it).

        Raises:
            FileNotFoundError: no such object.
        """
        return io.BytesIO(self.read_bytes(rel))

    def open_checked(self, rel: str) -> tuple[BinaryIO, int, str]:
        """A seekable reader of the whole object ``rel`` with its measured size and CRC32C.

        The default fetches the object whole (one request where the backend allows) and serves it
        from memory; the CRC is computed over exactly the bytes the reader returns.

        Returns:
            tuple[BinaryIO, int, str]: (reader positioned at 0, size_bytes, crc32c as 8 hex digits).

        Raises:
            FileNotFoundError: no such object.
        """
        from ..checksum import crc32c_hex

        data = self.read_bytes(rel)
        return io.BytesIO(data), len(data), crc32c_hex(data)

    def check_reachable(self) -> None:
        """Fail fast when the store cannot be used: missing bucket, credentials or connection.

        The default lists the root once.

        Raises:
            StoreUnreachableError: naming the store URL and the backend's cause.
        """
        from ..errors import StoreUnreachableError
        from .backend_errors import describe

        try:
            self.list_children("")
        except Exception as exc:  # noqa: BLE001 - every backend failure is reported the same way
            raise StoreUnreachableError(f"{self.url_root}: cannot reach the store ({describe(exc)})") from exc


class NoMultipartUploads:
    """Mixin of a backend without multipart uploads to list or abort (local, memory, GCS: gcsfs
    completes or cancels its resumable uploads itself, and GCS lists none)."""

    def list_uploads(self) -> list[tuple[str, str, float]]:
        """None: this backend has no unfinished multipart uploads."""
        return []

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Refused: there are no multipart uploads on this backend.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")


def join(*parts: str) -> str:
    """Join relative key parts with ``/`` (never ``os.path.join``: keys are not local paths)."""
    return posixpath.join(*[p for p in parts if p])


__all__ = ["NoMultipartUploads", "Storage", "join"]
