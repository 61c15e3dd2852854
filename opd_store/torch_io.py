"""``torch.save`` into a payload writer without torch's own zip CRC-32 (our CRC32C covers it).

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
            :class:`~opd_store.transaction.PayloadWriter`.

    Raises:
        Whatever ``torch.save`` or the writer raises (pickling errors, backend ``OSError``).
    """
    import torch

    with no_zip_crc32():
        torch.save(obj, writer)


__all__ = ["no_zip_crc32", "torch_save", "zip_crc32_switchable"]


def torch_load(reader: BinaryIO, *, mmap: bool = False, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` of a payload reader that the store has verified.

    ``reader`` comes from :meth:`~opd_store.store.CheckpointStore.open`, which checked the
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
    in memory (one GET), so ``mmap`` changes nothing for them.

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
        return torch.load(reader, map_location=map_location, weights_only=True)
    return torch.load(path, map_location=map_location, weights_only=True, mmap=True)


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
