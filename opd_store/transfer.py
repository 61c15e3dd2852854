"""Copy one committed checkpoint from one store to another, with the commit protocol at both ends.

A minimal implementation written for the local tier (issue 8, item 3); the issue-6 engineer
writes the full one with this exact signature, and this module is replaced by theirs at merge.

The copy is never a backend copy or rename: every payload is read from ``src`` (checked against
``src``'s manifest: size and CRC32C), streamed into a new attempt at ``dst`` (size and CRC32C
recomputed on the way in), compared with ``src``'s entry, and only then is ``dst``'s manifest
created, create-only, last. So ``dst`` holds the step exactly when every payload landed with the
recorded bytes, and ``dst``'s manifest records the same payload names, sizes and CRC32Cs as
``src``'s (the attempt id, writer and commit time are ``dst``'s own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsspec.callbacks import DEFAULT_CALLBACK

from .errors import IntegrityError

if TYPE_CHECKING:
    from fsspec.callbacks import Callback

    from .store import CheckpointStore

_COPY_CHUNK_BYTES = 8 << 20


def copy_checkpoint(src: "CheckpointStore", step: int, dst: "CheckpointStore", *, callback: "Callback | None" = None) -> str:
    """Copy the committed checkpoint ``step`` of ``src`` to ``dst`` and commit it there.

    Payloads are copied one by one, in manifest order, each read whole from ``src`` (checked
    against its manifest entry) and streamed into ``dst`` under a new attempt; ``dst``'s manifest
    (same ``world_size`` and ``metadata``, same payload names, sizes and CRC32Cs) is created only
    after every payload matched. A failure at any point aborts ``dst``'s attempt: nothing is
    committed there, and ``src`` is only read.

    Args:
        src (CheckpointStore): the store holding the complete, manifest-committed step.
        step (int): the step to copy.
        dst (CheckpointStore): the destination store; the step must not exist there.
        callback (fsspec.callbacks.Callback | None): progress; ``set_size`` receives the total
            payload bytes, ``relative_update`` each copied chunk's byte count (``TqdmCallback``
            shows a progress bar).

    Returns:
        str: the committed checkpoint URL at ``dst`` (its step prefix).

    Raises:
        CheckpointNotFoundError: ``src`` has no manifest for ``step``.
        ManifestError: ``src``'s manifest does not parse.
        IncompleteCheckpointError: a payload ``src``'s manifest names is missing.
        IntegrityError: a payload's size or CRC32C differs from ``src``'s manifest, at the read
            or after landing in ``dst`` (the message names both URLs, the step and the payload).
        CommitConflictError: ``dst`` already holds ``step`` (committed or legacy), or another
            writer committed it first.
        CommitError, AmbiguousCommitError: ``dst``'s manifest create failed (see
            docs/protocol.md).
        OSError: a backend failure while reading or writing.
    """
    callback = callback if callback is not None else DEFAULT_CALLBACK
    manifest = src.manifest(step)
    callback.set_size(manifest.total_size_bytes)
    with dst.begin(step, world_size=manifest.world_size, metadata=dict(manifest.metadata),
                   rank=manifest.writer.rank) as txn:
        for entry in manifest.payloads:
            with src.open(step, entry.name, manifest=manifest) as reader, txn.open(entry.name) as writer:
                while True:
                    chunk = reader.read(_COPY_CHUNK_BYTES)
                    if not chunk:
                        break
                    writer.write(chunk)
                    callback.relative_update(len(chunk))
            landed = next(e for e in txn.entries if e.name == entry.name)
            if (landed.size_bytes, landed.crc32c) != (entry.size_bytes, entry.crc32c):
                raise IntegrityError(
                    f"copy of step {step} payload {entry.name!r} from {src.step_url(step)} to {txn.url}: "
                    f"landed {landed.size_bytes} bytes crc32c {landed.crc32c}, source manifest says "
                    f"{entry.size_bytes} bytes crc32c {entry.crc32c}"
                )
    return txn.committed_url


__all__ = ["copy_checkpoint"]
