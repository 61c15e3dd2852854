"""The one copy routine: files of a source storage streamed into the payloads of a save attempt.

:func:`copy_files` serves every copy: ``opd-store cp`` and the tiered store's uploads
(:func:`copy_checkpoint`, a committed step between stores), the import of legacy steps
(:mod:`opd_store.store._legacy`, ``opd-store migrate``) and of DCP's own checkpoints
(:mod:`opd_store.dcp._adopt`, ``opd-store import-dcp``). Each file is read with
``Storage.open_read_stream`` of the size expected of it (from S3 or GCS, ``parts_in_flight`` ranged
GETs at once into the store's reused read buffers, :mod:`opd_store.storage.transfers._range_stream`)
and passes through one reused chunk into a payload writer, which writes in parallel parts as every
save does: memory stays bounded by the chunk and the two part pools, whatever the file sizes. Size
and CRC32C are computed as the bytes pass and compared with what the source records before the
payload is closed; each caller adds its own check of a file as it streams (a :class:`FileCheck`:
a legacy pickle proven weights-only, DCP's items deserialised). Any failure aborts the attempt:
nothing is committed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Callable, Protocol

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError, SaveAbandonedError
from ..format import Crc32c
from ..storage import is_missing
from ._status import COMPLETE, UNCOMMITTED

if TYPE_CHECKING:
    from ..commit import Attempt
    from ..storage import Storage
    from ._checkpoint_store import CheckpointStore

logger = logging.getLogger("opd_store.store")

CHUNK_BYTES = 8 << 20
"""The reused buffer each read of a copy lands in."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One file a copy streams into a payload.

    Attributes:
        name (str): the payload's name in the destination attempt.
        rel (str): the object in the source storage, relative to its root.
        size_bytes (int): the size expected (the source manifest's entry, or its listing).
        crc32c (str | None): the CRC32C expected (the source manifest's), ``None`` where the source
            records none (a legacy step, DCP's files).
    """

    name: str
    rel: str
    size_bytes: int
    crc32c: str | None = None


class FileCheck(Protocol):
    """A caller's check of one file as it streams; raising from either method stops the copy
    (the payload is discarded, nothing is committed)."""

    def update(self, view: memoryview) -> None:
        """One chunk of the file, in order, before it is written (a view of the reused chunk,
        valid during the call only)."""

    def finish(self) -> None:
        """The whole file passed (its size and CRC32C matched), before its payload is closed."""


class Progress(Protocol):
    """A copy's progress: ``set_size`` once with the total payload bytes, then ``relative_update``
    with the bytes of each chunk copied (an fsspec ``Callback`` fits, as does the CLI's bar)."""

    def set_size(self, size: int) -> None: ...

    def relative_update(self, inc: int = 1) -> None: ...


def copy_files(source: "Storage", files: Iterable[SourceFile], txn: "Attempt", *, what: str,
               check: Callable[[SourceFile], FileCheck | None] | None = None,
               each_chunk: Callable[[int], None] | None = None) -> dict[str, tuple[int, str]]:
    """Stream each of ``files`` from ``source`` into the payload of its name in ``txn``, one file at
    a time through one reused chunk (module docstring).

    Args:
        source (Storage): where the files are.
        files (Iterable[SourceFile]): the files, with what is expected of each.
        txn (Attempt): the destination attempt (a transaction, not committed here).
        what (str): the files in words for errors (``step 2: source payload``); the name follows.
        check (Callable[[SourceFile], FileCheck | None] | None): the caller's check of each file
            (``None``: none for that file).
        each_chunk (Callable[[int], None] | None): called with each chunk's byte count once it was
            written (progress; it may raise to stop the copy).

    Returns:
        dict[str, tuple[int, str]]: ``{name: (size_bytes, crc32c)}`` of the bytes copied.

    Raises:
        IncompleteCheckpointError: a source file is missing (gone since it was listed).
        IntegrityError: a file's size or CRC32C differs from what is expected of it, or a ranged
            read came back short or found an object of another size (names the file, its URL and
            the destination, where nothing is committed).
        Exception: whatever a check, ``each_chunk``, the source or the writer raise.
    """
    chunk = bytearray(CHUNK_BYTES)
    copied: dict[str, tuple[int, str]] = {}
    for file in files:
        copied[file.name] = _copy_file(source, file, txn, chunk, what, check(file) if check else None, each_chunk)
    return copied


def _copy_file(source: "Storage", file: SourceFile, txn: "Attempt", chunk: bytearray, what: str,
               file_check: FileCheck | None, each_chunk: Callable[[int], None] | None) -> tuple[int, str]:
    url = source.url(file.rel)
    label = f"{what} {file.name!r}"

    def missing() -> IncompleteCheckpointError:
        return IncompleteCheckpointError(f"{label} is missing at {url}; nothing committed at {txn.url}")

    try:
        reader = source.open_read_stream(file.rel, file.size_bytes)
    except Exception as exc:  # noqa: BLE001 - a missing file is named; anything else propagates
        if not is_missing(exc):
            raise
        raise missing() from exc
    crc = Crc32c()
    view = memoryview(chunk)
    try:
        with reader, txn.open(file.name) as writer:
            while crc.size_bytes <= file.size_bytes:
                try:
                    count = reader.readinto(view)
                except IntegrityError as exc:  # a short range, an object of another size
                    raise IntegrityError(f"{label}: {exc}; nothing committed at {txn.url}") from exc
                except Exception as exc:  # noqa: BLE001 - a file gone since it was listed is named
                    if not is_missing(exc):
                        raise
                    raise missing() from exc
                if not count:
                    break
                crc.update(view[:count])
                if file_check is not None:
                    file_check.update(view[:count])
                writer.write(view[:count])
                if each_chunk is not None:
                    each_chunk(count)
            read = f"read {crc.size_bytes} bytes, crc32c {crc.hexdigest()}"
            if file.crc32c is not None and (crc.size_bytes != file.size_bytes or crc.hexdigest() != file.crc32c):
                raise IntegrityError(f"{label} at {url} does not match its manifest (expected {file.size_bytes} "
                                     f"bytes, crc32c {file.crc32c}; {read}); nothing committed at {txn.url}")
            if crc.size_bytes != file.size_bytes:
                raise IntegrityError(f"{label} at {url} was listed with {file.size_bytes} bytes but {read}: it "
                                     f"changed while it was copied; nothing committed at {txn.url}")
            if file_check is not None:
                file_check.finish()
    finally:
        view.release()
    return crc.size_bytes, crc.hexdigest()


class _NoProgress:
    def set_size(self, size: int) -> None:
        pass

    def relative_update(self, inc: int = 1) -> None:
        pass


def copy_checkpoint(
    src: "CheckpointStore",
    step: int,
    dst: "CheckpointStore",
    *,
    callback: Progress | None = None,
    verify_deep: bool = True,
    cancelled: threading.Event | None = None,
) -> str:
    """Copy the committed checkpoint ``step`` of ``src`` into ``dst`` and commit it there, each
    payload through :func:`copy_files` against its manifest entry.

    The destination manifest lists the same payload names, sizes and CRC32C values, the same
    ``world_size`` and the same ``metadata`` as the source manifest; it gets its own attempt id,
    writer and ``created_at``. After the commit the copy is verified deeply (every object read
    back); a copy that fails is deleted again (manifest first).

    Args:
        src (CheckpointStore): the source store.
        step (int): a complete (manifest-committed) step of ``src``.
        dst (CheckpointStore): the destination store (any backend).
        callback (Progress | None): told the total payload bytes, then the bytes copied.
        verify_deep (bool): read the committed copy back whole and check every CRC32C
            (``opd-store cp``; default). ``False`` relies on the checks made while streaming
            (source CRC32C, the destination writer's own CRC32C and the commit's stored-size
            listing) and saves a second transfer of every byte: the local tier's uploads use it.
        cancelled (threading.Event | None): once set, the copy stops before its commit (between
            chunks at the latest) and raises :class:`~opd_store.errors.SaveAbandonedError`; the
            destination attempt is deleted (the background worker's exit deadline).

    Returns:
        str: the committed destination checkpoint URL (``dst.step_url(step)``).

    Raises:
        CheckpointNotFoundError: ``src`` has no checkpoint at ``step`` (``FileNotFoundError``).
        IncompleteCheckpointError: the source step is not complete, or a payload its manifest
            lists is missing.
        IntegrityError: a source payload differs from its manifest entry, or a ranged read of it
            came back short or found an object of another size (nothing is committed), or the
            committed copy fails deep verification (it is deleted).
        CommitConflictError: ``dst`` already holds ``step`` (``FileExistsError``); nothing written.
        ManifestError: the source manifest is unreadable.
        SaveAbandonedError: ``cancelled`` was set; nothing committed at ``dst``.
        OSError: a backend failure; the destination step is then not committed (an unreachable
            source endpoint: :class:`~opd_store.errors.StoreUnreachableError` naming the object).
    """
    callback = callback or _NoProgress()
    state = src.step_state(step)
    if state.status != COMPLETE:
        if state.status == UNCOMMITTED:
            raise CheckpointNotFoundError(f"no checkpoint at {src.step_url(step)} (step {step} is not committed)")
        raise IncompleteCheckpointError(f"cannot copy {src.step_url(step)}: step {step} is {state.status} "
                                        f"({'; '.join(p.detail for p in state.problems)})")
    manifest = state.manifest
    callback.set_size(manifest.total_size_bytes)
    files = [SourceFile(entry.name, manifest.object_rel(entry), entry.size_bytes, entry.crc32c)
             for entry in manifest.payloads]

    def each_chunk(count: int) -> None:
        callback.relative_update(count)
        if cancelled is not None and cancelled.is_set():
            raise SaveAbandonedError(
                f"copy of step {step} to {dst.url} abandoned before its commit (exit deadline passed); "
                "nothing committed there")

    with dst.begin(step, world_size=manifest.world_size, metadata=dict(manifest.metadata)) as txn:
        if cancelled is not None:
            txn.cancel_when(cancelled)
        copy_files(src.storage, files, txn, what=f"step {step}: source payload", each_chunk=each_chunk)
    url = txn.committed_url
    report = dst.verify(step, deep=True) if verify_deep else None
    if report is not None and not report.ok:
        dst.delete(step)
        raise IntegrityError(
            f"copy of step {step} at {url} failed verification and was deleted: "
            + "; ".join(f"{p.name}: {p.detail}" for p in report.problems)
        )
    logger.info("copied %s to %s (%d bytes)", src.step_url(step), url, manifest.total_size_bytes)
    return url


__all__ = ["CHUNK_BYTES", "FileCheck", "Progress", "SourceFile", "copy_checkpoint", "copy_files"]
