"""Import seed-layout OPD checkpoints into any store as manifest-committed checkpoints.

The seed wrote ``step-NNNNNN/`` directories holding ``COMPLETE``, ``training_state.pt``, ``rng.pt``
or ``rng-rank-XX.pt``, ``adapter/`` and ``config.yaml``. Those directories already load in place
(``load_opd_checkpoint`` and ``load_adapter`` accept them); :func:`migrate_legacy` copies them to a
store URL (a bucket, typically) so they gain a manifest with sizes and CRC32C checksums. Payload
names and bytes are kept exactly; the ``COMPLETE`` marker is dropped (the manifest replaces it).

Files that may be pickles (``.pt``, ``.bin``, ``.pth``) are read whole, to prove they load
weights-only; every other file (the adapter's weights, the processor's files) streams in bounded
memory, from a bucket over ``parts_in_flight`` ranged GETs at once (``Storage.open_read_stream``).

Each copy is verified: the destination manifest must list exactly the source's files with their
sizes and checksums, and every payload is read back through the store (which re-checks it against
the manifest) and its checksum compared with the source's. Migration is idempotent: a step already
committed at the destination with identical content is skipped and reported; different content is
a conflict, never overwritten.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from ..errors import CheckpointNotFoundError, CommitConflictError, IntegrityError, UnsafeCheckpointError
from ..format import Crc32c, crc32c_hex, step_dirname
from ..store import COMPLETE, LEGACY, UNCOMMITTED, CheckpointStore, as_store, stream_payload
from ._names import TRAINING_STATE
from ._safe_load import find_unsafe_globals, load_payload

logger = logging.getLogger("opd_store.opd")


class MigrationResult(list):
    """URLs of the checkpoints a migration committed, in step order (a ``list[str]``).

    Attributes:
        skipped (list[str]): URLs of steps already committed at the destination with content
            identical to the source, so not copied again.
    """

    def __init__(self, migrated: Iterable[str] = (), skipped: Iterable[str] = ()) -> None:
        super().__init__(migrated)
        self.skipped: list[str] = list(skipped)

    def __repr__(self) -> str:
        return f"MigrationResult(migrated={list(self)!r}, skipped={self.skipped!r})"


def _digests(store: CheckpointStore, step: int, names: list[str]) -> dict[str, tuple[int, str]]:
    out = {}
    for name in names:
        data = store.read(step, name)
        out[name] = (len(data), crc32c_hex(data))
    return out


def _destination_digests(dst: CheckpointStore, step: int, status: str) -> dict[str, tuple[int, str]]:
    if status == COMPLETE:
        return {entry.name: (entry.size_bytes, entry.crc32c) for entry in dst.manifest(step).payloads}
    return _digests(dst, step, dst.names(step))


def _differences(source: dict[str, tuple[int, str]], target: dict[str, tuple[int, str]]) -> list[str]:
    lines = []
    for name in sorted(set(source) | set(target)):
        if name not in target:
            lines.append(f"{name} (absent at destination)")
        elif name not in source:
            lines.append(f"{name} (only at destination)")
        elif source[name] != target[name]:
            lines.append(
                f"{name} (source {source[name][0]} bytes crc32c {source[name][1]}, destination "
                f"{target[name][0]} bytes crc32c {target[name][1]})"
            )
    return lines


def _metadata(payload: Any, source_url: str) -> tuple[int, dict[str, Any]]:
    metadata: dict[str, Any] = {"migrated_from": source_url, "source_layout": "seed"}
    world_size = 1
    if isinstance(payload, dict):
        trainer = payload.get("trainer") if isinstance(payload.get("trainer"), dict) else {}
        for key in ("attempted_updates", "successful_updates", "query_update"):
            value = trainer.get(key)
            if value is None or isinstance(value, (bool, int, float, str)):
                metadata[key] = value
        metadata["opd_schema"] = payload.get("schema")
        fingerprint = payload.get("config_fingerprint")
        metadata["config_fingerprint"] = fingerprint if isinstance(fingerprint, str) else None
        provenance = payload.get("provenance_fingerprints")
        if isinstance(provenance, dict) and all(isinstance(v, str) for v in provenance.values()):
            metadata["provenance_fingerprints"] = {str(k): v for k, v in provenance.items()}
        saved = payload.get("world_size")
        if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1:
            world_size = saved
    metadata["world_size"] = world_size
    return world_size, metadata


_PICKLED_SUFFIXES = (".pt", ".bin", ".pth")
"""Files that may be ``torch.save`` archives: read whole, to prove they load weights-only."""
_CHUNK_BYTES = 8 << 20


def _check_loadable(name: str, data: bytes, url: str) -> None:
    if not name.endswith(_PICKLED_SUFFIXES):
        return
    try:
        unsafe = find_unsafe_globals(data)
    except ValueError:
        return  # not a torch.save archive: copied as bytes, like any other file
    if unsafe:
        raise UnsafeCheckpointError(
            f"{url}/{name} needs plain pickle to load (it names {', '.join(unsafe)}); a migrated "
            "checkpoint is only ever loaded weights-only, so it would be unloadable. Load it from "
            "its local directory with allow_pickle=True and save it again with save_opd_checkpoint"
        )


def _copy_step(src: CheckpointStore, dst: CheckpointStore, step: int) -> str:
    source_url = src.step_url(step)
    names = src.names(step)
    if TRAINING_STATE not in names:
        raise CheckpointNotFoundError(f"seed checkpoint {source_url} has no {TRAINING_STATE}")
    state_bytes = src.read(step, TRAINING_STATE)
    _check_loadable(TRAINING_STATE, state_bytes, source_url)
    world_size, metadata = _metadata(
        load_payload(state_bytes, source=f"{source_url}/{TRAINING_STATE}"), source_url
    )
    digests: dict[str, tuple[int, str]] = {TRAINING_STATE: (len(state_bytes), crc32c_hex(state_bytes))}
    with dst.begin(step, world_size=world_size, metadata=metadata) as txn:
        txn.write_bytes(TRAINING_STATE, state_bytes)
        del state_bytes
        sizes = src.storage.list_tree(step_dirname(step))
        chunk = bytearray(_CHUNK_BYTES)
        for name in names:
            if name == TRAINING_STATE:
                continue
            if name.endswith(_PICKLED_SUFFIXES):
                data = src.read(step, name)
                _check_loadable(name, data, source_url)
                digests[name] = (len(data), crc32c_hex(data))
                txn.write_bytes(name, data)
            else:
                digests[name] = _stream_file(src, step, name, sizes.get(name, 0), txn, chunk)
    url = txn.committed_url
    try:
        _verify_copy(dst, step, digests, url)
    except IntegrityError:
        dst.delete(step)
        raise
    return url


def _stream_file(src: CheckpointStore, step: int, name: str, size_bytes: int, txn: Any,
                 chunk: bytearray) -> tuple[int, str]:
    """Stream the seed file ``name`` (listed with ``size_bytes``) into ``txn`` in bounded memory
    (from a bucket: parallel ranged GETs, ``Storage.open_read_stream``); its size and CRC32C.

    Raises:
        IntegrityError: a ranged read came back short, or the file is no longer ``size_bytes``
            long (changed while it was copied); nothing of the step is committed.
        OSError: the backend's failure (the file gone since the listing: ``FileNotFoundError``).
    """
    rel = f"{step_dirname(step)}/{name}"
    crc = Crc32c()
    with src.storage.open_read_stream(rel, size_bytes) as reader, txn.open(name) as writer:
        stream_payload(reader.readinto, writer, chunk, crc, limit_bytes=size_bytes)
        if crc.size_bytes != size_bytes:
            raise IntegrityError(f"{src.storage.url(rel)}: seed file {name!r} was listed with {size_bytes} bytes but "
                                 f"read with {'more' if crc.size_bytes > size_bytes else crc.size_bytes}; it changed "
                                 f"during the migration of step {step}, which is not committed")
    return crc.size_bytes, crc.hexdigest()


def _verify_copy(dst: CheckpointStore, step: int, digests: dict[str, tuple[int, str]], url: str) -> None:
    """The manifest must record the source's sizes and checksums, and every object, read back
    whole, must match its manifest entry (a deep verify recomputes each CRC32C)."""
    problems = _differences(digests, _destination_digests(dst, step, COMPLETE))
    report = dst.verify(step, deep=True)
    problems.extend(f"{problem.name} ({problem.detail})" for problem in report.problems)
    if report.status != COMPLETE and not report.problems:
        problems.append(f"status {report.status}")
    if problems:
        raise IntegrityError(f"migrated copy {url} differs from its source (deleted): {'; '.join(problems)}")


def migrate_legacy(
    src_dir: str | os.PathLike | CheckpointStore,
    dst: str | os.PathLike | CheckpointStore,
    *,
    storage_options: dict[str, Any] | None = None,
    steps: Iterable[int] | None = None,
) -> list[str]:
    """Copy seed-layout checkpoints into a store as manifest-committed, verified checkpoints.

    Steps are copied in ascending order, one commit each; a failure stops the migration with the
    earlier steps committed (run it again: they are then skipped as identical).

    Rank obligations: one process runs it (it is not part of training).

    Args:
        src_dir (str | os.PathLike | CheckpointStore): the seed's checkpoints directory (its
            ``step-NNNNNN`` directories with ``COMPLETE``); a local path, or a store.
        dst (str | os.PathLike | CheckpointStore): destination store: local path, fsspec URL or
            store.
        storage_options (dict | None): fsspec options for ``dst`` when it is a URL.
        steps (Iterable[int] | None): only these steps; default every seed-layout step of
            ``src_dir`` (steps without ``COMPLETE`` are seed saves that never finished and are
            ignored, as the seed ignored them).

    Returns:
        list[str]: a :class:`MigrationResult`: URLs of the newly committed checkpoints, in step
        order; its ``skipped`` attribute lists the URLs of steps already at the destination with
        identical content.

    Raises:
        FileNotFoundError: a requested step is not a seed-layout checkpoint of ``src_dir``
            (:class:`~opd_store.errors.CheckpointNotFoundError`), or one lacks
            ``training_state.pt``.
        FileExistsError: the destination step holds different content, or an incomplete or
            corrupt checkpoint (:class:`~opd_store.errors.CommitConflictError`, naming the
            differing files); nothing is overwritten.
        UnsafeCheckpointError: (a ``ValueError``) a source ``.pt`` payload needs plain pickle, so
            its copy could never be loaded; nothing of that step is committed.
        IntegrityError: (a ``ValueError``) the read-back differs from the source; that copy is
            deleted.
    """
    src = as_store(src_dir)
    target = as_store(dst, storage_options)
    infos = {info.step: info for info in src.checkpoints()}
    legacy_steps = [step for step, info in sorted(infos.items()) if info.status == LEGACY]
    if steps is None:
        selected = legacy_steps
        ignored = sorted(set(infos) - set(legacy_steps))
        if ignored:
            logger.info("migrate_legacy(%s): not seed-layout checkpoints, ignored: %s", src.url, ignored)
    else:
        selected = sorted({int(step) for step in steps})
        absent = [step for step in selected if step not in legacy_steps]
        if absent:
            details = ", ".join(f"{step} ({infos[step].status if step in infos else 'absent'})" for step in absent)
            raise CheckpointNotFoundError(f"{src.url} has no seed-layout checkpoint for step(s) {details}")
    result = MigrationResult()
    for step in selected:
        report = target.verify(step)
        if report.status == UNCOMMITTED:
            url = _copy_step(src, target, step)
            logger.info("migrated %s to %s", src.step_url(step), url)
            result.append(url)
            continue
        if report.status not in (COMPLETE, LEGACY):
            raise CommitConflictError(
                f"cannot migrate {src.step_url(step)}: {report.url} holds a {report.status} checkpoint; "
                "delete it first"
            )
        source = _digests(src, step, src.names(step))
        differences = _differences(source, _destination_digests(target, step, report.status))
        if differences:
            raise CommitConflictError(
                f"cannot migrate {src.step_url(step)}: {report.url} already holds step {step} with "
                f"different content: {'; '.join(differences)}"
            )
        logger.info("migrate_legacy: %s already holds identical step %d; skipped", report.url, step)
        result.skipped.append(report.url)
    return result


__all__ = ["MigrationResult", "migrate_legacy"]
