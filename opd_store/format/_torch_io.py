"""``torch.save`` into a payload writer without torch's own zip CRC-32 (our CRC32C covers it),
and ``torch.load`` of a verified payload without copying it (:func:`torch_load`,
:func:`weights_only_load`).

``torch.save`` writes a zip archive and, by default, computes a CRC-32 of every record with a
software routine that runs at about 0.4 GiB/s on the benchmark machine: 2.5 s of CPU per GiB, a
third or more of a local 1 GiB save (docs/performance.md, ``bench/results/``). A store payload already gets a
CRC32C computed while it streams (hardware, ~3.5 GiB/s) and checked on every read through the
store, so the zip CRC-32 adds no protection there. ``torch.load`` does not check the zip CRC-32
(PyTorch documents that archives written without it still load); generic zip tools (``unzip -t``,
``zipfile.testzip``) do, and report such archives as damaged.

The switch is ``torch.utils.serialization.config.save.compute_crc32``. In torch >= 2.13 a
``config.patch`` override is thread-local (a ``ContextVar``), so turning it off here never changes a
``torch.save`` running in another thread. Older torch versions kept config overrides process-wide:
there :func:`torch_save` leaves the CRC-32 on rather than change other threads' saves.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, BinaryIO, Iterator

_THREAD_LOCAL_CONFIG_TORCH = (2, 13)


def _torch_version() -> tuple[int, int]:
    import torch

    parts = torch.__version__.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def zip_crc32_switchable() -> bool:
    """True when torch's zip CRC-32 can be turned off for the calling thread alone (torch >= 2.13)."""
    if _torch_version() < _THREAD_LOCAL_CONFIG_TORCH:
        return False
    try:
        from torch.utils.serialization import config
    except ImportError:
        return False
    return hasattr(config, "patch") and hasattr(config.save, "compute_crc32")


@contextlib.contextmanager
def no_zip_crc32() -> Iterator[None]:
    """Within the block, ``torch.save`` in this thread writes zip records without CRC-32.

    A no-op where the switch would not be thread-local (see :func:`zip_crc32_switchable`).
    """
    if not zip_crc32_switchable():
        yield
        return
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):
        yield


def torch_save(obj: Any, writer: BinaryIO) -> None:
    """``torch.save(obj, writer)`` without torch's zip CRC-32, for store payload writers.

    Use it only for writers whose bytes opd_store checksums (``txn.open(name)``): the payload's
    CRC32C in the manifest then protects the archive, and every read through the store checks it.

    Args:
        obj (Any): anything ``torch.save`` accepts (state dicts of tensors of any dtype/shape).
        writer (BinaryIO): a writable binary file, normally a
            :class:`~opd_store.commit._transaction.PayloadWriter`.

    Raises:
        Whatever ``torch.save`` or the writer raises (pickling errors, backend ``OSError``).
    """
    import torch

    with no_zip_crc32():
        torch.save(obj, writer)


def torch_load(reader: BinaryIO, *, mmap: bool = False, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` of a payload reader that the store has verified.

    ``reader`` comes from :meth:`~opd_store.store._checkpoint_store.CheckpointStore.open`, which checked the
    payload's size and CRC32C against the manifest before returning it.

    With ``mmap=True`` and a local payload (a real file), the verified file is memory-mapped
    (``torch.load(mmap=True)``) instead of copied: tensor storages share the page cache that the
    checksum pass just filled, so a load costs about the checksum (bench: 1 GiB in ~0.5 s against
    ~3.5 s for a copying load). The mapping is private (``MAP_PRIVATE``): writing to a loaded
    tensor copies that page and never reaches the file. It stays valid after ``delete``/``gc``
    unlink the file; opd_store never rewrites a payload in place (each attempt has its own prefix),
    but a file truncated by another program under a live mapping raises ``SIGBUS`` on access, so
    keep ``mmap=False`` for stores other programs write into. On Linux the map is taken through
    ``/proc/self/fd/N``, i.e. of the very inode that was checksummed. Remote payloads are already
    in memory (downloaded into one buffer) and are loaded in place whatever ``mmap`` says (see
    :func:`weights_only_load`).

    Args:
        reader (BinaryIO): a reader returned by ``CheckpointStore.open``; closed by the caller.
        mmap (bool): map a local payload instead of copying it.
        map_location (Any): as ``torch.load`` (default ``"cpu"``).

    Returns:
        Any: the loaded object (tensors of the dtypes/shapes that were saved).

    Raises:
        pickle.UnpicklingError: the payload needs globals outside torch's weights-only allow-list.
        RuntimeError: not a ``torch.save`` archive.
    """
    import torch

    path = _local_file_path(reader) if mmap else None
    if path is None:
        return weights_only_load(reader, map_location=map_location)
    return torch.load(path, map_location=map_location, weights_only=True, mmap=True)


def weights_only_load(reader: BinaryIO, *, map_location: Any = "cpu") -> Any:
    """``torch.load(reader, weights_only=True)``; a downloaded payload is loaded in place.

    A remote payload is downloaded into one ``bytearray`` (parallel ranged reads) that the reader
    lends out (``reader.lendable_buffer()``, :class:`opd_store.storage.transfers._parts.MemoryReader`). Then
    every tensor's storage is a view of that buffer, as ``torch.load(mmap=True)`` makes storages
    views of one mapped file (the same ``overall_storage`` path of ``torch.serialization._load``),
    instead of a copy: no second copy of the state in memory, and no copy time (1 GiB: 0.43 s ->
    under 0.01 s on the benchmark machine; docs/performance.md). The tensors are ordinary
    process memory (a forked child gets them copy-on-write, like any tensor); the buffer is freed
    when the last of them is, so a tensor kept from a load keeps the whole payload's memory. Any
    other reader, and a torch whose private loader lacks ``overall_storage``, goes through
    ``torch.load`` as before.

    Args:
        reader (BinaryIO): a binary reader at the start of a ``torch.save`` archive.
        map_location (Any): as ``torch.load`` (default ``"cpu"``; another device copies there).

    Returns:
        Any: the loaded object.

    Raises:
        pickle.UnpicklingError: the payload needs globals outside torch's weights-only allow-list.
        RuntimeError: not a ``torch.save`` archive.
    """
    import torch

    lend = getattr(reader, "lendable_buffer", None)
    buffer = lend() if lend is not None and _in_place_supported() else None
    # Only a zip archive (torch's format since 1.6) has storages at record offsets; torch.load
    # itself reads the older formats (a legacy tar/pickle stream, a plain pickle).
    if not buffer or reader.tell() != 0 or buffer[:4] != _ZIP_LOCAL_HEADER:
        return torch.load(reader, map_location=map_location, weights_only=True)
    from torch import _weights_only_unpickler
    from torch.serialization import _load, _open_zipfile_reader

    try:
        with _open_zipfile_reader(reader) as archive:
            whole = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
            return _load(archive, map_location, _weights_only_unpickler, overall_storage=whole, encoding="utf-8")
    except pickle.UnpicklingError:
        reader.seek(0)  # the refusal again through torch.load, worded as torch words it
        return torch.load(reader, map_location=map_location, weights_only=True)


_ZIP_LOCAL_HEADER = b"PK\x03\x04"
"""The first bytes of a zip archive (its first local file header), as ``torch.save`` writes it."""
_IN_PLACE: list[bool] = []


def _in_place_supported() -> bool:
    """Whether this torch's private loader takes ``overall_storage`` (torch >= 2.1; checked once)."""
    if not _IN_PLACE:
        import inspect

        try:
            import torch.serialization as serialization
            from torch import _weights_only_unpickler  # noqa: F401

            found = ("overall_storage" in inspect.signature(serialization._load).parameters
                     and hasattr(serialization, "_open_zipfile_reader"))
        except (ImportError, AttributeError, TypeError, ValueError):
            found = False
        _IN_PLACE.append(found)
    return _IN_PLACE[0]


def _local_file_path(reader: BinaryIO) -> str | None:
    import io
    import os

    if isinstance(reader, io.BytesIO):
        return None
    try:
        fd = reader.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    proc_path = f"/proc/self/fd/{fd}"
    if os.path.exists(proc_path):
        return proc_path
    name = getattr(reader, "name", None)
    return name if isinstance(name, str) and os.path.isfile(name) else None


__all__ = ["no_zip_crc32", "torch_load", "torch_save", "weights_only_load", "zip_crc32_switchable"]
