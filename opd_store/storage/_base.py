"""The storage seam: the few verbs opd_store needs from a backend, declared abstract.

Everything above this package speaks in paths relative to the store root
(``step-000001/manifest.json``) and never touches a backend client. :class:`Storage` declares the
verbs with :mod:`abc`, so a backend that forgets one fails when it is constructed (``TypeError``
naming the missing verbs), not when a commit first needs it:

==========================  =========================================================================
reads                       :meth:`~Storage.list_children`, :meth:`~Storage.list_tree`,
                            :meth:`~Storage.list_tree_modified`, :meth:`~Storage.size`,
                            :meth:`~Storage.read_bytes`
writes, overwrite mode      :meth:`~Storage.open_write` (a streaming writer; published by
                            :meth:`~Storage.finish_write`, discarded by :meth:`~Storage.abort_write`)
writes, create-only mode    :meth:`~Storage.create_exclusive` (the commit point of every checkpoint)
deletes                     :meth:`~Storage.delete`, :meth:`~Storage.delete_tree`
==========================  =========================================================================

The other verbs have defaults built on these. Every verb that can decide a checkpoint's state
(list, size, read) must answer from the backend as it is now (see
:class:`~opd_store.storage._fsspec.FsspecStorage`). ``tests/core/test_storage_conformance.py``
checks every verb of every backend against the backend's own client.

Beside the verbs, a storage holds what it is composed of: its parallel transfers
(``storage.transfers``, :class:`~opd_store.storage.transfers.Transfers`: settings and part pools),
the probe a reachability check runs (:meth:`~Storage.reachability_probe`,
:mod:`opd_store.storage._reachability`) and, on a backend that has them (S3), its unfinished
multipart uploads (:meth:`~Storage.multipart_uploads`, a :class:`MultipartUploads`; ``None``
elsewhere). The store's clock (:meth:`~Storage.clock_secs`) and each object's modification time on
it (:meth:`~Storage.list_tree_modified`) are what garbage collection compares
(:mod:`opd_store.retention._gc`).
"""

from __future__ import annotations

import abc
import io
import logging
import posixpath
import threading
import time
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

from ..format import KeyLayout
from ._client_options import ClientTimeouts
from ._request_tally import RequestTally
from .transfers import Transfers

if TYPE_CHECKING:
    from ._reachability import Probe
    from .transfers import Completion

logger = logging.getLogger("opd_store.storage")


class Storage(abc.ABC):
    """One backend rooted at a prefix.

    Args:
        fs (Any | Callable[[], Any]): the backend client (an ``fsspec.AbstractFileSystem`` for
            every backend here), or a function that builds it on first use: a client whose
            construction does I/O (gcsfs looks for credentials, which can take tens of seconds
            off-cloud) is then built inside the bounded reachability check, not by a constructor.
        root (str): the root in the client's own path spelling; a trailing ``/`` is dropped.
        url_root (str): the root as a URL (a plain absolute path for local stores).
        timeouts (ClientTimeouts | None): the client's connect and read timeouts, named in errors
            (:mod:`opd_store.storage._client_options`); the defaults when not given.

    Attributes:
        commit_primitive (str): one line naming how :meth:`create_exclusive` is create-only.
        atomic_create (bool): :meth:`create_exclusive` is atomic (two racing creates: one wins).
        write_slice_bytes (int): the largest single ``write()`` a payload writer hands this
            backend's writer (zero-copy slices of larger buffers).
        bucketed (bool): the root's first component is a bucket.
        endpoint (str | None): the endpoint requests go to, named in errors when a failure does
            not name one itself.
        credential_sources (str | None): where the client looks for credentials, named when it
            finds none.
        transfers (Transfers): the settings (storage options ``part_size_bytes``,
            ``parts_in_flight``...), part pools and upload pacing of parallel transfers (set by
            ``open_storage``).
        layout (KeyLayout): where the store's saves put their payloads (storage options
            ``key_layout``, ``key_prefixes``; set by ``open_storage``; the step layout by default).
        requests (RequestTally): the requests this store sent, by kind
            (:mod:`opd_store.storage._request_tally`).
    """

    commit_primitive = "none"
    atomic_create = False
    # fsspec's buffered files copy each whole write() into their part buffer before uploading: one
    # 1 GiB tensor would cost ~3 GiB of RSS. 8 MiB slices keep it to one part.
    write_slice_bytes = 8 << 20
    bucketed = False
    counts_own_requests = False  # S3, GCS: counted at the client (count_client_requests), not per verb
    endpoint: str | None = None
    credential_sources: str | None = None

    def __init__(self, fs: Any | Callable[[], Any], root: str, url_root: str, *,
                 timeouts: ClientTimeouts | None = None) -> None:
        self._fs_factory = fs if callable(fs) else None
        self._fs = None if callable(fs) else fs
        self._fs_lock = threading.Lock()
        self.timeouts = timeouts or ClientTimeouts()
        self.requests = RequestTally()
        self.client_options: dict[str, Any] = {}  # the filesystem's options (set by open_storage)
        self.transfers = Transfers()
        self.layout = KeyLayout()
        self.root = root.rstrip("/") or "/"
        stripped = url_root.rstrip("/")
        # A store at a filesystem's root ("memory:///") keeps its slashes: "memory:" is no URL.
        self.url_root = stripped if stripped and not stripped.endswith(":") else url_root

    @classmethod
    def with_client_timeouts(cls, options: dict[str, Any], timeouts: ClientTimeouts
                             ) -> tuple[dict[str, Any], ClientTimeouts, Callable[[Any], None]]:
        """The client options of this backend with opd_store's timeouts applied (before the client
        is built; :mod:`opd_store.storage._client_options`). The default changes nothing.

        Returns:
            tuple[dict, ClientTimeouts, Callable]: the options, the timeouts really in force, and
            what to do to the client once it is built.

        Raises:
            ValueError: a backend option out of range (the message names it).
        """
        return options, timeouts, _unchanged

    @property
    def fs(self) -> Any:
        """The backend client, built on first use (see the ``fs`` argument)."""
        fs = self._fs
        if fs is None:
            with self._fs_lock:
                if self._fs is None:
                    built = self._fs_factory()
                    self.count_client_requests(built)
                    self._fs = built
                fs = self._fs
        return fs

    @fs.setter
    def fs(self, value: Any) -> None:
        self._fs = value

    def count_client_requests(self, fs: Any) -> None:
        """Make the client just built count its requests in :attr:`requests` (S3, GCS); nothing by
        default, where each verb counts itself (:mod:`opd_store.storage._request_tally`)."""

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

    def explain(self, exc: BaseException) -> str:
        """The cause of a backend failure in words, naming this store's endpoint and timeouts
        (:func:`opd_store.storage._backend_errors.explain`)."""
        from ._backend_errors import explain

        return explain(exc, endpoint=self.endpoint, connect_timeout_secs=self.timeouts.connect_timeout_secs,
                       read_timeout_secs=self.timeouts.read_timeout_secs,
                       credential_sources=self.credential_sources)

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
    def list_tree_modified(self, rel: str = "") -> dict[str, tuple[int, float | None]]:
        """Every object below ``rel`` with its size and modification time, from one flat listing:
        ``{path relative to rel: (size_bytes, modified_secs)}``.

        ``modified_secs`` is seconds since the epoch as the *backend* recorded it (S3
        ``LastModified``, GCS ``updated``, the local file's mtime): the store's clock, comparable
        with :meth:`clock_secs` and never with the writer's. ``None`` where the backend reports
        no time. A missing prefix lists as empty.
        """

    def clock_secs(self) -> float:
        """The store's notion of now, in seconds since the epoch (the clock that stamps
        :meth:`list_tree_modified`). The default is this machine's clock, which is what stamps
        local files and the memory store.

        Raises:
            OSError: the backend could not be asked (a remote store's clock is read from a response).
        """
        return time.time()

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
            OSError: the create failed; :func:`~opd_store.storage._backend_errors.classify` gives
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

    # -- defaults built on the verbs above -----------------------------------------------------
    def refresh(self) -> None:
        """Drop whatever the backend client cached (listings, sizes); nothing by default."""

    def finish_write(self, handle: BinaryIO, rel: str) -> None:
        """Publish a writer from :meth:`open_write` (durably, where the backend needs a flush)."""
        handle.close()

    def start_finish(self, handle: BinaryIO, rel: str) -> "Completion":
        """Start publishing a writer from :meth:`open_write`; the completion says when it landed.

        The default publishes now (:meth:`finish_write`; its failure is raised here). Backends
        that upload in parallel (S3) return at once while the last parts still move, so the next
        payload of a save can stream meanwhile.
        """
        from .transfers import Completion

        return Completion.now(lambda: self.finish_write(handle, rel))

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

    def open_read_stream(self, rel: str, size_bytes: int) -> BinaryIO:
        """A forward-only reader of the ``size_bytes`` expected of ``rel`` (a manifest's size) in
        bounded memory, for copies. The default is :meth:`open_read`; S3 and GCS keep
        ``parts_in_flight`` ranges in flight (:class:`~opd_store.storage.transfers._range_stream.RangeStream`).
        No checksum is checked: the caller compares what it reads with the manifest.

        Raises:
            FileNotFoundError: no such object (here, or at the reader's first read).
            IntegrityError: (reads of ranges) a short range, or an object of another size.
        """
        return self.open_read(rel)

    def open_checked(self, rel: str, *, size_bytes: int | None = None) -> tuple[BinaryIO, int, str]:
        """A seekable reader of the whole object ``rel`` with its measured size and CRC32C.

        The default fetches the object whole (one request where the backend allows) and serves it
        from memory; the CRC is computed over exactly the bytes the reader returns. Remote backends
        read in parallel ranges of the ``size_bytes`` expected (the manifest's), into one buffer.

        Args:
            rel (str): the object.
            size_bytes (int | None): the size the caller expects; a backend may plan its reads by
                it, and reports the object's real size when it differs (the reader then holds
                nothing to trust).

        Returns:
            tuple[BinaryIO, int, str]: (reader positioned at 0, size_bytes, crc32c as 8 hex digits).

        Raises:
            FileNotFoundError: no such object.
        """
        from ..format import crc32c_hex

        data = self.read_bytes(rel)
        return io.BytesIO(data), len(data), crc32c_hex(data)

    # -- what the storage is composed of --------------------------------------------------------
    def multipart_uploads(self) -> "MultipartUploads | None":
        """This backend's unfinished multipart uploads under the root, or ``None`` when it has no
        multipart uploads to list or abort (the default: local, memory, GCS, whose resumable
        uploads gcsfs completes or cancels itself)."""
        return None

    def reachability_probe(self) -> "Probe":
        """The probe :func:`~opd_store.storage._reachability.check_reachable` runs on this backend:
        by default a listing of the root, and for writers a probe object created with the
        create-only write and deleted. Backends whose client would retry for longer than the
        check's bound return a bounded probe."""
        from ._reachability import Probe

        return Probe(self)


class MultipartUploads(abc.ABC):
    """Unfinished multipart uploads under a store's root: invisible to listings but billed (S3), so
    garbage collection aborts the old ones. A capability: :meth:`Storage.multipart_uploads` returns
    one on a backend that has them (:class:`~opd_store.storage.s3._uploads.S3Uploads`).

    Every method answers on the store's clock and raises the backend's failure
    (:class:`~opd_store.errors.StoreUnreachableError` when the store cannot be reached).
    """

    @abc.abstractmethod
    def list(self) -> list[tuple[str, str, float]]:
        """Every unfinished upload under the root: ``(rel, upload_id, initiated_secs)``."""

    @abc.abstractmethod
    def abort(self, rel: str, upload_id: str) -> None:
        """Abort one upload from :meth:`list`."""

    @abc.abstractmethod
    def newest_part_secs(self, rel: str, upload_id: str) -> float | None:
        """When the newest part of one upload was stored, or ``None`` when it has no part yet."""


def _unchanged(fs: Any) -> None:
    """Nothing to set on a client once built."""


def join(*parts: str) -> str:
    """Join relative key parts with ``/`` (never ``os.path.join``: keys are not local paths)."""
    return posixpath.join(*[p for p in parts if p])


__all__ = ["MultipartUploads", "Storage", "join"]
