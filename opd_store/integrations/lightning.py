"""Lightning checkpoints in an opd_store store: a ``CheckpointIO`` plugin and a ``ModelCheckpoint``.

Three additions to a Lightning script (docs/integrations.md)::

    io = StoreCheckpointIO("s3://bucket/run/checkpoints", storage_options={...})
    trainer = L.Trainer(plugins=[io],                      # or AsyncCheckpointIO(io)
                        callbacks=[StoreModelCheckpoint(io, monitor="val_loss", save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="last")

Layout: Lightning names checkpoint *files* (``epoch=1-step=20.ckpt``, ``last.ckpt``) under a
directory and overwrites a file when it saves the same name again (``last.ckpt`` at every save; any
name after a resume from an older checkpoint, at a ``global_step`` the name already holds or below
it). Here every such name is a store of its own, ``<url>/<name>/``, whose steps are *versions*
numbered in save order: a save commits version ``N + 1`` after the highest version ``N`` listed
(committed or not) as ``<url>/<name>/step-(N+1)/`` (payload ``checkpoint.ckpt``, created with
``torch.save`` straight into the object, manifest created only if absent, ``global_step`` and
``epoch`` in its metadata), through the save pipeline (:func:`opd_store.pipeline.run_save`),
and only then, as its after-commit hooks, deletes the name's older versions: the complete ones by
the retention policy :data:`NEWEST_VERSION_ONLY` (the one retention executor; a pinned version
stays), the uncommitted attempts of killed saves after them. So a name that was ever saved always
has a complete version, also across a kill mid-save, and the newest save is the one a load reads
(size and CRC32C checked), as with Lightning's overwritten file. ``remove`` deletes every version,
manifest first.

Order with ``AsyncCheckpointIO``: its thread runs the saves in order, but ``ModelCheckpoint``
removes an evicted top-k checkpoint on the training thread, possibly before that checkpoint's
queued save has run (which would then put it back for good). :class:`StoreModelCheckpoint` sends a
removal through the same queue as the saves (:data:`REMOVAL_REQUEST`), so it runs after them.

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

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from ..errors import CheckpointNotFoundError
from ..pipeline import AfterCommit, SaveRequest, run_save
from ..retention import RetentionPolicy
from ..runtime import route_background_random
from ..store import COMPLETE, UNCOMMITTED, BaseStore, CheckpointInfo, CheckpointStore, as_store
from ..tiered import TieredStore

logger = logging.getLogger("opd_store.integrations.lightning")

PAYLOAD_NAME = "checkpoint.ckpt"
FRAMEWORK = "lightning"
REMOVAL_REQUEST_KEY = "opd_store_removal_request"
REMOVAL_REQUEST: dict[str, bool] = {REMOVAL_REQUEST_KEY: True}
"""What :class:`StoreModelCheckpoint` hands to ``save_checkpoint`` (through ``AsyncCheckpointIO``'s
queue) to remove a checkpoint after the saves queued before it."""
NEWEST_VERSION_ONLY = RetentionPolicy(keep_last=1)
"""The retention of every name's store: a save replaces the name's older versions (as Lightning
overwrites its file), through the one retention executor after the commit (pinned versions stay)."""


class StoreCheckpointIO(CheckpointIO):
    """Save, load and remove Lightning checkpoints in a store (see module docs).

    Args:
        url (str | os.PathLike | BaseStore): the root under which checkpoint names live: a URL
            (``s3://bucket/run/ckpts``, ``gs://...``, a local directory) or a store. A plain store
            is reopened by URL under each name; a :class:`~opd_store.TieredStore` gives each name
            a tiered store of its own (:meth:`~opd_store.TieredStore.under`), whose uploads
            ``remove_checkpoint`` and ``teardown`` wait for (raising their failures).
            Give ``ModelCheckpoint`` the same ``dirpath`` (the root's URL).
        storage_options (dict | None): fsspec options for every request of a URL.
        local_cache_dir (str | os.PathLike | None): where ``"last"`` is fetched for Lightning to
            resolve (default: the temp dir); each fetch is a private directory in it, removed once
            Lightning has loaded it.

    Raises:
        StoreUnreachableError: the store cannot be used (raised here, before training).

    Thread safety: Lightning's ``AsyncCheckpointIO`` calls :meth:`save_checkpoint` on its own
    thread and :meth:`remove_checkpoint` on the training thread; a removal waits for a save of the
    same name that is running, and :class:`StoreModelCheckpoint` queues its removals behind the
    saves (module docs).

    Rank obligations: Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank
    0 only; ``load_checkpoint`` on every rank.
    """

    def __init__(self, url: str | os.PathLike | BaseStore, *, storage_options: dict[str, Any] | None = None,
                 local_cache_dir: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.root = as_store(url, storage_options)
        self.root.check_reachable()
        self.url = self.root.url
        self.storage_options = dict(self.root.storage_options)
        self._bare_root = self.url.split("://", 1)[-1].rstrip("/")  # as Lightning normalises a URL
        self._local_cache_dir = local_cache_dir
        self._fetched: dict[Path, Path] = {}
        self._saving: dict[str, threading.Lock] = {}
        self._stores: dict[str, BaseStore] = {}
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
                name = os.path.normpath(text[len(root) + 1:]).replace(os.sep, "/")
                if name != ".." and not name.startswith(("../", "/")):
                    return name
        raise ValueError(f"checkpoint path {text!r} is not under the store root {self.url}")

    def store_of(self, path: str | os.PathLike) -> BaseStore:
        """The store holding the versions of the checkpoint at ``path`` (one object per name)."""
        name = self.name_of(path)
        with self._lock:
            store = self._stores.get(name)
            if store is None:
                if isinstance(self.root, TieredStore):
                    store = self.root.under(name)
                else:
                    store = CheckpointStore(self.path_of(name), storage_options=self.storage_options)
                self._stores[name] = store
            return store

    def _tiers(self) -> list[CheckpointStore]:
        """The plain stores the root is made of: a tiered root's local tier and bucket, else itself."""
        return [self.root.local, self.root.bucket] if isinstance(self.root, TieredStore) else [self.root]

    def path_of(self, name: str) -> str:
        """The URL Lightning uses for checkpoint ``name``."""
        return f"{self.url.rstrip('/')}/{name}"

    def filesystem(self) -> Any:
        """The fsspec filesystem of the root (a tiered root's bucket): the store's own client, with
        its storage options."""
        return self._tiers()[-1].storage.fs

    def names(self) -> list[str]:
        """Checkpoint names under the root (in either tier) that hold a complete checkpoint (a
        fresh listing)."""
        names = set()
        for tier in self._tiers():
            prefixes, _objects = tier.storage.list_children("")
            names.update(prefix.rstrip("/") for prefix in prefixes)
        return [name for name in sorted(names) if self.exists(self.path_of(name))]

    def exists(self, path: str | os.PathLike) -> bool:
        """Whether a complete checkpoint is saved under ``path``'s name."""
        store = self.store_of(path)
        return any(info.status == COMPLETE for info in store.checkpoints())

    # -- CheckpointIO ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        """Commit ``checkpoint`` as the next version of the name at ``path``, then delete the
        name's older versions (module docs). :data:`REMOVAL_REQUEST` removes the name instead.

        Args:
            checkpoint (dict): Lightning's checkpoint; ``global_step`` and ``epoch`` go into the
                manifest's metadata.
            path (str | os.PathLike): ``<url>/<name>``, with or without the protocol.
            storage_options: Lightning's per-call options; unused (the plugin's own apply).

        Raises:
            ValueError: ``path`` is not under the root.
            CommitConflictError: another process committed the same version of this name
                concurrently (two writers of one checkpoint directory); nothing is changed.
            OSError: a backend failure; the name's previous version is untouched.
        """
        if checkpoint.keys() == REMOVAL_REQUEST.keys() and checkpoint.get(REMOVAL_REQUEST_KEY) is True:
            self.remove_checkpoint(path)
            return
        name = self.name_of(path)
        global_step = int(checkpoint.get("global_step", 0))

        def write(txn, shared: bool) -> None:
            with txn.open(PAYLOAD_NAME) as writer:
                torch.save(checkpoint, writer)

        def drop_leftovers(after: AfterCommit, url: str) -> None:
            for step in leftovers:  # attempts of killed saves of this name: no manifest names them
                store.delete(step)

        with self._name_lock(name), route_background_random():
            store = self.store_of(path)  # under the name's lock: a removal closes the name's store
            listed = store.checkpoints()
            version = max((info.step for info in listed), default=0) + 1
            leftovers = [info.step for info in listed if info.status == UNCOMMITTED]
            metadata = {"framework": FRAMEWORK, "name": name, "epoch": checkpoint.get("epoch"),
                        "global_step": global_step}
            after = AfterCommit(store, version, retention=NEWEST_VERSION_ONLY, on_commit=[drop_leftovers])
            url = run_save(SaveRequest(after, world_size=1, metadata=metadata, write=write))
        logger.info("saved %s (global_step %d) as version %d (%s)", name, global_step, version, url)

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The newest complete version of the checkpoint at ``path`` (size and CRC32C checked), or
        a local file :meth:`fetch_local` fetched for ``ckpt_path="last"`` (then deleted: it was
        only Lightning's way to the store).

        Raises:
            CheckpointNotFoundError: no complete version under that name (``FileNotFoundError``).
            IntegrityError: the bytes differ from the manifest.
        """
        local = Path(os.fspath(path))
        if local in self._fetched:
            try:
                with open(local, "rb") as handle:
                    return torch.load(handle, map_location=map_location, weights_only=weights_only)
            finally:
                self._drop_fetched()
        store = self.store_of(path)
        step = store.latest_step()
        with store.open(step, PAYLOAD_NAME) as reader:
            return torch.load(reader, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        """Delete every version of the checkpoint at ``path``, each manifest first (on a tiered
        root once the name's uploads finished), and close the name's store.

        Raises:
            UploadError: (a tiered root) an upload of this name failed and nobody saw it yet.
        """
        name = self.name_of(path)
        with self._name_lock(name):
            store = self.store_of(path)
            store.flush()
            for info in store.checkpoints():
                store.delete(info.step)
            with self._lock:
                self._stores.pop(name, None)
            store.close()
        logger.info("removed %s", name)

    def teardown(self) -> None:
        """Close every name's store (a tiered root: wait for its uploads) and delete local copies
        :meth:`fetch_local` made that were not loaded. (Lightning's ``AsyncCheckpointIO`` does not
        forward ``teardown``; a loaded copy is deleted at the load.)

        Raises:
            UploadError: (a tiered root) an upload failed and nobody saw it yet.
        """
        self._drop_fetched()
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        failures = []
        for store in stores:  # every store is closed, the first failure raised after
            try:
                store.close()
            except Exception as exc:  # noqa: BLE001 - raised below
                failures.append(exc)
        if failures:
            raise failures[0]

    # -- "last" ------------------------------------------------------------------------------
    def newest_complete(self, name: str) -> CheckpointInfo | None:
        """The newest complete version of ``name`` (its info, with manifest), or ``None``."""
        complete = [info for info in self.store_of(self.path_of(name)).checkpoints() if info.status == COMPLETE]
        return complete[-1] if complete else None

    def fetch_local(self, name: str, version: int | None = None) -> str:
        """Fetch a complete version of ``name`` (default: the newest) into a new private directory
        under the local cache; return the file's path. :meth:`load_checkpoint` of that path reads
        and deletes it.

        Raises:
            CheckpointNotFoundError: no complete version.
            IntegrityError: the bytes differ from the manifest (nothing is left locally).
        """
        store = self.store_of(self.path_of(name))
        step = store.latest_step() if version is None else version
        base = Path(self._local_cache_dir) if self._local_cache_dir is not None else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=f"opd-store-lightning-{step}-", dir=base)).resolve()
        target = directory / Path(name).name
        self._fetched[target] = directory
        try:
            with store.open(step, PAYLOAD_NAME) as reader, open(target, "wb") as out:
                shutil.copyfileobj(reader, out, 8 << 20)
        except BaseException:
            del self._fetched[target]
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return str(target)

    def _drop_fetched(self) -> None:
        fetched, self._fetched = self._fetched, {}
        for directory in fetched.values():
            shutil.rmtree(directory, ignore_errors=True)

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
        # ModelCheckpoint would build a filesystem for dirpath with no storage options: for gs://
        # that probes the GCE metadata server for default credentials (about 15 s of retries off
        # GCE). It gets the plugin's root and filesystem instead.
        super().__init__(dirpath=None, **kwargs)
        self.dirpath = checkpoint_io.url
        self._fs = checkpoint_io.filesystem()
        self.checkpoint_io = checkpoint_io

    def setup(self, trainer, pl_module, stage: str) -> None:
        # ModelCheckpoint.setup lists dirpath with Lightning's default filesystem (no storage
        # options) only to warn about a non-empty directory; the store is asked instead.
        self.dirpath = trainer.strategy.broadcast(self.dirpath)
        if trainer.is_global_zero and stage == "fit" and self.save_top_k != 0:
            names = self.checkpoint_io.names()
            if names:
                logger.info("%s holds checkpoints %s", self.checkpoint_io.url, names)

    def file_exists(self, filepath, trainer) -> bool:
        exists = self.checkpoint_io.exists(filepath) if trainer.is_global_zero else False
        return trainer.strategy.reduce_boolean_decision(exists, all=False)

    def _find_last_checkpoints(self, trainer) -> set[str]:
        """The newest complete ``last*.ckpt``, fetched locally (see module docs): Lightning then
        checks it with its default filesystem, which reaches only local paths with certainty.
        "Newest" is the latest commit time, as Lightning picks the last-modified file. Every rank
        fetches its own copy (each loads the checkpoint)."""
        pattern = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-v?\d+)?{re.escape(self.FILE_EXTENSION)}$")
        newest = {}
        for name in self.checkpoint_io.names():
            info = self.checkpoint_io.newest_complete(name) if pattern.match(name) else None
            if info is not None:
                newest[name] = info
        if not newest:
            return set()
        best = max(newest, key=lambda name: (newest[name].created_at, newest[name].metadata.get("global_step", -1)))
        try:
            return {self.checkpoint_io.fetch_local(best, newest[best].step)}
        except CheckpointNotFoundError:
            return set()

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        """Remove through ``AsyncCheckpointIO``'s queue when it wraps the plugin, so the removal
        runs after the saves queued before it (module docs); directly otherwise."""
        outer = trainer.strategy.checkpoint_io
        if isinstance(outer, AsyncCheckpointIO) and outer.checkpoint_io is self.checkpoint_io:
            if trainer.is_global_zero:
                outer.save_checkpoint(dict(REMOVAL_REQUEST), filepath)
            return
        super()._remove_checkpoint(trainer, filepath)


__all__ = ["PAYLOAD_NAME", "REMOVAL_REQUEST", "StoreCheckpointIO", "StoreModelCheckpoint"]
