"""Per-backend create-only writes, reachability probes and clocks.

How each backend makes the manifest create-only (the commit point):

=========  ===================================================================================
local      temp file beside the target, ``fsync``, ``os.link`` to the final name (``link(2)``
           fails with ``EEXIST`` if the name exists), ``fsync`` of the directory. A reader sees
           either no manifest or the whole one.
memory     exists-check and put under one process-wide lock (``memory://`` is one dict per
           process, so the lock covers every writer that can see it).
s3, gs     :mod:`opd_store.storage._bucket` (one conditional request).
other      refused (:class:`~opd_store.errors.UnsupportedBackendError`, naming the URL and what
           is supported) unless the caller passes ``allow_check_then_put=True``: then an
           ``exists`` check followed by a plain put, which lets two writers that check within the
           same window both "win" (the later put overwrites the earlier manifest).
=========  ===================================================================================

:func:`opd_store.storage._open_url.open_storage` picks the backend for a URL.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from typing import BinaryIO

from ..errors import UnsupportedBackendError
from ..format import Crc32c
from . import _reachability as reachability
from ._fsspec import FsspecStorage

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


class LocalStorage(FsspecStorage):
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

    def reachability_probe(self) -> reachability.Probe:
        return reachability.LocalProbe(self)

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


class MemoryStorage(FsspecStorage):
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


class CheckThenPutStorage(FsspecStorage):
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


__all__ = ["CheckThenPutStorage", "LocalStorage", "MemoryStorage"]
