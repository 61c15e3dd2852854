"""Copy one committed checkpoint between stores, committed at the destination with the same protocol.

Used by ``opd-store cp`` and by the tiered store's uploads. The copy streams payload by payload (never
a whole payload in memory): each source object is read in chunks through one reused buffer straight
into a destination payload writer, and its size and CRC32C are computed over the bytes as they pass;
a size or CRC32C that differs from the source manifest aborts the attempt before anything is
committed. The source is read with ``Storage.open_read_stream`` of the manifest's size: from S3,
``parts_in_flight`` ranged GETs of ``part_size_bytes`` at once in at most that many reused part
buffers (:mod:`opd_store.storage.transfers._range_stream`), so a copy moves over several connections in
bounded memory; the destination writes in parallel parts as every save does. After the commit, the destination
is verified deeply (every object read back, sizes and CRC32C against its manifest); a copy that
fails that check is deleted again (manifest first) and reported.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, BinaryIO, Callable, Protocol

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError, SaveAbandonedError
from ..format import Crc32c, PayloadEntry, step_dirname
from ..storage import is_missing
from ._checkpoint_store import CheckpointStore
from ._status import COMPLETE, LEGACY

if TYPE_CHECKING:
    from ..commit import Transaction

logger = logging.getLogger("opd_store.store")

_CHUNK_BYTES = 8 << 20


class Progress(Protocol):
    """A copy's progress: ``set_size`` once with the total payload bytes, then ``relative_update``
    with the bytes of each chunk copied (an fsspec ``Callback`` fits, as does the CLI's bar)."""

    def set_size(self, size: int) -> None: ...

    def relative_update(self, inc: int = 1) -> None: ...


class _NoProgress:
    def set_size(self, size: int) -> None:
        pass

    def relative_update(self, inc: int = 1) -> None:
        pass


def copy_checkpoint(
    src: CheckpointStore,
    step: int,
    dst: CheckpointStore,
    *,
    callback: Progress | None = None,
    verify_deep: bool = True,
    cancelled: threading.Event | None = None,
) -> str:
    """Copy the committed checkpoint ``step`` of ``src`` into ``dst`` and commit it there.

    The destination manifest lists the same payload names, sizes and CRC32C values, the same
    ``world_size`` and the same ``metadata`` as the source manifest; it gets its own attempt id,
    writer and ``created_at``.

    Args:
        src (CheckpointStore): the source store.
        step (int): a complete (manifest-committed) step of ``src``.
        dst (CheckpointStore): the destination store (any backend).
        callback (Progress | None): told the total payload bytes, then the bytes copied.
        verify_deep (bool): after the commit, read the destination copy back whole and check every
            CRC32C (``opd-store cp``; default). ``False`` relies on the checks made while streaming
            (source CRC32C, the destination writer's own CRC32C and the commit's stored-size
            listing) and saves a second transfer of every byte: the local tier's uploads use it.
        cancelled (threading.Event | None): once set, the copy stops before its commit (between
            chunks at the latest) and raises :class:`~opd_store.errors.SaveAbandonedError`; the
            destination attempt is deleted (the background worker's exit deadline).

    Returns:
        str: the committed destination checkpoint URL (``dst.step_url(step)``).

    Raises:
        CheckpointNotFoundError: ``src`` has no checkpoint at ``step`` (``FileNotFoundError``).
        IncompleteCheckpointError: the source step is not complete (incomplete, corrupt, or a
            legacy seed-layout step, which has no manifest: use ``opd-store migrate``).
        IntegrityError: a source payload's bytes differ from its manifest entry, or a ranged read
            of it came back short or found an object of another size (the message names the step,
            the payload and the object; nothing is committed), or the committed destination copy
            fails deep verification (it is deleted).
        CommitConflictError: ``dst`` already holds ``step`` (``FileExistsError``); nothing written.
        ManifestError: the source manifest is unreadable.
        SaveAbandonedError: ``cancelled`` was set; nothing committed at ``dst``.
        OSError: a backend failure; the destination step is then not committed (an unreachable
            source endpoint: :class:`~opd_store.errors.StoreUnreachableError` naming the object).
    """
    callback = callback or _NoProgress()
    status = src.status(step)
    if status == LEGACY:
        raise IncompleteCheckpointError(
            f"{src.step_url(step)} is a seed-layout (legacy) checkpoint without a manifest; "
            "import it with `opd-store migrate` instead"
        )
    if status != COMPLETE:
        if status == "uncommitted":
            raise CheckpointNotFoundError(f"no checkpoint at {src.step_url(step)} (step {step} is not committed)")
        report = src.verify(step)
        raise IncompleteCheckpointError(
            f"cannot copy {src.step_url(step)}: step {step} is {status} "
            f"({'; '.join(p.detail for p in report.problems)})"
        )
    manifest = src.manifest(step)
    callback.set_size(manifest.total_size_bytes)
    prefix = step_dirname(step)
    with dst.begin(step, world_size=manifest.world_size, metadata=dict(manifest.metadata)) as txn:
        if cancelled is not None:
            txn.cancel_when(cancelled)
        chunk = bytearray(_CHUNK_BYTES)  # one reused buffer between the source reader and the writer
        for entry in manifest.payloads:
            _copy_payload(src, step, entry, txn, dst.url, chunk, callback, cancelled)
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


def stream_payload(read_into: Callable[[memoryview], int], writer: BinaryIO, chunk: bytearray, crc: Crc32c, *,
                   limit_bytes: int, each_chunk: Callable[[int], None] | None = None) -> None:
    """Copy a source into ``writer`` through the reused buffer ``chunk``, updating ``crc`` (size
    and CRC32C) with every byte before it is written; stops at the end of the source or once more
    than ``limit_bytes`` passed (the caller compares ``crc`` with what it expected).

    Args:
        read_into (Callable[[memoryview], int]): fills the view it is given from the source and
            returns the bytes filled, 0 at its end (a reader's ``readinto``, from
            ``Storage.open_read_stream``).
        writer (BinaryIO): a payload writer (``Transaction.open``).
        chunk (bytearray): the buffer each read lands in (its length is the chunk size).
        crc (Crc32c): updated in place.
        limit_bytes (int): the size expected of the source.
        each_chunk (Callable[[int], None] | None): called with each chunk's byte count after it
            was written (progress; it may raise to stop the copy).

    Raises:
        Exception: whatever ``read_into``, the writer or ``each_chunk`` raise.
    """
    view = memoryview(chunk)
    try:
        while crc.size_bytes <= limit_bytes:
            count = read_into(view)
            if not count:
                return
            crc.update(view[:count])
            writer.write(view[:count])
            if each_chunk is not None:
                each_chunk(count)
    finally:
        view.release()


def _copy_payload(src: CheckpointStore, step: int, entry: PayloadEntry, txn: "Transaction", dst_url: str,
                  chunk: bytearray, callback: Progress, cancelled: threading.Event | None) -> None:
    """Stream one source payload into ``txn`` through ``chunk``, checking its size and CRC32C
    against ``entry`` before the payload is closed (see :func:`copy_checkpoint` for the errors)."""
    rel = f"{step_dirname(step)}/{entry.path}"
    source_url = src.storage.url(rel)

    def missing(exc: BaseException) -> IncompleteCheckpointError:
        return IncompleteCheckpointError(
            f"step {step}: payload {entry.name!r} listed in the manifest is missing at {source_url}")

    try:
        reader = src.storage.open_read_stream(rel, entry.size_bytes)
    except Exception as exc:  # noqa: BLE001 - a missing payload is named; anything else propagates
        if not is_missing(exc):
            raise
        raise missing(exc) from exc

    def read_into(view: memoryview) -> int:
        try:
            return reader.readinto(view)
        except IntegrityError as exc:  # a short range, an object of another size: named with the step
            raise IntegrityError(f"step {step}: source payload {entry.name!r}: {exc}; nothing committed at "
                                 f"{dst_url}") from exc
        except Exception as exc:  # noqa: BLE001 - a payload gone since the listing is named
            if not is_missing(exc):
                raise
            raise missing(exc) from exc

    def each_chunk(count: int) -> None:
        callback.relative_update(count)
        if cancelled is not None and cancelled.is_set():
            raise SaveAbandonedError(
                f"copy of step {step} to {dst_url} abandoned before its commit (exit deadline passed); "
                "nothing committed there")

    crc = Crc32c()
    with reader, txn.open(entry.name) as writer:
        stream_payload(read_into, writer, chunk, crc, limit_bytes=entry.size_bytes, each_chunk=each_chunk)
        if crc.size_bytes != entry.size_bytes or crc.hexdigest() != entry.crc32c:
            raise IntegrityError(
                f"step {step}: source payload {entry.name!r} at {source_url} does not match its "
                f"manifest (expected {entry.size_bytes} bytes, crc32c {entry.crc32c}; read "
                f"{crc.size_bytes} bytes, crc32c {crc.hexdigest()}); nothing committed at {dst_url}"
            )


__all__ = ["copy_checkpoint", "stream_payload"]
