"""A pytest plugin that routes the checkpoint I/O of Lightning's unmodified tests through opd_store.

Loaded with ``-p bench.upstream_lightning.plugin`` (``python -m bench.upstream_lightning``). Every
directory a test saves checkpoints in becomes the root of a :class:`StoreCheckpointIO` (a local
store: each checkpoint *name* is a directory of committed versions, not a file), and every
``ModelCheckpoint`` answers with :class:`StoreModelCheckpoint`'s rules. Substitutions, made once at
``pytest_load_initial_conftests`` (nothing in the test files changes):

- Lightning's default ``CheckpointIO`` (``Strategy.checkpoint_io`` builds a ``TorchCheckpointIO``)
  is :class:`RoutedCheckpointIO`: saves, loads and removals go to the plugin of the path's
  directory (a plugin made on the first save there); a test's own ``CheckpointIO`` is left alone.
- ``lightning.pytorch.callbacks.ModelCheckpoint`` (and the default one the Trainer adds) is
  :class:`StoreBackedModelCheckpoint`: once set up, its ``file_exists``, ``"last"`` lookup, top-k
  removal rule and removals are :class:`StoreModelCheckpoint`'s, on the plugin of its ``dirpath``.
- Reading a checkpoint the way the tests and ``LightningModule.load_from_checkpoint`` do
  (``torch.load(path)``, Lightning's ``cloud_io._load``, imported as ``pl_load``) goes through :meth:`StoreCheckpointIO.open` when
  the path is a name in a store (the verified newest version); the documented user call is
  ``Model.load_from_checkpoint(io.open(path))``. ``os.path.isfile(path)`` of such a name is true
  when its newest version is intact (what a checkpoint file's existence means in a store).
"""

from __future__ import annotations

import inspect
import os
import threading
from pathlib import Path
from typing import Any

PLUGINS: dict[str, Any] = {}
"""The StoreCheckpointIO of every directory checkpoints were saved in, by absolute path."""
_LOCK = threading.Lock()


def plugin_for(directory: str | os.PathLike, *, create: bool):
    """The StoreCheckpointIO rooted at ``directory`` (made when ``create``), or ``None``."""
    from opd_store.integrations.lightning import StoreCheckpointIO

    key = os.path.abspath(os.fspath(directory))
    with _LOCK:
        plugin = PLUGINS.get(key)
        if plugin is None and create:
            plugin = PLUGINS[key] = StoreCheckpointIO(key)
        return plugin


def is_store_name(path: Any) -> bool:
    """Whether ``path`` is a checkpoint name in a store (a directory holding ``step-*`` versions)."""
    if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):
        return False
    directory = Path(os.fspath(path))
    return directory.is_dir() and any(child.name.startswith("step-") for child in directory.iterdir())


def open_name(path: str | os.PathLike):
    """The verified reader of the newest version of the name at ``path``."""
    return plugin_for(Path(os.fspath(path)).parent, create=True).open(path)


def _routed_checkpoint_io():
    from lightning.fabric.plugins import CheckpointIO

    class RoutedCheckpointIO(CheckpointIO):
        """Lightning's default CheckpointIO, replaced: each checkpoint's directory is a store root."""

        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            if storage_options is not None:  # TorchCheckpointIO's own refusal, kept
                raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not "
                                f"supported for `{type(self).__name__}`.")
            plugin_for(Path(os.fspath(path)).parent, create=True).save_checkpoint(checkpoint, path)

        def load_checkpoint(self, path, map_location=None, weights_only=None):
            for plugin in list(PLUGINS.values()):
                if plugin.is_placeholder(path):
                    return plugin.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            plugin = plugin_for(Path(os.fspath(path)).parent, create=True)
            return plugin.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

        def remove_checkpoint(self, path) -> None:
            plugin = plugin_for(Path(os.fspath(path)).parent, create=False)
            if plugin is not None:
                plugin.remove_checkpoint(path)

        def teardown(self) -> None:
            for plugin in list(PLUGINS.values()):
                plugin.teardown()

    return RoutedCheckpointIO


def _store_backed_model_checkpoint(routed: type):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from opd_store.integrations.lightning import StoreModelCheckpoint

    class StoreBackedModelCheckpoint(StoreModelCheckpoint):
        """``ModelCheckpoint`` as the tests construct it (any ``dirpath``, resolved at setup as
        Lightning resolves it), with :class:`StoreModelCheckpoint`'s rules once the Trainer's
        CheckpointIO is the routed one; plain ``ModelCheckpoint`` otherwise."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            ModelCheckpoint.__init__(self, *args, **kwargs)  # no plugin: bound at setup
            self.routed = False
            # StoreModelCheckpoint's run-journal state, as its __init__ sets it
            self.journal_progress_secs = float(
                inspect.signature(StoreModelCheckpoint.__init__).parameters["journal_progress_secs"].default)
            self.journal = None
            self._awaiting = {}
            self._save_count = 0
            self._save_reason = "periodic"
            self._training_thread = None

        @property
        def checkpoint_io(self):
            """The plugin of ``dirpath`` once set up with the routed CheckpointIO and once the
            directory exists (made by the first save, as Lightning makes it), else ``None``."""
            if not self.routed or not os.path.isdir(self.dirpath):
                return None
            return plugin_for(self.dirpath, create=True)

        def setup(self, trainer, pl_module, stage: str) -> None:
            ModelCheckpoint.setup(self, trainer, pl_module, stage)
            io = trainer.strategy.checkpoint_io
            self.routed = isinstance(io.checkpoint_io if isinstance(io, AsyncCheckpointIO) else io, routed)

        def file_exists(self, filepath, trainer) -> bool:
            if self.checkpoint_io is None:
                return ModelCheckpoint.file_exists(self, filepath, trainer)
            return StoreModelCheckpoint.file_exists(self, filepath, trainer)

        def _find_last_checkpoints(self, trainer) -> set[str]:
            if self.checkpoint_io is None:
                return ModelCheckpoint._find_last_checkpoints(self, trainer)
            return StoreModelCheckpoint._find_last_checkpoints(self, trainer)

        def _should_remove_checkpoint(self, trainer, previous: str, current: str) -> bool:
            if self.checkpoint_io is None:
                return ModelCheckpoint._should_remove_checkpoint(self, trainer, previous, current)
            return StoreModelCheckpoint._should_remove_checkpoint(self, trainer, previous, current)

        def _remove_checkpoint(self, trainer, filepath: str) -> None:
            if self.checkpoint_io is None:
                ModelCheckpoint._remove_checkpoint(self, trainer, filepath)
            else:
                StoreModelCheckpoint._remove_checkpoint(self, trainer, filepath)

    def dispatched(name: str):
        """``name`` as ModelCheckpoint has it before the routed plugin is bound, as
        StoreModelCheckpoint has it after."""
        def method(self, *args: Any, **kwargs: Any):
            owner = ModelCheckpoint if self.checkpoint_io is None else StoreModelCheckpoint
            return getattr(owner, name)(self, *args, **kwargs)
        method.__name__ = name
        return method

    for hook in ("on_train_start", "on_train_batch_start", "on_train_batch_end", "_save_checkpoint",
                 "on_exception", "on_fit_end"):  # the run journal's hooks (docs/integrations.md)
        setattr(StoreBackedModelCheckpoint, hook, dispatched(hook))

    StoreBackedModelCheckpoint.__name__ = StoreBackedModelCheckpoint.__qualname__ = "ModelCheckpoint"
    StoreBackedModelCheckpoint.__init__.__signature__ = inspect.signature(ModelCheckpoint.__init__)  # for the CLI
    StoreBackedModelCheckpoint.__module__ = __name__
    globals()["ModelCheckpoint"] = StoreBackedModelCheckpoint  # where pickle looks it up
    return StoreBackedModelCheckpoint


def install() -> None:
    """Make the substitutions of the module docstring (idempotent)."""
    import lightning.fabric.utilities.cloud_io as cloud_io
    import lightning.pytorch.callbacks as callbacks
    import lightning.pytorch.core.saving as saving
    import lightning.pytorch.strategies.strategy as strategy
    import lightning.pytorch.trainer.connectors.callback_connector as callback_connector
    import torch

    if getattr(strategy, "OPD_STORE_ROUTED", False):
        return
    routed = _routed_checkpoint_io()
    strategy.TorchCheckpointIO = routed
    strategy.OPD_STORE_ROUTED = True
    store_backed = _store_backed_model_checkpoint(routed)
    callbacks.ModelCheckpoint = store_backed
    callback_connector.ModelCheckpoint = store_backed

    torch_load, pl_load = torch.load, cloud_io._load

    def load(f, *args: Any, **kwargs: Any):
        if is_store_name(f):
            with open_name(f) as reader:
                return torch_load(reader, *args, **kwargs)
        return torch_load(f, *args, **kwargs)

    def lightning_load(path_or_url, *args: Any, **kwargs: Any):
        if is_store_name(path_or_url):
            with open_name(path_or_url) as reader:
                return pl_load(reader, *args, **kwargs)
        return pl_load(path_or_url, *args, **kwargs)

    is_file = os.path.isfile

    def isfile(path) -> bool:
        return is_file(path) or (is_store_name(path) and open_name(path).close() is None)

    torch.load = load
    os.path.isfile = isfile
    cloud_io._load = saving.pl_load = lightning_load


def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """Before Lightning's ``conftest.py`` and test modules import ``ModelCheckpoint``."""
    install()
