"""DCP items in opd_store payloads: written back to back into one payload, read back from one.

The byte format is DCP's own (``torch.distributed.checkpoint.filesystem``): a data file is its
items one after the other, a tensor item is one ``torch.save`` archive of that tensor (a chunk of a
sharded tensor: only the chunk's elements), an object item is the bytes DCP's planner produced
(``torch.save`` of the object). Each item's place is a ``_StorageInfo(relative_path, offset,
length)`` in the checkpoint metadata, so DCP's own readers read these files too.

Two rules of opd_store are added on top of DCP's:

* objects must load with ``torch.load(weights_only=True)``: checked when they are written (the save
  fails naming the key, instead of a resume weeks later), and again before the bytes are handed to
  DCP's planner, whose ``load_bytes`` uses ``weights_only=False`` (a checkpoint from a bucket never
  runs code on load);
* tensors are written with :func:`opd_store.format._torch_io.torch_save` (no zip CRC-32: the payload's
  CRC32C in the manifest covers the bytes and is checked before any item is read).

Stream transforms (DCP's extensions, ``torch.distributed.checkpoint._extension``: ``ZStandard``
compression, or a caller's own ``StreamTransformExtension``) apply per item exactly as DCP's
``FileSystemWriter(_extensions=...)`` applies them: each item's bytes pass through the transforms
on their way into the file, its ``StorageInfo.transform_descriptors`` names them, and a reader
rebuilds them from those names through an ``ExtensionRegistry`` (DCP's ``FileSystemReader`` reads
such files too). The manifest's CRC32C covers the transformed bytes as stored.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, BinaryIO

import torch

from ..errors import StreamTransformError, UnsafeCheckpointError
from ..format import torch_save

try:  # the class DCP's readers expect; same fields since torch 2.0
    from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
except ImportError:  # pragma: no cover - a torch without it: a dataclass with the same fields

    @dataclasses.dataclass
    class StorageInfo:  # type: ignore[no-redef]
        relative_path: str
        offset: int
        length: int
        transform_descriptors: Any = None


def _cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor holding exactly ``tensor``'s elements (a view of a larger storage would make
    ``torch.save`` write the whole storage)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


class _CoalescedWriter:
    """Small writes gathered into writes of up to ``limit_bytes``; large ones passed on as they are.

    ``torch.save`` hands its writer a few records per tensor plus many small pieces of pickle
    (about 350 ``write`` calls per MiB of a typical optimizer state); each payload-writer call
    checksums and slices, so gathering the small ones saves most of that per-call cost (measured in
    ``bench/dcp.py``) while a tensor's storage (one large write) is never copied.
    """

    def __init__(self, writer: BinaryIO, limit_bytes: int = 1 << 20) -> None:
        self._writer = writer
        self._pending = bytearray()
        self._limit = limit_bytes
        self._position = writer.tell()

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size >= self._limit:
            self.flush()
            self._writer.write(data)
        else:
            self._pending += data
            if len(self._pending) >= self._limit:
                self.flush()
        self._position += size
        return size

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        if self._pending:
            self._writer.write(self._pending)
            self._pending = bytearray()


class _Unclosable(io.RawIOBase):
    """The payload stream as a transform's output: a transform closes its output when its item
    ends (a zstd frame is finished by ``close``), which must not end the payload (DCP's
    ``NoCloseWriter`` does the same)."""

    def __init__(self, stream: "_CoalescedWriter") -> None:
        super().__init__()
        self._stream = stream

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        return self._stream.write(data)


def _transformed(stream: "_CoalescedWriter", extensions) -> tuple[BinaryIO, list[str]]:
    """``stream`` behind ``extensions`` (DCP's order) and their descriptors as DCP records them."""
    target: Any = _Unclosable(stream)
    for extension in extensions:
        target = extension.transform_to(target)
    return target, [extension.get_descriptor() for extension in reversed(extensions)]


def resolve_transforms(descriptors, registry: Any, *, where: str) -> list:
    """The extensions named by an item's ``transform_descriptors``, from ``registry``.

    Args:
        descriptors (Sequence[str]): e.g. ``["stream.zstd/1"]``.
        registry (ExtensionRegistry): DCP's registry (its default knows ``ZStandard``).
        where (str): the checkpoint URL, step and file, for the error.

    Raises:
        StreamTransformError: (a ``ValueError``) a transform the registry does not know, or whose
            package is missing (ZStandard without ``zstandard``/``pyzstd``), naming ``where``.
    """
    try:
        return list(registry.from_descriptor_list(list(descriptors)))
    except Exception as exc:  # noqa: BLE001 - every refusal means this reader cannot decode the file
        raise StreamTransformError(
            f"{where} was written through stream transform(s) {list(descriptors)}, which this reader cannot "
            f"apply ({exc}); pass StoreReader(..., extension_registry=...) with them registered, or install "
            "their package"
        ) from exc


def _untransformed(data: bytes, extensions: list) -> bytes:
    """``data`` read back through ``extensions`` (resolved by :func:`resolve_transforms`)."""
    stream: Any = io.BytesIO(data)
    for extension in extensions:
        stream = extension.transform_from(stream)
    return stream.read(-1)


def check_weights_only(data: bytes | memoryview, *, what: str) -> None:
    """Refuse object bytes that ``torch.load(weights_only=True)`` cannot restore.

    Raises:
        UnsafeCheckpointError: (a ``ValueError``) naming ``what`` (the key, the file) and torch's reason.
    """
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every refusal means the same thing here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeCheckpointError(
            f"{what}: weights-only loading cannot restore this object, so it is not checkpoint state "
            f"opd_store writes or reads (convert it to tensors and plain containers): {first}"
        ) from exc


def write_items(writer: BinaryIO, name: str, items: list, planner: Any, extensions=()) -> list:
    """Write ``items`` back to back into ``writer`` (a payload writer of file ``name``).

    Args:
        writer (BinaryIO): positioned at 0; its ``tell()`` gives each item's offset.
        name (str): the file's name relative to the checkpoint (recorded in each result).
        items (list[WriteItem]): DCP write items; ``planner.resolve_data(item)`` gives a tensor
            (any device; copied to the CPU here) or a ``BytesIO`` (objects).
        planner (SavePlanner): DCP's planner of this save.
        extensions (Sequence[StreamTransformExtension]): DCP's stream transforms, applied to each
            item (none by default).

    Returns:
        list[WriteResult]: one per item, in order, with ``StorageInfo(name, offset, length,
        transform_descriptors)`` (the length as stored, after the transforms).

    Raises:
        UnsafeCheckpointError: an object item that weights-only loading cannot restore (its key named).
        OSError: the writer failed.
    """
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    results = []
    stream = _CoalescedWriter(writer)
    for item in items:
        offset = stream.tell()
        data = planner.resolve_data(item)
        target, descriptors = _transformed(stream, extensions) if extensions else (stream, [])
        if item.type == WriteItemType.BYTE_IO:
            buffer = data.getbuffer()
            check_weights_only(buffer, what=f"key {item.index.fqn!r}")
            target.write(buffer)
        else:
            torch_save(_cpu_tensor(data), target)
        if extensions:
            target.close()  # ends each transform's output (a zstd frame), not the payload
        length = stream.tell() - offset
        info = StorageInfo(relative_path=name, offset=offset, length=length,
                           transform_descriptors=descriptors or None)
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    stream.flush()
    return results


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """``tensor`` narrowed to ``lengths`` elements from ``offsets`` in each dimension."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def read_items(reader: BinaryIO, requests: list, storage_data: dict, planner: Any, *, where: str,
               registry: Any = None) -> None:
    """Read DCP load requests from one verified file and hand each to the planner.

    Args:
        reader (BinaryIO): seekable, already checked against the manifest (size and CRC32C).
        requests (list[ReadItem]): this rank's requests from this file.
        storage_data (dict): the metadata's ``MetadataIndex -> StorageInfo``.
        planner (LoadPlanner): DCP's planner of this load.
        where (str): the file's URL and owner, for errors.
        registry (ExtensionRegistry | None): rebuilds the stream transforms an item names (DCP's
            default registry when ``None``).

    Raises:
        UnsafeCheckpointError: an object item that weights-only loading refuses (never handed on).
        StreamTransformError: an item's transform the registry cannot rebuild.
        ValueError: an item outside the file, or a tensor of another shape than the request.
    """
    from torch.distributed.checkpoint._extension import ExtensionRegistry
    from torch.distributed.checkpoint.planner import LoadItemType

    registry = ExtensionRegistry() if registry is None else registry
    for request in sorted(requests, key=lambda r: storage_data[r.storage_index].offset):
        info = storage_data[request.storage_index]
        reader.seek(info.offset)
        data = reader.read(info.length)
        if len(data) != info.length:
            raise ValueError(f"{where}: item {request.storage_index.fqn!r} ends past the end of the file "
                             f"(offset {info.offset}, length {info.length})")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:
            data = _untransformed(data, resolve_transforms(descriptors, registry, where=where))
        if request.type == LoadItemType.BYTE_IO:
            check_weights_only(data, what=f"{where}: key {request.storage_index.fqn!r}")
            planner.load_bytes(request, io.BytesIO(data))
            continue
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        tensor = _narrow(tensor, request.storage_offsets, request.lengths)
        target = planner.resolve_tensor(request).detach()
        if target.size() != tensor.size():
            raise ValueError(f"{where}: item {request.storage_index.fqn!r} has shape {tuple(tensor.size())}, "
                             f"the request wants {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(request, target)


__all__ = ["StorageInfo", "check_weights_only", "read_items", "resolve_transforms", "write_items"]
