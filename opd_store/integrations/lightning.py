"""Lightning checkpoints in an opd_store store: a ``CheckpointIO`` plugin and a ``ModelCheckpoint``.

Three additions to a Lightning script (docs/integrations.md)::

    io = StoreCheckpointIO("s3://bucket/run/checkpoints", storage_options={...})
    trainer = L.Trainer(plugins=[io],                      # or AsyncCheckpointIO(io)
                        callbacks=[StoreModelCheckpoint(io, monitor="val_loss", save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="last")

Layout: Lightning names checkpoint *files* (``epoch=1-step=20.ckpt``, ``last.ckpt``) under a
directory and overwrites some of them (``last.ckpt``) in place. Here every such name is a store of
its own, ``<url>/<name>/``, whose steps are the ``global_step`` of each save: a save commits
``<url>/<name>/step-N/`` (payload ``checkpoint.ckpt``, created with ``torch.save`` straight into the
object, manifest created only if absent) and only then deletes the name's older steps, so a name
that was ever saved always has a complete version, also across a kill mid-save. ``load`` reads the
newest complete step of the name (size and CRC32C checked); ``remove`` deletes every step of it,
manifest first.

Paths: Lightning hands back remote paths without their protocol (``ModelCheckpoint`` lists its
directory and ``os.path.normpath``s the entries, Lightning #18261), and resolves ``ckpt_path="last"``
with its own default filesystem, which knows neither the store's ``storage_options`` nor its
completeness rule. The plugin accepts a path under its root with or without the protocol;
:class:`StoreModelCheckpoint` answers ``file_exists`` and ``"last"`` from the store: the newest
complete ``last*.ckpt`` is fetched (verified) into a local directory whose path is what Lightning
resolves and then loads through the plugin.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import fsspec
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from ..errors import CheckpointNotFoundError
from ..store import COMPLETE, CheckpointStore
from ..thread_random import route_background_random

logger = logging.getLogger("opd_store.integrations.lightning")

PAYLOAD_NAME = "checkpoint.ckpt"
FRAMEWORK = "lightning"


class StoreCheckpointIO(CheckpointIO):
    """Save, load and remove Lightning checkpoints in a store (see module docs).

    Args:
        url (str | os.PathLike): the root under which checkpoint names live (``s3://bucket/run/ckpts``,
            ``gs://...``, a local directory). Give ``ModelCheckpoint`` the same ``dirpath``.
        storage_options (dict | None): fsspec options for every request.
        local_cache_dir (str | os.PathLike | None): where ``"last"`` is fetched for Lightning to
            resolve (default: a new temporary directory, removed at ``teardown``).

    Raises:
        StoreUnreachableError: the store cannot be used (raised here, before training).

    Thread safety: Lightning's ``AsyncCheckpointIO`` calls :meth:`save_checkpoint` on its own
    thread and :meth:`remove_checkpoint` on the training thread; a removal waits for a save of the
    same name that is running.
    """

    def __init__(self, url: str | os.PathLike, *, storage_options: dict[str, Any] | None = None,
                 local_cache_dir: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.root = CheckpointStore(url, storage_options=storage_options)
        self.root.check_reachable()
        self.url = self.root.url
        self.storage_options = dict(storage_options or {})
        self._bare_root = re.sub(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", "", self.url).rstrip("/")
        self._local_cache_dir = local_cache_dir
        self._cache: Path | None = None
        self._saving: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    # -- names -----------------------------------------------------------------------------------
    def name_of(self, path: str | os.PathLike) -> str:
        """The checkpoint name (relative to the root) of a path Lightning passes.

        Accepted: ``<url>/<name>``, the same without its protocol (as Lightning's normalisation
        returns it), with or without a leading ``/``.

        Raises:
            ValueError: the path is not under the root.
        """
        text = os.fspath(path)
        for root in (self.url.rstrip("/"), self._bare_root, "/" + self._bare_root.lstrip("/")):
            if text.startswith(root + "/") and len(text) > len(root) + 1:
                return os.path.normpath(text[len(root) + 1:]).replace(os.sep, "/")
        raise ValueError(f"checkpoint path {text!r} is not under the store root {self.url}")

    def store_of(self, path: str | os.PathLike) -> CheckpointStore:
        """The store holding the versions of the checkpoint at ``path``."""
        return CheckpointStore(f"{self.url.rstrip('/')}/{self.name_of(path)}", storage_options=self.storage_options)

    def path_of(self, name: str) -> str:
        """The URL Lightning uses for checkpoint ``name``."""
        return f"{self.url.rstrip('/')}/{name}"

    def names(self) -> list[str]:
        """Checkpoint names under the root that hold a complete checkpoint (a fresh listing)."""
        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        fs.invalidate_cache()
        try:
            children = fs.ls(root, detail=True)
        except FileNotFoundError:
            return []
        names = sorted(entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in children if entry["type"] == "directory")
        return [name for name in names if self.exists(self.path_of(name))]

    def exists(self, path: str | os.PathLike) -> bool:
        """Whether a complete checkpoint is saved under ``path``'s name."""
        store = self.store_of(path)
        return any(info.status == COMPLETE for info in store.checkpoints())

    # -- CheckpointIO ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        """Commit ``checkpoint`` as step ``checkpoint["global_step"]`` of the name at ``path``, then
        delete the name's older steps.

        Raises:
            CommitConflictError: this name already holds a committed checkpoint of this step (a
                committed checkpoint is never overwritten).
            OSError: a backend failure; the name's previous version is untouched.
        """
        name = self.name_of(path)
        store = self.store_of(path)
        step = int(checkpoint.get("global_step", 0))
        with self._name_lock(name), route_background_random():
            metadata = {"framework": FRAMEWORK, "name": name, "epoch": checkpoint.get("epoch"), "global_step": step}
            with store.begin(step, metadata=metadata) as txn:
                with txn.open(PAYLOAD_NAME) as writer:
                    torch.save(checkpoint, writer)
            for info in store.checkpoints():
                if info.step < step:
                    store.delete(info.step)
        logger.info("saved %s as step %d (%s)", name, step, txn.url)

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The newest complete version of the checkpoint at ``path`` (size and CRC32C checked), or
        a local file this plugin fetched for ``ckpt_path="last"``.

        Raises:
            CheckpointNotFoundError: no complete version under that name (``FileNotFoundError``).
            IntegrityError: the bytes differ from the manifest.
        """
        local = Path(os.fspath(path))
        if self._cache is not None and local.is_file() and self._cache in local.parents:
            with open(local, "rb") as handle:
                return torch.load(handle, map_location=map_location, weights_only=weights_only)
        store = self.store_of(path)
        step = store.latest_step()
        with store.open(step, PAYLOAD_NAME) as reader:
            return torch.load(reader, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        """Delete every version of the checkpoint at ``path``, each manifest first."""
        name = self.name_of(path)
        store = self.store_of(path)
        with self._name_lock(name):
            for info in store.checkpoints():
                store.delete(info.step)
        logger.info("removed %s", name)

    def teardown(self) -> None:
        if self._cache is not None and self._local_cache_dir is None:
            shutil.rmtree(self._cache, ignore_errors=True)
            self._cache = None

    # -- "last" ------------------------------------------------------------------------------
    def fetch_local(self, name: str) -> str:
        """Fetch the newest complete version of ``name`` into the local cache; return the file path.

        Raises:
            CheckpointNotFoundError: no complete version.
        """
        store = self.store_of(self.path_of(name))
        step = store.latest_step()
        if self._cache is None:
            base = self._local_cache_dir or tempfile.mkdtemp(prefix="opd-store-lightning-")
            self._cache = Path(base).resolve()
            self._cache.mkdir(parents=True, exist_ok=True)
        target = self._cache / f"step-{step}" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with store.open(step, PAYLOAD_NAME) as reader, open(target, "wb") as out:
            shutil.copyfileobj(reader, out, 8 << 20)
        return str(target)

    def _name_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._saving.setdefault(name, threading.Lock())


class StoreModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose existence checks and ``ckpt_path="last"`` ask the store.

    Args:
        checkpoint_io (StoreCheckpointIO): the plugin given to the ``Trainer`` (alone or wrapped in
            ``AsyncCheckpointIO``); its root is the ``dirpath``.
        **kwargs: ``ModelCheckpoint``'s arguments (``monitor``, ``save_top_k``, ``save_last``,
            ``filename``, ``every_n_train_steps``...). ``save_last="link"`` is refused (links are
            local-only).

    Raises:
        ValueError: ``dirpath`` differs from the plugin's root, or ``save_last="link"``.
    """

    def __init__(self, checkpoint_io: StoreCheckpointIO, **kwargs: Any) -> None:
        dirpath = kwargs.pop("dirpath", None) or checkpoint_io.url
        if os.fspath(dirpath).rstrip("/") != checkpoint_io.url.rstrip("/"):
            raise ValueError(f"dirpath {dirpath!r} differs from the store root {checkpoint_io.url!r}")
        if kwargs.get("save_last") == "link":
            raise ValueError("save_last='link' makes a local symbolic link; use save_last=True with a store")
        super().__init__(dirpath=dirpath, **kwargs)
        self.checkpoint_io = checkpoint_io

    def setup(self, trainer, pl_module, stage: str) -> None:
        # ModelCheckpoint.setup lists dirpath with Lightning's default filesystem (no storage
        # options) only to warn about a non-empty directory; the store is asked instead.
        self.dirpath = trainer.strategy.broadcast(self.dirpath)
        self._fs = fsspec.core.url_to_fs(self.checkpoint_io.url, **self.checkpoint_io.storage_options)[0]
        if trainer.is_global_zero and stage == "fit" and self.save_top_k != 0:
            names = self.checkpoint_io.names()
            if names:
                logger.info("%s holds checkpoints %s", self.checkpoint_io.url, names)

    def file_exists(self, filepath, trainer) -> bool:
        exists = self.checkpoint_io.exists(filepath) if trainer.is_global_zero else False
        return trainer.strategy.reduce_boolean_decision(exists, all=False)

    def _find_last_checkpoints(self, trainer) -> set[str]:
        """The newest complete ``last*.ckpt``, fetched locally (see module docs): Lightning then
        checks it with its default filesystem, which reaches only local paths with certainty. Every
        rank fetches its own copy (each loads the checkpoint)."""
        pattern = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-v?\d+)?{re.escape(self.FILE_EXTENSION)}$")
        candidates = [name for name in self.checkpoint_io.names() if pattern.match(name)]
        if not candidates:
            return set()

        def newest(name: str) -> int:
            return self.checkpoint_io.store_of(self.checkpoint_io.path_of(name)).latest_step()

        best = max(candidates, key=newest)
        try:
            return {self.checkpoint_io.fetch_local(best)}
        except CheckpointNotFoundError:
            return set()


__all__ = ["PAYLOAD_NAME", "StoreCheckpointIO", "StoreModelCheckpoint"]
