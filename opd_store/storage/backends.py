"""Per-backend create-only writes, probes and clocks.

How each backend makes the manifest create-only (the commit point):

=========  ===================================================================================
local      temp file beside the target, ``fsync``, ``os.link`` to the final name (``link(2)``
           fails with ``EEXIST`` if the name exists), ``fsync`` of the directory. A reader sees
           either no manifest or the whole one.
memory     exists-check and put under one process-wide lock (``memory://`` is one dict per
           process, so the lock covers every writer that can see it).
s3         one ``PutObject`` with ``If-None-Match: *`` (s3fs ``pipe_file(mode="create")``); the
           manifest is far below s3fs's multipart threshold, so it is never a multipart upload
           (moto does not enforce conditions on ``CompleteMultipartUpload``; field notes).
gs         one single-request upload with ``ifGenerationMatch=0`` (gcsfs ``pipe_file(mode=
           "create")`` below its chunk size; fake-gcs-server ignores preconditions on resumable
           uploads, field notes).
other      refused (:class:`~opd_store.errors.UnsupportedBackendError`, naming the URL and what
           is supported) unless the caller passes ``allow_check_then_put=True``: then an
           ``exists`` check followed by a plain put, which lets two writers that check within the
           same window both "win" (the later put overwrites the earlier manifest).
=========  ===================================================================================

:func:`opd_store.storage.open_url.open_storage` picks the backend for a URL.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from typing import Any, BinaryIO

from ..checksum import Crc32c
from ..errors import UnsupportedBackendError
from . import reachability, remote_probes
from .base import NoMultipartUploads, Storage
from .fsspec_storage import FsspecStorage

_MEMORY_LOCK = threading.Lock()


class _FsyncingFile:
    """A local binary file that fsyncs its data before it is published by ``close()``."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()/abort
        self.name = path

    def write(self, data) -> int:
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def discard(self) -> None:
        self._file.close()
        try:
            os.unlink(self.name)
        except FileNotFoundError:
            pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(NoMultipartUploads, FsspecStorage):
    """A local directory. Payloads are fsynced at close; the manifest is linked into place."""

    # Payload writes reach the kernel 512 KiB at a time. On this project's VMs (Linux 6.18 with
    # virtio-balloon free page reporting), writes of 2 MiB or more into a new file cost 10-20x the
    # CPU (1 GiB: 13-22 s against 1.2-1.9 s; `python -m bench.write_size`,
    # bench/results/write-size-*.md): most likely the page cache then takes large folios from the
    # high-order free blocks the guest handed back to the host, which fault back in page by page.
    # torch.save hands over whole tensor storages. Elsewhere this costs 2,048 calls per GiB.
    write_slice_bytes = 512 << 10
    commit_primitive = "temp file + fsync + os.link (EEXIST if present) + directory fsync"
    atomic_create = True

    def open_write(self, rel: str) -> BinaryIO:
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return _FsyncingFile(path)  # type: ignore[return-value]

    def abort_write(self, handle, rel: str) -> None:
        handle.discard()

    def open_checked(self, rel: str, *, size_bytes: int | None = None) -> tuple[BinaryIO, int, str]:
        # The file itself, checksummed through a read-only map: no copy of the payload in memory,
        # and torch.load then reads pages the checksum just brought into the cache.
        handle = open(self.path(rel), "rb")  # noqa: SIM115 - returned to the caller
        try:
            size_bytes = os.fstat(handle.fileno()).st_size
            hasher = Crc32c()
            if size_bytes:
                with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    if hasattr(mapped, "madvise"):
                        mapped.madvise(mmap.MADV_SEQUENTIAL)
                    view = memoryview(mapped)
                    try:
                        hasher.update(view)
                    finally:
                        view.release()
            return handle, size_bytes, hasher.hexdigest()
        except BaseException:
            handle.close()
            raise

    def probe_read(self, timeout_secs: float, stage: dict[str, str]) -> None:
        reachability.local_probe_read(self, stage)

    def probe_write(self, stage: dict[str, str]) -> None:
        reachability.local_probe_write(self, stage)

    def clock_secs(self) -> float:
        # The filesystem's clock where a file can be created (a network filesystem stamps files
        # with its server's time), else this machine's, which stamps local disks.
        stamped = reachability.local_clock_secs(self)
        return time.time() if stamped is None else stamped

    def sync_prefix(self, rel: str) -> None:
        # Every directory of the attempt, then each ancestor up to the store root, so that the
        # names the manifest will point at survive a power loss once the commit returns.
        top = self.path(rel)
        for dirpath, _dirnames, _files in os.walk(top):
            _fsync_dir(dirpath)
        parent = os.path.dirname(top)
        while True:
            _fsync_dir(parent)
            if parent == self.root or len(parent) <= len(self.root):
                break
            parent = os.path.dirname(parent)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        final = self.path(rel)
        directory = os.path.dirname(final)
        os.makedirs(directory, exist_ok=True)
        temp = os.path.join(directory, f".{os.path.basename(final)}.{secrets.token_hex(8)}.tmp")
        with open(temp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temp, final)  # atomic; FileExistsError when the name is taken
        finally:
            os.unlink(temp)
            _fsync_dir(directory)


class MemoryStorage(NoMultipartUploads, FsspecStorage):
    """fsspec's process-global ``memory://`` store."""

    commit_primitive = "exists check + put under a process-wide lock"
    atomic_create = True

    def open_write(self, rel: str) -> BinaryIO:
        return self.fs.open(self.path(rel), "wb")

    def abort_write(self, handle, rel: str) -> None:
        # fsspec's MemoryFile is visible from open(); dropping it means deleting the key.
        self.delete(rel)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        with _MEMORY_LOCK:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)


class _BucketStorage(FsspecStorage):
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
        flight into the read pool's buffers (:mod:`opd_store.storage.range_stream`); an empty
        object is one plain stream (its size checked by the caller)."""
        if not size_bytes:
            return self.open_read(rel)
        from .range_stream import RangeStream, range_fetcher

        bucket, _, key = self.path(rel).partition("/")
        url = self.url(rel)
        return RangeStream(self.fs.loop, range_fetcher(range_opener(self.fs, bucket, key), url, size_bytes), url,  # type: ignore[return-value]
                           size_bytes, self.read_pool(), self.transfers.parts_in_flight,
                           translate=lambda exc: self.unreachable_error(rel, "read", exc))

    # Payload writers are parallel part writers (opd_store.storage.part_writer): publishing runs in
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


class S3Storage(_BucketStorage):
    """Amazon S3 (or an S3-compatible server) through s3fs.

    Payloads move in parallel: uploads (:mod:`opd_store.storage.s3_transfers`) as multipart parts
    of ``transfers.part_size_bytes``, up to ``transfers.parts_in_flight`` at once across the
    store's payloads; reads (:mod:`opd_store.storage.s3_reads`) as parallel ranged GETs into one
    buffer; streaming reads for copies (:mod:`opd_store.storage.range_stream`) as parallel ranged
    GETs into ``parts_in_flight`` reused part buffers, handed out in order.
    """

    commit_primitive = "single PutObject with If-None-Match: * (412 when the key exists)"
    credential_sources = remote_probes.S3_CREDENTIAL_SOURCES

    @property
    def endpoint(self) -> str | None:
        """The configured endpoint (``endpoint_url``, ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``),
        or ``None`` for AWS's own (botocore's errors then name the endpoint they tried)."""
        options = self.client_options
        return (options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))

    def probe_read(self, timeout_secs: float, stage: dict[str, str]) -> None:
        # Only requests inside the store's prefix (least privilege: deploy/iam/s3-policy.json
        # grants s3:ListBucket only for the run's prefix; HeadBucket would be denied). The prefix
        # listing alone tells a missing bucket (NoSuchBucket) from an empty store (no keys).
        remote_probes.s3_probe_read(self, timeout_secs, stage)

    def clock_secs(self) -> float:
        return remote_probes.s3_clock_secs(self)

    def newest_part_secs(self, rel: str, upload_id: str) -> float | None:
        return remote_probes.s3_newest_part_secs(self, rel, upload_id)

    def _list_dir(self, base: str) -> list[dict]:
        from fsspec.asyn import sync

        return sync(self.fs.loop, self.fs._lsdir, base, refresh=True)

    def _find_tree(self, base: str) -> dict[str, dict]:
        """Every object under ``base`` in one recursive listing, and no other request.

        s3fs's ``find`` of a prefix with nothing under it asks ``HeadObject`` of the prefix's own
        name (is it a file?): one more round trip on every empty store, and a request that needs
        ``s3:GetObject`` on the prefix itself, which a run's IAM policy scoped to ``prefix/*``
        denies. Listing the parent with ``<leaf>/`` as s3fs's ``prefix`` filter lists the same
        objects and never asks ``HeadObject``.
        """
        parent, _, leaf = base.rstrip("/").rpartition("/")
        if not parent:  # the bucket itself: s3fs asks nothing more for an empty key
            return self.fs.find(base, detail=True)
        return self.fs.find(parent, prefix=leaf + "/", detail=True)

    def read_bytes(self, rel: str, *, small: bool = False, max_bytes: int | None = None) -> bytes:
        self.refresh()
        if max_bytes is not None:  # one ranged GET (no HEAD: the range is absolute)
            return self.fs.cat_file(self.path(rel), start=0, end=max_bytes + 1)
        if small:
            # s3fs's cat_file sends a HEAD first to plan a concurrent ranged download; a manifest
            # is one GET.
            return self.fs.cat_file(self.path(rel), max_concurrency=1)
        return self.fs.cat_file(self.path(rel))

    def _bucket_and_prefix(self) -> tuple[str, str]:
        bucket, _, prefix = self.root.partition("/")
        return bucket, prefix

    def _bucket_and_key(self, rel: str) -> tuple[str, str]:
        bucket, _, key = self.path(rel).partition("/")
        return bucket, key

    def open_write(self, rel: str) -> BinaryIO:
        from .s3_transfers import S3PartWriter

        bucket, key = self._bucket_and_key(rel)
        return S3PartWriter(self.fs, bucket, key, self.url(rel), self.part_pool())  # type: ignore[return-value]

    def open_checked(self, rel: str, *, size_bytes: int | None = None) -> tuple[BinaryIO, int, str]:
        from .s3_reads import read_checked

        bucket, key = self._bucket_and_key(rel)
        return read_checked(self.fs, bucket, key, self.url(rel), self.transfers,  # type: ignore[return-value]
                            self._expected_size(rel, size_bytes))

    def open_read_stream(self, rel: str, size_bytes: int) -> BinaryIO:
        from .s3_reads import range_opener

        return self._range_stream(rel, size_bytes, range_opener)

    def list_uploads(self) -> list[tuple[str, str, float]]:
        # ListMultipartUploads with the store's prefix (s3fs's list_multipart_uploads lists the
        # whole bucket and drops pagination); a prefix on a key boundary only.
        bucket, prefix = self._bucket_and_prefix()
        key_prefix = f"{prefix}/" if prefix else ""
        found: list[tuple[str, str, float]] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key_prefix}
        while True:
            out = self.fs.call_s3("list_multipart_uploads", **kwargs)
            for upload in out.get("Uploads", []) or []:
                key = upload["Key"]
                if key.startswith(key_prefix):
                    found.append((key[len(key_prefix):], upload["UploadId"], upload["Initiated"].timestamp()))
            if not out.get("IsTruncated"):
                return found
            kwargs["KeyMarker"] = out.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = out.get("NextUploadIdMarker")

    def abort_upload(self, rel: str, upload_id: str) -> None:
        bucket, prefix = self._bucket_and_prefix()
        key = f"{prefix}/{rel}" if prefix else rel
        self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)


class GCSStorage(NoMultipartUploads, _BucketStorage):
    """Google Cloud Storage through gcsfs.

    Payloads move in parallel: uploads (:mod:`opd_store.storage.gcs_transfers`) as parallel
    composite uploads (temporary part objects of ``transfers.part_size_bytes``, up to
    ``transfers.parts_in_flight`` at once across the store's payloads, composed into the payload and
    deleted before it is reported published); reads (:mod:`opd_store.storage.gcs_reads`) as parallel
    ranged downloads into one buffer. No upload is left open to list: a failed payload's temporary
    objects are deleted, and any a killed writer left lie in its uncommitted attempt, which ``gc``
    removes.
    """

    commit_primitive = "single-request upload with ifGenerationMatch=0 (412 when the object exists)"
    credential_sources = remote_probes.GCS_CREDENTIAL_SOURCES

    @property
    def endpoint(self) -> str:
        """The endpoint gcsfs talks to (``endpoint_url``, ``STORAGE_EMULATOR_HOST``, or Google's),
        without building the client."""
        location = self.client_options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST", "")
        if location in ("", "default"):
            return "https://storage.googleapis.com"
        return location if location.startswith(("http://", "https://")) else f"http://{location}"

    def probe_read(self, timeout_secs: float, stage: dict[str, str]) -> None:
        remote_probes.gcs_probe_read(self, timeout_secs, stage)

    def clock_secs(self) -> float:
        return remote_probes.gcs_clock_secs(self)

    def open_write(self, rel: str) -> BinaryIO:
        from .gcs_transfers import GCSPartWriter

        bucket, _, key = self.path(rel).partition("/")
        return GCSPartWriter(self.fs, bucket, key, self.url(rel), self.part_pool())  # type: ignore[return-value]

    def open_read_stream(self, rel: str, size_bytes: int) -> BinaryIO:
        from .gcs_reads import range_opener

        return self._range_stream(rel, size_bytes, range_opener)

    def open_checked(self, rel: str, *, size_bytes: int | None = None) -> tuple[BinaryIO, int, str]:
        from .gcs_reads import read_checked

        bucket, _, key = self.path(rel).partition("/")
        return read_checked(self.fs, bucket, key, self.url(rel), self.transfers,  # type: ignore[return-value]
                            self._expected_size(rel, size_bytes))


class CheckThenPutStorage(NoMultipartUploads, FsspecStorage):
    """Any other fsspec backend. Refuses to commit unless check-then-put was opted into."""

    commit_primitive = "exists check, then plain put (NOT atomic: racing writers can both win)"
    atomic_create = False

    def __init__(self, fs, root: str, url_root: str, *, allow_check_then_put: bool, timeouts=None) -> None:
        super().__init__(fs, root, url_root, timeouts=timeouts)
        self.allow_check_then_put = allow_check_then_put

    def create_exclusive(self, rel: str, data: bytes) -> None:
        if not self.allow_check_then_put:
            raise UnsupportedBackendError(
                f"{self.url_root}: fsspec protocol {self.fs.protocol!r} has no create-only write, so "
                "two writers of one step could both commit; pass allow_check_then_put=True to accept "
                "that race (see docs/protocol.md)"
            )
        path = self.path(rel)
        self.refresh()
        if self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.pipe_file(path, data)


__all__ = [
    "CheckThenPutStorage",
    "GCSStorage",
    "LocalStorage",
    "MemoryStorage",
    "S3Storage",
]
