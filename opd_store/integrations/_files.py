"""Local checkpoint directories in and out of a store: upload files as payloads, fetch a step back.

Frameworks write a checkpoint as a directory of files (``checkpoint-42/optimizer.pt``, ...). This
module turns such a directory into payloads of one save attempt and back:

* :func:`directory_files` lists a directory as ``{payload name: path}``;
* :func:`snapshot_files` hard-links the files into a private staging directory, so a framework that
  deletes or rewrites its checkpoint directory while an upload is pending (the Hugging Face
  ``Trainer`` removes old ``checkpoint-N`` directories under ``save_total_limit`` before the next
  ``on_save``) cannot take bytes from under the upload;
* :func:`upload_files` streams files into a transaction or a rank's part, each through a payload
  writer that computes size and CRC32C as the bytes pass, and refuses a file that changed while it
  was read;
* :func:`fetch_step` copies a committed step into a local directory, each payload verified against
  the manifest's size and CRC32C by the store's ``open``, and publishes the directory with
  one local ``rename`` only once every file is there.

Why hard links and not copies: a link costs one metadata write per file whatever the size (a copy
of a 10 GiB state costs 10 GiB of writes and disk), and the linked inode keeps its bytes when the
framework unlinks its own name (POSIX ``unlink(2)`` frees the data only with the last link). A
framework that rewrites a file *in place* (``open(..., "wb")`` truncates the shared inode) is caught
by the (inode, size, mtime) comparison made after each file is streamed; such an upload is not
committed. Where links are impossible (another filesystem, a filesystem without links) the file is
copied instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..errors import IncompleteCheckpointError
from ..store import BaseStore

logger = logging.getLogger("opd_store.integrations")

CHUNK_BYTES = 8 << 20
"""Bytes read from a local file per write into a payload writer (the store's own slice size)."""


@dataclasses.dataclass(frozen=True)
class FileSnapshot:
    """One local file as it was when its save began.

    Attributes:
        name (str): payload name (``/``-separated, relative to the checkpoint directory).
        path (Path): where to read it (the framework's file, or a hard link / copy of it).
        size_bytes (int): its size then.
        inode (int): ``st_ino`` then.
        mtime_ns (int): ``st_mtime_ns`` then.
    """

    name: str
    path: Path
    size_bytes: int
    inode: int
    mtime_ns: int

    @classmethod
    def of(cls, name: str, path: Path) -> "FileSnapshot":
        st = path.stat()
        return cls(name, path, st.st_size, st.st_ino, st.st_mtime_ns)

    def changed(self) -> str | None:
        """Why the file is no longer what was snapshotted, or ``None`` when it is unchanged."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return "it was deleted"
        if (st.st_ino, st.st_size, st.st_mtime_ns) != (self.inode, self.size_bytes, self.mtime_ns):
            return (f"it was rewritten while being uploaded ({self.size_bytes} -> {st.st_size} bytes, "
                    f"mtime {self.mtime_ns} -> {st.st_mtime_ns} ns)")
        return None


def directory_files(directory: str | os.PathLike) -> dict[str, Path]:
    """Every regular file under ``directory`` as ``{relative posix name: path}``, sorted by name.

    Symbolic links are followed only when they point to a regular file. Names are what the payloads
    will be called, so a name the store refuses (``:``, ``#``, glob characters) fails the save with
    the store's ``ValueError`` naming it.

    Raises:
        FileNotFoundError: ``directory`` does not exist.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    found = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            path = Path(dirpath) / filename
            if path.is_file():
                found[path.relative_to(root).as_posix()] = path
    return dict(sorted(found.items()))


def snapshot_files(files: Mapping[str, Path], staging_dir: str | os.PathLike, *, link: bool = True) -> dict[str, FileSnapshot]:
    """Hard-link (or copy) ``files`` into ``staging_dir`` and describe each link.

    Args:
        files (Mapping[str, Path]): payload name -> the framework's file.
        staging_dir (str | os.PathLike): a new directory on the same filesystem (links cannot
            cross filesystems; the file is copied then).
        link (bool): ``False`` copies every file (for frameworks that rewrite files in place).

    Returns:
        dict[str, FileSnapshot]: payload name -> the staged file.

    Raises:
        IncompleteCheckpointError: a file vanished before it could be staged (names it).
    """
    staging = Path(staging_dir)
    staging.mkdir(parents=True, exist_ok=False)
    staged = {}
    for name, source in files.items():
        target = staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            if link:
                try:
                    os.link(source, target)
                except OSError as exc:  # EXDEV, EPERM, a filesystem without links
                    logger.debug("cannot hard-link %s (%s); copying it", source, exc)
                    shutil.copy2(source, target)
            else:
                shutil.copy2(source, target)
        except FileNotFoundError as exc:
            raise IncompleteCheckpointError(f"{source}: file {name!r} vanished before it could be staged for upload") from exc
        staged[name] = FileSnapshot.of(name, target)
    return staged


def upload_files(txn, files: Iterable[FileSnapshot]) -> int:
    """Stream local files into ``txn`` (a :class:`~opd_store.commit._transaction.Transaction` or a rank's
    part), one payload each, and return the bytes written.

    Each file is read in :data:`CHUNK_BYTES` pieces into ``txn.open(name)``, whose writer computes
    size and CRC32C on the way. After the last byte the file is compared with its snapshot: a file
    deleted or rewritten meanwhile aborts the payload, so what the manifest records is exactly
    the bytes that were read.

    Raises:
        IncompleteCheckpointError: a file is missing, shorter or longer than when its save began,
            or was rewritten while it was read (names the file); the caller's transaction is left
            to abort (nothing is committed).
        ValueError: a name the store refuses (see :func:`opd_store.format._names.check_payload_name`).
        StoragePermissionError: the backend refused a request (names the operation, the payload's
            URL and the step; the backend's error is the ``__cause__``).
        StoreUnreachableError: the store could not be reached (names the payload, the step and the
            endpoint; cause chained).
        OSError: any other backend failure (:class:`~opd_store.errors.PayloadUploadError` naming the
            object and the request).
    """
    total = 0
    for snap in files:
        with txn.open(snap.name) as writer:
            try:
                handle = open(snap.path, "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError as exc:
                writer.abort()
                raise IncompleteCheckpointError(f"{snap.path}: file {snap.name!r} of step {txn.step} vanished before upload") from exc
            with handle:
                while chunk := handle.read(CHUNK_BYTES):
                    writer.write(chunk)
            if writer.failed:  # the backend refused bytes (dropped since): its typed error, not the file's
                writer.close()  # raises it (StoragePermissionError, StoreUnreachableError, ...), cause chained
            problem = snap.changed()
            if problem is None and writer.size_bytes != snap.size_bytes:
                problem = f"{writer.size_bytes} bytes were read, the file had {snap.size_bytes}"
            if problem is not None:
                writer.abort()
                raise IncompleteCheckpointError(f"{snap.path}: file {snap.name!r} of step {txn.step} not uploaded: {problem}")
            total += writer.size_bytes
    return total


def fetch_step(store: BaseStore, step: int, target_dir: str | os.PathLike, *, manifest=None) -> Path:
    """Copy the complete step ``step`` of ``store`` into ``target_dir``, verified, and return it.

    Every payload of the manifest is read once through the store's ``open`` (size and CRC32C
    checked against the manifest before a byte is used) into a hidden sibling directory, which is
    renamed to ``target_dir`` once every file is there. A ``target_dir`` that already exists (a
    directory an earlier process left, possibly half-written) is replaced: the store is the source
    of truth. The fetch is the verification: a resume that fetches needs no deep verify first.

    Args:
        manifest (Manifest | None): the step's manifest when the caller already read it.

    Returns:
        Path: ``target_dir``.

    Raises:
        CheckpointNotFoundError: no manifest for ``step``.
        IncompleteCheckpointError, IntegrityError: a payload is missing or its bytes differ from
            the manifest (nothing is published at ``target_dir``).
        OSError: a backend or local failure.
    """
    target = Path(target_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    manifest = store.manifest(step) if manifest is None else manifest
    temp = target.parent / f".{target.name}.opd-fetch-{uuid.uuid4().hex[:12]}"
    temp.mkdir()
    try:
        for entry in manifest.payloads:
            path = temp / entry.name
            path.parent.mkdir(parents=True, exist_ok=True)
            with store.open(step, entry.name, manifest=manifest) as reader, open(path, "wb") as out:
                shutil.copyfileobj(reader, out, CHUNK_BYTES)
        if target.exists():
            stale = target.parent / f".{target.name}.opd-stale-{uuid.uuid4().hex[:12]}"
            os.replace(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(temp, target)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    logger.info("fetched %s into %s (%d files, %d bytes)", store.step_url(step), target,
                len(manifest.payloads), manifest.total_size_bytes)
    return target


__all__ = ["CHUNK_BYTES", "FileSnapshot", "directory_files", "fetch_step", "snapshot_files", "upload_files"]
