"""Adopt a checkpoint DCP's own writers wrote (no manifest): verify it, then commit a copy.

``FileSystemWriter``/``FsspecWriter`` leave a directory of ``.metadata`` and ``__<rank>_<n>.distcp``
files and no commit record. Written into a store's prefix (``<store>/step-000007/``), it is *not* a
checkpoint of that store: the step has no manifest, so every reader skips it and ``opd-store ls
--all`` shows it as ``uncommitted``. :func:`adopt_dcp_checkpoint` (``opd-store import-dcp``) makes
it one:

1. ``.metadata`` is decoded without running code (:func:`~opd_store.dcp._metadata_io.loads_metadata`);
   stream transforms (compression extensions) are refused.
2. Every data file the metadata names must exist and hold every item it places there; every item
   is deserialised: objects with ``torch.load(weights_only=True)``, tensors likewise, each with the
   shape and dtype the metadata gives its chunk. DCP's files carry no checksums, so this structural
   check is what "verified" can mean for them.
3. The world size recorded is the number of ranks whose writers left a data file
   (``__<rank>_<n>.distcp``, with items or, for a rank DCP gave nothing to write, empty).
4. The files stream, one at a time, into a new attempt of the destination step through the one copy
   routine (:func:`opd_store.store.copy_files`: CRC32C computed as they pass, bounded memory), each
   item checked as its bytes go by (step 2: only the item being read is held, never a whole file),
   and the manifest is created only if absent. The source files are not touched (opd_store never
   deletes what it did not write; remove them once the copy is verified).
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from ..errors import IncompleteCheckpointError
from ..storage import open_storage
from ..store import BaseStore, SourceFile, as_store, copy_files
from ._items import check_weights_only
from ._metadata_io import METADATA_NAME, describe_file, loads_metadata, writer_rank


def _chunk_of(metadata: Any, index: Any) -> tuple[list[int], Any] | None:
    """``(sizes, dtype)`` of the tensor chunk ``index`` names, or ``None`` for an object item."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entry = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(entry, TensorStorageMetadata):
        return None
    offsets = list(index.offset) if index.offset is not None else [0] * len(entry.size)
    for chunk in entry.chunks:
        if list(chunk.offsets) == offsets:
            return list(chunk.sizes), entry.properties.dtype
    raise ValueError(f"no chunk at offsets {offsets} of {index.fqn!r}")


class _ItemCheck:
    """Every item of one DCP file deserialises as what the metadata says it is, checked as the
    file streams by: each item's bytes are kept only from its first byte to its last (a view of the
    chunk when it lies within one), never the whole file (a :class:`~opd_store.store.FileCheck`)."""

    def __init__(self, name: str, items: list, metadata: Any, where: str) -> None:
        for index, info in items:
            if getattr(info, "transform_descriptors", None):
                raise ValueError(f"{where}: item {index.fqn!r} uses stream transforms "
                                 f"{list(info.transform_descriptors)}, which opd_store does not read")
        self._name, self._metadata, self._where = name, metadata, where
        self._items = sorted(items, key=lambda item: item[1].offset)  # (MetadataIndex, _StorageInfo)
        self._next = 0  # the first item not checked yet
        self._pos = 0  # bytes of the file seen so far
        self._held = bytearray()  # the bytes of the item under way that arrived in earlier chunks

    def update(self, view: memoryview) -> None:
        start, end = self._pos, self._pos + len(view)
        while self._next < len(self._items):
            index, info = self._items[self._next]
            item_start, item_end = info.offset, info.offset + info.length
            if item_start >= end:
                break
            have = view[max(item_start, start) - start:min(item_end, end) - start]
            if item_end > end:  # the item goes on in the next chunk
                self._held += have
                break
            if self._held:
                self._held += have
                have, self._held = bytes(self._held), bytearray()
            self._check_item(index, have)
            self._next += 1
        self._pos = end

    def finish(self) -> None:
        if self._next < len(self._items):
            index, info = self._items[self._next]
            raise IncompleteCheckpointError(
                f"{self._where}: {describe_file(self._name)} is truncated: item {index.fqn!r} ends at byte "
                f"{info.offset + info.length}, the file has {self._pos} bytes")

    def _check_item(self, index: Any, data: bytes | memoryview) -> None:
        what = f"{self._where}: {describe_file(self._name)}"
        chunk = _chunk_of(self._metadata, index)
        if chunk is None:
            check_weights_only(data, what=f"{what}: key {index.fqn!r}")
            return
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - damaged bytes, named with the item
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"{what}: {index.fqn!r} does not load as a tensor: {first}") from exc
        sizes, dtype = chunk
        if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != sizes or tensor.dtype != dtype:
            got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{what}: {index.fqn!r} holds {got}, the metadata says {tuple(sizes)} {dtype}")


def adopt_dcp_checkpoint(source: str | os.PathLike, store: BaseStore | str | os.PathLike, step: int, *,
                         storage_options: dict[str, Any] | None = None,
                         source_storage_options: dict[str, Any] | None = None) -> str:
    """Verify the DCP checkpoint directory ``source`` and commit a copy as ``step`` of ``store``.

    Args:
        source (str | os.PathLike): the directory DCP wrote (local path or fsspec URL); it may be
            the destination's own ``step-NNNNNN/`` prefix.
        store (BaseStore | str | os.PathLike): the destination store.
        step (int): the step to commit (not committed yet).
        storage_options (dict | None): fsspec options of ``store`` when it is a URL.
        source_storage_options (dict | None): fsspec options of ``source`` (default: ``storage_options``).

    Returns:
        str: the committed checkpoint's URL.

    Raises:
        CheckpointNotFoundError: ``source`` has no ``.metadata``.
        IncompleteCheckpointError: a data file is missing or shorter than its items (named with
            the rank that wrote it).
        UnsafeCheckpointError: the metadata or an object item would need code to load.
        ValueError: an item is not what the metadata says, or uses stream transforms.
        CommitConflictError: ``step`` is already committed in ``store``.
    """
    from ..errors import CheckpointNotFoundError

    options = storage_options if source_storage_options is None else source_storage_options
    source_storage = open_storage(os.fspath(source), options)
    where = source_storage.url_root
    listed = {name: size for name, size in source_storage.list_tree("").items() if "/" not in name}
    if METADATA_NAME not in listed:
        raise CheckpointNotFoundError(f"{where}: no DCP checkpoint here (no {METADATA_NAME})")
    metadata_bytes = source_storage.read_bytes(METADATA_NAME)
    metadata = loads_metadata(metadata_bytes, source=f"{where}/{METADATA_NAME}")
    per_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((index, info))
    missing = sorted(name for name in per_file if name not in listed)
    if missing:
        raise IncompleteCheckpointError(f"{where}: cannot adopt it as step {step}: "
                                        + "; ".join(f"{describe_file(name)} is missing" for name in missing))
    # Every rank's writer leaves its files, items or none (a rank whose state DCP deduplicated onto
    # another writes an empty __<rank>_0.distcp): the world size counts them all, not only the ranks
    # the metadata places items with, and every rank's file is copied.
    rank_files = {name for name in listed if writer_rank(name) is not None} | set(per_file)
    ranks = {rank for rank in map(writer_rank, rank_files) if rank is not None}
    world_size = max(ranks) + 1 if ranks else 1
    destination = as_store(store, storage_options)
    txn = destination.begin(step, world_size=world_size, metadata={
        "checkpoint_format": "dcp", "dcp_world_size": world_size, "adopted_from": where})
    with txn:
        copy_files(source_storage, [SourceFile(name, name, listed[name]) for name in sorted(rank_files)], txn,
                   what=f"{where}: DCP file",
                   check=lambda file: (_ItemCheck(file.name, per_file[file.name], metadata, where)
                                       if file.name in per_file else None))
        txn.write_bytes(METADATA_NAME, metadata_bytes)
    return txn.committed_url


__all__ = ["adopt_dcp_checkpoint"]
