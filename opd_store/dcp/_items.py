"""DCP items in opd_store payloads: written back to back into one payload, read back from one.

The byte format is DCP's own (``torch.distributed.checkpoint.filesystem``), so DCP's readers read
these files too. Added: objects must load weights-only, checked at write (the save fails naming the
key) and before DCP's planner sees them (its ``load_bytes`` uses ``weights_only=False``); tensors
are written without torch's zip CRC-32 (the manifest's CRC32C covers them). Stream transforms
(DCP's extensions, e.g. ``ZStandard``) apply per item as ``FileSystemWriter(_extensions=...)``
does; the CRC32C covers the bytes as stored.
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
    """Small writes gathered into writes of up to ``limit_bytes``; large ones passed on uncopied
    (``torch.save`` makes ~350 small writes per MiB, each a checksum call: ``bench/dcp.py``).
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
    """The payload stream as a transform's output: a transform closes its output at the item's end
    (a zstd frame), which must not end the payload (as DCP's ``NoCloseWriter``).
    """

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
    """The extensions named by an item's ``transform_descriptors`` (``["stream.zstd/1"]``), from DCP's
    ``registry``; ``where`` (URL, step, file) names the error.

    Raises:
        StreamTransformError: (a ``ValueError``) an unknown transform, or one whose package is missing.
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
        name (str): the file's name relative to the checkpoint.
        items (list[WriteItem]): ``planner.resolve_data(item)`` gives a tensor (any device) or a
            ``BytesIO`` (objects).
        planner (SavePlanner): DCP's planner of this save.
        extensions (Sequence[StreamTransformExtension]): stream transforms per item (none by default).

    Returns:
        list[WriteResult]: one per item, with ``StorageInfo(name, offset, length as stored,
        transform_descriptors)``.

    Raises:
        UnsafeCheckpointError: an object item weights-only loading cannot restore (key named).
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
        reader (BinaryIO): seekable, already checked against the manifest.
        requests (list[ReadItem]): this rank's requests from this file.
        storage_data (dict): the metadata's ``MetadataIndex -> StorageInfo``.
        planner (LoadPlanner): DCP's planner of this load.
        where (str): the file's URL and owner, for errors.
        registry (ExtensionRegistry | None): rebuilds items' transforms (``None``: DCP's default).

    Raises:
        UnsafeCheckpointError: an object item weights-only loading refuses (never handed on).
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
