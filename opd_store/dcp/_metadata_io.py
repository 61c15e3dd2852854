"""DCP's checkpoint metadata as an opd_store payload: names, encoding, and a safe decoder.

DCP reads its ``Metadata`` with ``pickle.load``, which runs whatever code the file names; a
checkpoint in a shared bucket must never do that. It is written as DCP's ``FileSystemWriter``
writes it (``.metadata``, so an attempt prefix is a DCP directory) and read by
:func:`loads_metadata`, which constructs only DCP's metadata classes and torch atoms. Data files
are DCP's ``__<rank>_<n>.distcp``; the rank in the name is how errors name a file's rank.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

from ..errors import UnsafeCheckpointError

METADATA_NAME = ".metadata"
"""DCP's metadata payload (DCP's ``_metadata_fn``)."""
DATA_SUFFIX = ".distcp"
SHARD_FILE = 0
"""Index of the file holding a rank's chunks of sharded tensors (``__<rank>_0.distcp``)."""
SHARED_FILE = 1
"""Index of the file holding everything else a rank writes (``__<rank>_1.distcp``): whole tensors
and objects, which DCP deduplicates across ranks and every loading rank needs."""
_DATA_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")

_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    # StorageMeta.checkpoint_id of checkpoints written by DCP's own writers is a path object.
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def data_file_name(rank: int, index: int) -> str:
    """``__<rank>_<index>.distcp``: file ``index`` written by ``rank`` (DCP's spelling)."""
    return f"__{rank}_{index}{DATA_SUFFIX}"


def writer_rank(name: str) -> int | None:
    """The rank that wrote the DCP data file ``name``, or ``None`` for any other name."""
    match = _DATA_RE.fullmatch(name.rsplit("/", 1)[-1])
    return None if match is None else int(match.group(1))


def describe_file(name: str) -> str:
    """``rank 1's DCP file __1_0.distcp`` (or ``DCP file NAME`` when no rank is in the name)."""
    rank = writer_rank(name)
    return f"DCP file {name}" if rank is None else f"rank {rank}'s DCP file {name}"


class _MetadataUnpickler(pickle.Unpickler):
    """Constructs DCP's metadata classes and torch atoms only; refuses every other global."""

    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise UnsafeCheckpointError(
            f"{self._source}: refused to load DCP metadata naming {module}.{name}: only DCP's metadata "
            "classes and torch's Size, dtypes and layouts are allowed (loading it would run code "
            "named by the file)"
        )


def dumps_metadata(metadata: Any) -> bytes:
    """DCP ``Metadata`` as bytes, exactly as DCP's ``FileSystemWriter.finish`` writes it."""
    return pickle.dumps(metadata)


def loads_metadata(data: bytes, *, source: str) -> Any:
    """Decode a ``.metadata`` payload (already verified) without running code; ``source`` names errors.

    Returns:
        torch.distributed.checkpoint.metadata.Metadata: with ``storage_data`` placing each item.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) the pickle names any other global.
        ValueError: not a pickle of a DCP ``Metadata`` object.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a damaged payload
        raise ValueError(f"{source}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"{source}: not DCP checkpoint metadata (got {type(metadata).__name__})")
    return metadata


__all__ = [
    "DATA_SUFFIX",
    "METADATA_NAME",
    "SHARD_FILE",
    "SHARED_FILE",
    "data_file_name",
    "describe_file",
    "dumps_metadata",
    "loads_metadata",
    "writer_rank",
]
