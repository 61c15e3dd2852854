"""Local checkpoint directories in and out of a store: upload files as payloads, fetch a step back.

:func:`snapshot_files` hard-links a framework's files into a private staging directory, so
deleting its directory meanwhile (the Trainer's ``save_total_limit``) cannot take bytes from an
upload: a link costs one metadata write per file and the inode keeps its bytes until the last
link goes (POSIX ``unlink(2)``); a file rewritten in place is caught by the (inode, size, mtime)
check after streaming; where links are impossible the file is copied. :func:`fetch_step` publishes
a verified step with one local ``rename``. docs/integrations.md, "Hugging Face Trainer and TRL".
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
    """Every regular file under ``directory`` as ``{relative posix name: path}``, sorted by name
    (symbolic links followed only to regular files); a name the store refuses fails the save later.

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
        staging_dir (str | os.PathLike): a new directory on the same filesystem (else files are copied).
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
    """Stream local files into ``txn`` (a transaction or a rank's part), one payload each, in
    :data:`CHUNK_BYTES` pieces; return the bytes written. A file that changed against its snapshot
    aborts its payload, so the manifest records exactly the bytes read.

    Raises:
        IncompleteCheckpointError: a file is missing, resized or rewritten while read (names it);
            the caller's transaction aborts.
        ValueError: a name the store refuses.
        StoragePermissionError: the backend refused a request (names the operation, URL and step).
        StoreUnreachableError: the store could not be reached (names payload, step and endpoint).
        OSError: any other backend failure (``PayloadUploadError`` naming the object and request).
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

    Every payload is read once through ``store.open`` (checked before a byte is used) into a hidden
    sibling, renamed to ``target_dir`` once complete; an existing ``target_dir`` is replaced (the
    store is the source of truth). The fetch is the verification.

    Args:
        manifest (Manifest | None): the step's manifest when the caller already read it.

    Raises:
        CheckpointNotFoundError: no manifest for ``step``.
        IncompleteCheckpointError, IntegrityError: a payload is missing or differs (nothing published).
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
