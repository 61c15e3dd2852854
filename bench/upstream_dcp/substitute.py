"""The substitution: DCP's ``FileSystemWriter``/``FileSystemReader`` become opd_store's.

:func:`install` replaces the two names in every module of ``torch.distributed.checkpoint`` that
holds them (the package, ``filesystem`` and ``_storage_utils``, whose ``_storage_setup`` picks a
writer or reader for a bare ``checkpoint_id``), so a PyTorch test file imported afterwards saves and
loads through :class:`~opd_store.dcp.StoreWriter` and :class:`~opd_store.dcp.StoreReader` without
a line of it changed. A checkpoint directory ``PATH`` of a test becomes a store (the mode decides
where) and every save into it a new step (a committed step is never rewritten); a reader of
``PATH`` reads the newest committed step.

Modes (``OPD_UPSTREAM_DCP`` in the environment, set by ``python -m bench.upstream_dcp``):

* ``local``: the store is ``PATH`` itself (``PATH/step-000001/attempt-.../...``);
* ``memory``: the store is ``memory://upstream-dcp/<hash of PATH>`` (one per process: the
  multi-process tests cannot pass there);
* ``dcp-reader``: saved as ``local``; read by DCP's own ``FileSystemReader`` pointed at the
  committed attempt directory (``docs/sharded.md``: that directory is a DCP checkpoint).

``OPD_UPSTREAM_DCP_CPU_GATED=1`` also runs on CPU (gloo) the cases PyTorch gates on GPUs with
``skip_if_lt_x_gpu`` (its ``allow_cpu`` switch, applied to every case): which cases run changes,
never what they assert.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

MODES = ("local", "memory", "dcp-reader")
_INSTALLED = False


def _mode() -> str:
    mode = os.environ.get("OPD_UPSTREAM_DCP", "local")
    if mode not in MODES:
        raise ValueError(f"OPD_UPSTREAM_DCP={mode!r}: expected one of {MODES}")
    return mode


def store_of(path: str | os.PathLike) -> Any:
    """The store a test's checkpoint directory ``path`` stands for (see the module docstring)."""
    from opd_store import CheckpointStore

    text = os.path.abspath(os.fspath(path))
    if _mode() == "memory":
        return CheckpointStore(f"memory://upstream-dcp/{hashlib.sha1(text.encode()).hexdigest()[:12]}")
    return CheckpointStore(text)


def _newest_step(store) -> int | None:
    steps = store.steps()
    return steps[-1] if steps else None


def _newest(path) -> tuple[Any, int]:
    """``store_of(path)`` and its newest committed step.

    Raises:
        CheckpointNotFoundError: nothing committed there (the test reads a path it never saved).
    """
    from opd_store.errors import CheckpointNotFoundError

    store = store_of(path)
    step = _newest_step(store)
    if step is None:
        raise CheckpointNotFoundError(f"{store.url}: no committed step to read (the test's path {path})")
    return store, step


def build_classes():
    """The two replacement classes (built after torch and opd_store import)."""
    from opd_store.dcp import StoreReader, StoreWriter

    class FileSystemWriter(StoreWriter):
        """``FileSystemWriter(path, ...)`` as a :class:`StoreWriter` of the next step of
        ``store_of(path)``; ``_extensions`` become ``extensions``, ``overwrite=False`` refuses a
        path whose store holds a step (as DCP refuses an existing ``.metadata``); the other
        options (threads, file layout, fsync, staging cache) have no meaning for a store."""

        def __init__(self, path, single_file_per_rank=True, sync_files=True, thread_count=1,
                     per_thread_copy_ahead=10_000_000, cache_staged_state_dict=False, overwrite=True,
                     _extensions=None, serialization_format=None, *args, **kwargs) -> None:
            self.path = os.fspath(path)
            self.overwrite = overwrite
            store = store_of(self.path)
            super().__init__(store, (_newest_step(store) or 0) + 1, extensions=_extensions)

        def reset(self, checkpoint_id=None) -> None:
            if checkpoint_id:
                self.path = os.fspath(checkpoint_id)
                self.store = store_of(self.path)
            self.step = (_newest_step(self.store) or 0) + 1  # every save a new step
            super().reset(None)

        def prepare_local_plan(self, plan):
            if not self.overwrite and _newest_step(self.store) is not None:
                raise RuntimeError(f"Checkpoint already exists and self.overwrite={self.overwrite}.")
            return super().prepare_local_plan(plan)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            from torch.distributed.checkpoint.filesystem import FileSystem

            return FileSystem.validate_checkpoint_id(checkpoint_id)

    def attempt_directory(path) -> str:
        store, step = _newest(path)
        return f"{store.step_url(step)}/{store.manifest(step).attempt_id}"

    class CommittedAttemptReader(_ORIGINAL["reader"]):
        """``dcp-reader`` mode: DCP's own ``FileSystemReader`` of the committed attempt directory of
        the newest step of ``store_of(path)`` (``reset(path)`` too)."""

        def __init__(self, path, _extension_registry=None, *args, **kwargs) -> None:
            super().__init__(attempt_directory(path), _extension_registry=_extension_registry)

        def reset(self, checkpoint_id=None) -> None:
            super().reset(attempt_directory(checkpoint_id) if checkpoint_id else None)

    class FileSystemReader(StoreReader):
        """``FileSystemReader(path, _extension_registry=...)``: a :class:`StoreReader` of the
        newest committed step of ``store_of(path)``; ``reset(path)`` re-targets it."""

        def __init__(self, path, _extension_registry=None, *args, **kwargs) -> None:
            self.path = os.fspath(path)
            store, step = _newest(self.path)
            super().__init__(store, step, extension_registry=_extension_registry)

        def reset(self, checkpoint_id=None) -> None:
            if checkpoint_id:
                self.path = os.fspath(checkpoint_id)
                self.store, self.step = _newest(self.path)
            super().reset(None)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            from torch.distributed.checkpoint.filesystem import FileSystem

            return FileSystem.validate_checkpoint_id(checkpoint_id)

    return FileSystemWriter, (CommittedAttemptReader if _mode() == "dcp-reader" else FileSystemReader)


_ORIGINAL: dict[str, Any] = {}


def install() -> None:
    """Replace DCP's file-system writer and reader everywhere DCP holds them (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint._storage_utils as storage_utils
    import torch.distributed.checkpoint.filesystem as filesystem

    _ORIGINAL["reader"] = filesystem.FileSystemReader
    _ORIGINAL["writer"] = filesystem.FileSystemWriter
    writer_cls, reader_cls = build_classes()
    for module in (dcp, filesystem, storage_utils):
        module.FileSystemWriter = writer_cls
        module.FileSystemReader = reader_cls
    if os.environ.get("OPD_UPSTREAM_DCP_CPU_GATED") == "1":
        _run_gpu_gated_cases_on_cpu()
    _newer_test_helpers()
    _INSTALLED = True


def _newer_test_helpers() -> None:
    """Helpers newer test files import from ``torch.testing._internal`` that this torch's copy
    lacks (PyTorch's main branch ahead of the installed wheel): ``common_dtensor._get_device_type``
    (the e2e file's device for a world size: an accelerator with that many devices, else CPU)."""
    try:
        import torch.testing._internal.distributed._tensor.common_dtensor as common_dtensor
    except ImportError:
        return
    if not hasattr(common_dtensor, "_get_device_type"):
        def _get_device_type(world_size: int) -> str:
            import torch

            accelerator = torch.accelerator.current_accelerator()
            if accelerator is not None and torch.accelerator.device_count() >= world_size:
                return accelerator.type
            return "cpu"

        common_dtensor._get_device_type = _get_device_type


def _run_gpu_gated_cases_on_cpu() -> None:
    """``skip_if_lt_x_gpu(x)`` as ``skip_if_lt_x_gpu(x, allow_cpu=True)`` for test modules imported
    from now on (they import the name from ``common_distributed`` directly or through
    ``common_dtensor``)."""
    import torch.testing._internal.common_distributed as common_distributed

    original = common_distributed.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x, *, allow_cpu=True):
        return original(x, allow_cpu=allow_cpu)

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    try:
        import torch.testing._internal.distributed._tensor.common_dtensor as common_dtensor
    except ImportError:
        return
    common_dtensor.skip_if_lt_x_gpu = skip_if_lt_x_gpu


__all__ = ["MODES", "install", "store_of"]
