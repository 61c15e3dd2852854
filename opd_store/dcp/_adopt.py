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
3. The files are copied, one at a time, into a new attempt of the destination step (CRC32C
   computed as they stream) and the manifest is created only if absent. The source files are not
   touched (opd_store never deletes what it did not write; remove them once the copy is verified).
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from ..errors import IncompleteCheckpointError
from ..storage import open_storage
from ..store import BaseStore, as_store
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


def _check_file(data: bytes, name: str, items: list, metadata: Any, where: str) -> None:
    """Every item of one file deserialises as what the metadata says it is."""
    for index, info in items:
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{where}: item {index.fqn!r} uses stream transforms {list(info.transform_descriptors)}, "
                             "which opd_store does not read")
        end = info.offset + info.length
        if end > len(data):
            raise IncompleteCheckpointError(f"{where}: {describe_file(name)} is truncated: item {index.fqn!r} ends at "
                                            f"byte {end}, the file has {len(data)} bytes")
        view = memoryview(data)[info.offset:end]
        chunk = _chunk_of(metadata, index)
        if chunk is None:
            check_weights_only(view, what=f"{where}: {describe_file(name)}: key {index.fqn!r}")
            continue
        tensor = torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
        sizes, dtype = chunk
        if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != sizes or tensor.dtype != dtype:
            got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{where}: {describe_file(name)}: {index.fqn!r} holds {got}, the metadata says "
                             f"{tuple(sizes)} {dtype}")


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
    ranks = {rank for rank in map(writer_rank, per_file) if rank is not None}
    destination = as_store(store, storage_options)
    txn = destination.begin(step, world_size=max(ranks) + 1 if ranks else 1, metadata={
        "checkpoint_format": "dcp", "dcp_world_size": max(ranks) + 1 if ranks else 1, "adopted_from": where})
    with txn:
        for name in sorted(per_file):
            data = source_storage.read_bytes(name)
            _check_file(data, name, per_file[name], metadata, where)
            txn.write_bytes(name, data)
        txn.write_bytes(METADATA_NAME, metadata_bytes)
    return txn.committed_url


__all__ = ["adopt_dcp_checkpoint"]
