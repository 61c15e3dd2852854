"""Lightning checkpoints in an opd_store store: a ``CheckpointIO`` plugin and a ``ModelCheckpoint``.

Three additions to a Lightning script (docs/integrations.md, "Lightning")::

    io = StoreCheckpointIO("s3://bucket/run/checkpoints", storage_options={...})
    trainer = L.Trainer(plugins=[io],                      # or AsyncCheckpointIO(io)
                        callbacks=[StoreModelCheckpoint(io, monitor="val_loss", save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="last")

Each checkpoint name (``last.ckpt``) is a store of its own, ``<url>/<name>/``, whose steps are
versions in save order (payload ``checkpoint.ckpt``). A save commits version ``N + 1`` through
:func:`opd_store.pipeline.run_save`, then deletes older versions (:data:`NEWEST_VERSION_ONLY`,
then uncommitted attempts), so a saved name always has a complete version, as Lightning's
overwritten file. :class:`StoreModelCheckpoint` answers ``file_exists`` and ``"last"`` from the
store (Lightning resolves remote paths with its default filesystem and drops their protocol,
Lightning #18261) and queues top-k removals behind ``AsyncCheckpointIO``'s saves
(:data:`REMOVAL_REQUEST`). Strategies that bypass the ``CheckpointIO`` are refused at setup
(:data:`BYPASSING_STRATEGIES`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch import strategies as _strategies

from ..errors import CheckpointNotFoundError
from ..format import JOURNAL_PREFIX
from ..opd import current_group, decide_on_rank0, load_collective
from ..pipeline import AfterCommit, SaveRequest, run_save
from ..retention import RetentionPolicy
from ..runtime import check_secs, route_background_random
from ..storage import refuse_mistyped_url
from ..store import COMPLETE, UNCOMMITTED, BaseStore, CheckpointStore, as_store
from ..tiered import TieredStore
from ._lightning_resume import PAYLOAD_NAME, committed_versions, open_last, open_newest, open_plain
from ._trainer_journal import DEFAULT_PROGRESS_EVERY_SECS, TrainerJournal

logger = logging.getLogger("opd_store.integrations.lightning")
_JOURNAL_LOCK = threading.Lock()
"""Guards the journal bookkeeping of every StoreModelCheckpoint (a module lock, not an instance one:
Lightning pickles callbacks, and its tests compare a pickled callback's attributes)."""

FRAMEWORK = "lightning"
REMOVAL_REQUEST_KEY = "opd_store_removal_request"
REMOVAL_REQUEST: dict[str, bool] = {REMOVAL_REQUEST_KEY: True}
"""What :class:`StoreModelCheckpoint` hands to ``save_checkpoint`` (through ``AsyncCheckpointIO``'s
queue) to remove a checkpoint after the saves queued before it."""
NEWEST_VERSION_ONLY = RetentionPolicy(keep_last=1)
"""The retention of every name's store: a save replaces the name's older versions (as Lightning
overwrites its file), through the one retention executor after the commit (pinned versions stay)."""
BYPASSING_STRATEGIES: dict[type, str] = {
    strategy: why for strategy, why in (
        (getattr(_strategies, "DeepSpeedStrategy", None), "DeepSpeed saves and loads through its engine"),
        (getattr(_strategies, "FSDPStrategy", None),
         "FSDP writes sharded state dicts to a local directory and loads full ones from a local path"),
        (getattr(_strategies, "ModelParallelStrategy", None),
         "ModelParallel writes distributed checkpoints to a local directory and loads from a local path"),
    ) if strategy is not None
}
"""Lightning strategies whose ``save_checkpoint``/``load_checkpoint`` bypass the ``CheckpointIO``
(their Lightning 2.6 sources): with them nothing, or not everything, would reach the store."""


@dataclasses.dataclass(frozen=True)
class CheckpointSaved:
    """One save of :meth:`StoreCheckpointIO.save_checkpoint`, as its ``save_observer`` sees it.

    Attributes:
        name (str): the checkpoint name (relative to the root).
        global_step (int): the checkpoint's ``global_step``.
        ok (bool): it committed (``False``: it failed, nothing committed).
        size_bytes (int | None): the payload's bytes (``None``: failed before they were written).
        commit_secs (float): seconds from the call to the end of its after-commit stage (or failure).
        requests (dict[str, int]): requests of the name's store (durable tier) meanwhile, by kind.
        thread_id (int): ``threading.get_ident()`` of the thread that saved.
    """

    name: str
    global_step: int
    ok: bool
    size_bytes: int | None
    commit_secs: float
    requests: dict[str, int]
    thread_id: int


class StoreCheckpointIO(CheckpointIO):
    """Save, load and remove Lightning checkpoints in a store (module docstring).

    Args:
        url (str | os.PathLike | BaseStore): the root the names live under: a URL or a store (a
            ``TieredStore`` gives each name its own tiered store, whose uploads ``remove_checkpoint``
            and ``teardown`` wait for). Give ``ModelCheckpoint`` the same ``dirpath``.
        storage_options (dict | None): fsspec options for every request (paths outside the root too).
        local_cache_dir (str | os.PathLike | None): where ``"last"`` placeholder files are made
            (default: the temp dir); each is removed at its load.

    Attributes:
        save_observer (Callable[[CheckpointSaved], None] | None): called after every save on the
            thread that saved.

    Raises:
        StoreUnreachableError: the store cannot be used (raised here, before training).

    Thread safety: ``AsyncCheckpointIO`` saves on its own thread; a removal waits for a running save
    of the same name.

    Rank obligations: Lightning saves and removes on global rank 0 only and loads on every rank; a
    load of a ``"last"`` placeholder is a collective (rank 0 picks the version).
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
        self._placeholders: dict[Path, re.Pattern] = {}
        self._saving: dict[str, threading.Lock] = {}
        self._stores: dict[str, BaseStore] = {}
        self._closed_requests: dict[str, int] = {}  # requests of the names' stores removed since
        self._lock = threading.Lock()
        self.save_observer: Callable[[CheckpointSaved], None] | None = None

    # -- names -----------------------------------------------------------------------------------
    def name_of(self, path: str | os.PathLike) -> str:
        """The checkpoint name (relative to the root) of a path Lightning passes: ``<url>/<name>``, with or
        without its protocol or a leading ``/``.

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

    def is_under_root(self, path: str | os.PathLike) -> bool:
        try:
            self.name_of(path)
        except ValueError:
            return False
        return True

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
        """The root's fsspec filesystem (a tiered root's bucket), with its storage options."""
        return self._tiers()[-1].storage.fs

    def listed_names(self) -> list[str]:
        """Every name under the root, in either tier, whatever its versions' status (a fresh listing; the
        journal's prefix excluded).
        """
        names = set()
        for tier in self._tiers():
            prefixes, _objects = tier.storage.list_children("")
            names.update(prefix.rstrip("/") for prefix in prefixes)
        names.discard(JOURNAL_PREFIX)
        return sorted(names)

    def upload_pending(self) -> dict[str, list[int]]:
        """A tiered root: queue the upload of each name's local versions its bucket lacks (an earlier
        process committed them locally and died before their uploads;
        :meth:`~opd_store.tiered.TieredStore.upload_pending`, as the main job at start, docs/tiered.md);
        a plain root: nothing. Returns the versions queued by name.
        """
        if not isinstance(self.root, TieredStore):
            return {}
        prefixes, _objects = self.root.local.storage.list_children("")
        queued = {}
        for name in sorted(prefix.rstrip("/") for prefix in prefixes):
            if name != JOURNAL_PREFIX:
                with self._name_lock(name):
                    versions = self.store_of(self.path_of(name)).upload_pending()
                if versions:
                    queued[name] = versions
        return queued

    def requests(self) -> dict[str, int]:
        """Requests the root and every name's store sent so far (durable tiers), by kind."""
        with self._lock:
            counts = dict(self._closed_requests)
            tiers = [self.root.durable_store(), *(store.durable_store() for store in self._stores.values())]
        for store in tiers:
            for kind, count in store.storage.requests.snapshot().items():
                counts[kind] = counts.get(kind, 0) + count
        return counts

    def names(self) -> list[str]:
        """Names under the root (either tier) holding a complete checkpoint (a fresh listing)."""
        return [name for name in self.listed_names() if self.exists(self.path_of(name))]

    def exists(self, path: str | os.PathLike) -> bool:
        """Whether a complete checkpoint is saved under ``path``'s name."""
        store = self.store_of(path)
        return any(info.status == COMPLETE for info in store.checkpoints())

    # -- CheckpointIO ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        """Commit ``checkpoint`` as the next version of the name at ``path``, then delete its older
        versions; :data:`REMOVAL_REQUEST` removes the name instead.

        Args:
            checkpoint (dict): Lightning's checkpoint; ``global_step`` and ``epoch`` go into the metadata.
            path (str | os.PathLike): ``<url>/<name>``, with or without the protocol.
            storage_options: Lightning's per-call options; unused (the plugin's own apply).

        Raises:
            ValueError: ``path`` is not under the root.
            CommitConflictError: another process committed the same version concurrently; nothing changed.
            OSError: a backend failure; the name's previous version is untouched.
        """
        if checkpoint.keys() == REMOVAL_REQUEST.keys() and checkpoint.get(REMOVAL_REQUEST_KEY) is True:
            self.remove_checkpoint(path)
            return
        name = self.name_of(path)
        global_step = int(checkpoint.get("global_step", 0))

        sizes: list[int] = []
        began = time.monotonic()

        def write(txn, shared: bool) -> None:
            with txn.open(PAYLOAD_NAME) as writer:
                torch.save(checkpoint, writer)
            sizes.append(writer.size_bytes)

        def drop_leftovers(after: AfterCommit, url: str) -> None:
            for step in leftovers:  # attempts of killed saves of this name: no manifest names them
                store.delete(step)

        with self._name_lock(name), route_background_random():
            store = self.store_of(path)  # under the name's lock: a removal closes the name's store
            tally = store.durable_store().storage.requests
            before = tally.snapshot()
            try:
                listed = store.checkpoints()
                version = max((info.step for info in listed), default=0) + 1
                leftovers = [info.step for info in listed if info.status == UNCOMMITTED]
                metadata = {"framework": FRAMEWORK, "name": name, "epoch": checkpoint.get("epoch"),
                            "global_step": global_step}
                after = AfterCommit(store, version, retention=NEWEST_VERSION_ONLY, on_commit=[drop_leftovers])
                url = run_save(SaveRequest(after, world_size=1, metadata=metadata, write=write))
            except BaseException:
                self._observe(name, global_step, False, sizes, began, before, tally.snapshot())
                raise
            self._observe(name, global_step, True, sizes, began, before, tally.snapshot())
        logger.info("saved %s (global_step %d) as version %d (%s)", name, global_step, version, url)

    def _observe(self, name: str, global_step: int, ok: bool, sizes: list[int], began: float,
                 before: dict[str, int], after: dict[str, int]) -> None:
        """Tell the ``save_observer`` of a save (a failing observer is logged: it never fails a save)."""
        observer = self.save_observer
        if observer is None:
            return
        requests = {kind: after[kind] - before.get(kind, 0) for kind in after if after[kind] > before.get(kind, 0)}
        try:
            observer(CheckpointSaved(name, global_step, ok, sum(sizes) if sizes else None, time.monotonic() - began,
                                     requests, threading.get_ident()))
        except Exception:  # noqa: BLE001 - the journal never fails a save
            logger.warning("the save observer failed on %s", name, exc_info=True)

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path``, read once and verified; for a ``"last"`` placeholder, the version
        rank 0 picks (:func:`~opd_store.integrations._lightning_resume.open_last`).

        Rank obligations: a placeholder's load is a collective (Lightning calls it on every rank).

        Raises:
            CheckpointNotFoundError: (a ``FileNotFoundError``) no committed version and no plain file.
            IntegrityError, IncompleteCheckpointError, ManifestError: (``ValueError``) the version is
                damaged (``"last"``: every version under the root is), naming it, the file and the
                remedy; nothing was loaded.
            DistributedLoadError: (several ranks) the load failed on some ranks only.
        """
        if self.is_placeholder(path):
            return self._load_last(Path(os.fspath(path)), map_location, weights_only)
        with self.open(path) as reader:
            return torch.load(reader, map_location=map_location, weights_only=weights_only)

    def open(self, path: str | os.PathLike) -> BinaryIO:
        """A seekable reader of the checkpoint at ``path``, checked against its manifest, for
        ``LightningModule.load_from_checkpoint(io.open(path))``. Under the root or in another store of
        versions: the newest committed version; else a plain file, read unchecked.

        Raises:
            CheckpointNotFoundError: nothing at ``path``.
            IntegrityError, IncompleteCheckpointError, ManifestError: the newest version is damaged.
        """
        if self.is_under_root(path):
            store, name = self.store_of(path), self.name_of(path)
        else:
            text = os.fspath(path)
            refuse_mistyped_url(text)
            store, name = CheckpointStore(text if "://" in text else os.path.abspath(text),
                                          storage_options=self.storage_options), text
        opened = open_newest(name, store)
        if opened is not None:
            return opened[1]
        plain = open_plain(path, self.storage_options)
        if plain is None:
            raise CheckpointNotFoundError(f"no checkpoint at {store.url}: no committed version and no file")
        logger.info("%s is a plain checkpoint file (no manifest): read unchecked", os.fspath(path))
        return plain

    def remove_checkpoint(self, path) -> None:
        """Delete every version of the name at ``path``, manifest first (a tiered root: once its uploads
        finished), then what is left under the name, and close its store.

        Raises:
            UploadError: (a tiered root) an upload of this name failed and nobody saw it yet.
        """
        name = self.name_of(path)
        with self._name_lock(name):
            store = self.store_of(path)
            store.flush()
            for info in store.checkpoints():
                store.delete(info.step)
            for tier in self._tiers():  # what is left: a local directory, pins (Lightning's file is gone)
                tier.storage.delete_tree(name)
            with self._lock:
                self._stores.pop(name, None)
                self._count_closed(store)
            store.close()
        logger.info("removed %s", name)

    def teardown(self) -> None:
        """Close every name's store (a tiered root: wait for uploads) and delete unloaded placeholders
        (``AsyncCheckpointIO`` does not forward ``teardown``).

        Raises:
            UploadError: (a tiered root) an upload failed and nobody saw it yet.
        """
        self._drop_placeholders()
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
            for store in stores:
                self._count_closed(store)
        failures = []
        for store in stores:  # every store is closed, the first failure raised after
            try:
                store.close()
            except Exception as exc:  # noqa: BLE001 - raised below
                failures.append(exc)
        if failures:
            raise failures[0]

    # -- "last" ------------------------------------------------------------------------------
    def holds_committed(self) -> bool:
        """Whether any name under the root holds a committed version, intact or damaged (what
        ``ckpt_path="last"`` may resume from: :func:`~opd_store.integrations._lightning_resume.open_last`)."""
        return any(committed_versions(name, self.store_of(self.path_of(name))) for name in self.listed_names())

    def last_placeholder(self, pattern: re.Pattern) -> str:
        """An empty local file in a new private directory that stands for ``ckpt_path="last"`` until
        :meth:`load_checkpoint` picks the version.
        """
        base = Path(self._local_cache_dir) if self._local_cache_dir is not None else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix="opd-store-lightning-last-", dir=base)).resolve()
        placeholder = directory / "last.ckpt"
        placeholder.touch()
        self._placeholders[placeholder] = pattern
        return str(placeholder)

    def is_placeholder(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` is a ``"last"`` placeholder of this plugin not loaded yet."""
        return Path(os.fspath(path)) in self._placeholders

    def resumed_name(self, path: str | os.PathLike | None) -> str | None:
        """The name of an explicit resume path under the root (Lightning keeps the file a run resumed
        from); ``None`` otherwise, a ``"last"`` placeholder too: the top-k name ``"last"`` fell back to is
        in the ``best_k_models`` its checkpoint restored and is evicted by them, else it would stay
        beside ``save_top_k`` newer names for good.
        """
        if path is None:
            return None
        return self.name_of(path) if self.is_under_root(path) else None

    def _load_last(self, placeholder: Path, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        """Rank 0 picks the version (and keeps its verified bytes), every rank loads it."""
        pattern = self._placeholders[placeholder]
        group = current_group()
        kept: dict[str, BinaryIO] = {}

        def pick() -> tuple[str, int]:
            stores = {name: self.store_of(self.path_of(name)) for name in self.listed_names()}
            version, reader = open_last(self.url, stores, pattern)
            kept["reader"] = reader
            return version.name, version.info.step

        def load() -> dict[str, Any]:
            reader = kept.pop("reader", None)  # rank 0's verified download, else this rank's own
            if reader is None:
                reader = self.store_of(self.path_of(name)).open(step, PAYLOAD_NAME)
            with reader:
                return torch.load(reader, map_location=map_location, weights_only=weights_only)

        try:
            name, step = pick() if group is None else decide_on_rank0(group, pick)
            checkpoint = load() if group is None else load_collective(group, load)
        finally:
            self._drop_placeholders()
            if "reader" in kept:
                kept.pop("reader").close()
        logger.info("ckpt_path=\"last\": loaded %s version %d", self.path_of(name), step)
        return checkpoint

    def _drop_placeholders(self) -> None:
        placeholders, self._placeholders = self._placeholders, {}
        for placeholder in placeholders:
            shutil.rmtree(placeholder.parent, ignore_errors=True)

    def _count_closed(self, store: BaseStore) -> None:
        """Keep the requests of a name's store this plugin lets go (under ``_lock``) for :meth:`requests`."""
        for kind, count in store.durable_store().storage.requests.snapshot().items():
            self._closed_requests[kind] = self._closed_requests.get(kind, 0) + count

    def _name_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._saving.setdefault(name, threading.Lock())


class StoreModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose existence checks, ``ckpt_path="last"`` and top-k removals ask the store.

    Args:
        checkpoint_io (StoreCheckpointIO): the plugin given to the ``Trainer`` (alone or wrapped in
            ``AsyncCheckpointIO``); its root is the ``dirpath``.
        journal_progress_secs (float): seconds between the journal's ``progress`` events (0: every
            batch); global rank 0 journals each ``fit`` in the root (docs/ledger.md).
        **kwargs: ``ModelCheckpoint``'s arguments; ``save_last="link"`` is refused (local-only).

    Attributes:
        journal (TrainerJournal | None): the journal of the current ``fit``.

    Raises:
        ValueError: ``dirpath`` differs from the plugin's root, ``save_last="link"``, or a negative,
            NaN or infinite ``journal_progress_secs``; at setup, a strategy of :data:`BYPASSING_STRATEGIES`.
    """

    def __init__(self, checkpoint_io: StoreCheckpointIO, *,
                 journal_progress_secs: float = DEFAULT_PROGRESS_EVERY_SECS, **kwargs: Any) -> None:
        dirpath = kwargs.pop("dirpath", None) or checkpoint_io.url
        if os.fspath(dirpath).rstrip("/") != checkpoint_io.url.rstrip("/"):
            raise ValueError(f"dirpath {dirpath!r} differs from the store root {checkpoint_io.url!r}")
        journal_progress_secs = check_secs(journal_progress_secs, "journal_progress_secs")
        if kwargs.get("save_last") == "link":
            raise ValueError("save_last='link' makes a local symbolic link; use save_last=True with a store")
        # ModelCheckpoint would build a filesystem for dirpath with no storage options: for gs://
        # that probes the GCE metadata server for default credentials (about 15 s of retries off
        # GCE). It gets the plugin's root and filesystem instead.
        super().__init__(dirpath=None, **kwargs)
        self.dirpath = checkpoint_io.url
        self._fs = checkpoint_io.filesystem()
        self.checkpoint_io = checkpoint_io
        self.journal_progress_secs = float(journal_progress_secs)
        self.journal: TrainerJournal | None = None
        self._awaiting: dict[str, collections.deque] = {}  # name -> keys of saves begun here, not yet seen committed
        self._save_count = 0
        self._save_reason = "periodic"
        self._training_thread: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Refuse a strategy that bypasses the ``CheckpointIO``, then ``ModelCheckpoint.setup`` with the
        store answering; a fit on a tiered root queues the uploads an earlier process left
        (:meth:`StoreCheckpointIO.upload_pending`, global rank 0).

        Raises:
            ValueError: the strategy is one of :data:`BYPASSING_STRATEGIES` (naming it and why).
        """
        self.journal = None  # a fit journals from on_train_start; nothing before it is a start's
        for strategy, why in BYPASSING_STRATEGIES.items():
            if isinstance(trainer.strategy, strategy):
                raise ValueError(f"{type(trainer.strategy).__name__} is not supported by StoreModelCheckpoint: {why}, "
                                 f"so its checkpoints would not (all) reach {self.checkpoint_io.url}; use DDP "
                                 "or a single device")
        self.dirpath = trainer.strategy.broadcast(self.dirpath)
        if trainer.is_global_zero and stage == "fit":  # global rank 0 saves, so it uploads
            queued = self.checkpoint_io.upload_pending()
            if queued:
                logger.info("%s: queued the upload of local versions %s", self.checkpoint_io.url, queued)
        if trainer.is_global_zero and stage == "fit" and self.save_top_k != 0:
            names = self.checkpoint_io.listed_names()  # one listing: this is only said
            if names:
                logger.info("%s holds checkpoint names %s", self.checkpoint_io.url, names)

    def file_exists(self, filepath, trainer) -> bool:
        exists = self.checkpoint_io.exists(filepath) if trainer.is_global_zero else False
        return trainer.strategy.reduce_boolean_decision(exists, all=False)

    def _find_last_checkpoints(self, trainer) -> set[str]:
        """A placeholder for ``"last"`` when any name under the root holds a committed version (the load
        picks a ``last*.ckpt`` one, else the newest intact one: never a silent fresh start over committed
        checkpoints, docs/resume.md), else nothing. Lightning asks on every rank before the group exists.
        """
        pattern = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-v?\d+)?{re.escape(self.FILE_EXTENSION)}$")
        if not self.checkpoint_io.holds_committed():
            return set()
        return {self.checkpoint_io.last_placeholder(pattern)}

    def _should_remove_checkpoint(self, trainer, previous: str, current: str) -> bool:
        """Lightning's local-directory rules for the store's names: a name saved again, one outside the
        root and the one an explicit ``ckpt_path`` resumed from are kept (Lightning deems every remote
        path removable).
        """
        if previous == current or not self.checkpoint_io.is_under_root(previous):
            return False
        name = self.checkpoint_io.name_of(previous)
        if self.checkpoint_io.is_under_root(current) and self.checkpoint_io.name_of(current) == name:
            return False
        return name != self.checkpoint_io.resumed_name(trainer.ckpt_path)

    # -- the run journal (opd_store.integrations._trainer_journal) ---------------------------------
    _SAVE_PARTS = ("commit", "blocking")
    """A save's journal event waits for the plugin's commit (on the thread that saves: the
    training thread, or ``AsyncCheckpointIO``'s) and for the training thread's return from
    ``_save_checkpoint`` (the seconds it was blocked)."""

    def on_train_start(self, trainer, pl_module) -> None:
        """Start this fit's journal (global rank 0 writes): ``start``, and ``resume`` with the step
        Lightning restored (``None`` without ``ckpt_path``)."""
        super().on_train_start(trainer, pl_module)
        self.journal = TrainerJournal(self.checkpoint_io.root, rank=trainer.global_rank,
                                      world_size=trainer.world_size, progress_every_secs=self.journal_progress_secs,
                                      requests=self.checkpoint_io.requests)
        self._training_thread = threading.get_ident()
        if trainer.is_global_zero:
            self.checkpoint_io.save_observer = self._journal_commit
        outer = trainer.strategy.checkpoint_io
        self.journal.started(trainer.global_step if trainer.ckpt_path is not None else None,
                             updates=trainer.max_steps if trainer.max_steps > 0 else None,
                             checkpoint_every=self._every_n_train_steps or None,
                             async_save=isinstance(outer, AsyncCheckpointIO))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self.journal is not None:
            self.journal.update_began()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Journal the update (``first_update``/``progress``) before ``ModelCheckpoint`` saves."""
        if self.journal is not None:
            self.journal.update_done(trainer.global_step)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        """``ModelCheckpoint``'s save, timed on the training thread for the journal (rank 0, names
        under the root)."""
        if self.journal is None or not trainer.is_global_zero or not self.checkpoint_io.is_under_root(filepath):
            super()._save_checkpoint(trainer, filepath)
            return
        name = self.checkpoint_io.name_of(filepath)
        with _JOURNAL_LOCK:
            self._save_count += 1
            key = (name, self._save_count)
            self._awaiting.setdefault(name, collections.deque()).append(key)
        began = time.monotonic()
        try:
            super()._save_checkpoint(trainer, filepath)
        except BaseException:
            with _JOURNAL_LOCK:  # failed before the plugin saw it: no commit part will come
                waiting = self._awaiting[name]
                unseen = key in waiting
                if unseen:
                    waiting.remove(key)
            if not unseen:
                self.journal.save_part(key, "blocking", self._SAVE_PARTS, failed=True)
            raise
        self.journal.save_part(key, "blocking", self._SAVE_PARTS, reason=self._save_reason,
                               blocking_secs=time.monotonic() - began)

    def _journal_commit(self, saved: CheckpointSaved) -> None:
        """The plugin's ``save_observer``: the commit part of the oldest save of that name; a save that did
        not come through :meth:`_save_checkpoint` is journaled alone.
        """
        journal = self.journal
        if journal is None:
            return
        with _JOURNAL_LOCK:
            waiting = self._awaiting.get(saved.name)
            key = waiting.popleft() if waiting else None
        fields = dict(step=saved.global_step, size_bytes=saved.size_bytes, commit_secs=saved.commit_secs,
                      requests=saved.requests, failed=not saved.ok)
        if key is not None:
            journal.save_part(key, "commit", self._SAVE_PARTS, **fields)
            return
        blocking = saved.commit_secs if saved.thread_id == self._training_thread else 0.0
        journal.save_part((saved.name, "direct", time.monotonic()), "commit", ("commit",), reason="periodic",
                          blocking_secs=blocking, **fields)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Journal how the fit ended (after SIGTERM: ``notice`` and ``exit`` ``preempted``; else ``exit``
        ``failed``), then what ``ModelCheckpoint`` does.
        """
        journal = self.journal
        if journal is None:
            super().on_exception(trainer, pl_module, exception)
            return
        step, preempted = trainer.global_step, bool(trainer.received_sigterm)
        if preempted:
            # save_on_exception: ModelCheckpoint's since recent Lightning releases (2.6 has it); absent before
            saving = getattr(self, "save_on_exception", False) and self._should_save_on_exception(trainer)
            decision = "save" if saving else ("already_committed" if self._last_global_step_saved == step else "skip")
            journal.notice(source="SIGTERM", detail=f"Lightning stopped at SIGTERM ({type(exception).__name__})",
                           step=step, decision=decision, deadline_secs=None)
            self._save_reason = "notice"
        try:
            super().on_exception(trainer, pl_module, exception)
        finally:
            self._save_reason = "periodic"
            journal.exit("preempted" if preempted else "failed", step, None if preempted else exception)

    def on_fit_end(self, trainer, pl_module) -> None:
        """Journal ``exit`` ``finished`` (Lightning calls this after its teardown: every
        ``AsyncCheckpointIO`` save has ended) and detach from the plugin."""
        super().on_fit_end(trainer, pl_module)
        if self.journal is not None:
            self.journal.exit("finished", trainer.global_step)
            if self.checkpoint_io.save_observer == self._journal_commit:
                self.checkpoint_io.save_observer = None

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        """Remove through ``AsyncCheckpointIO``'s queue when it wraps the plugin, so the removal runs after
        the saves queued before it; directly otherwise.
        """
        outer = trainer.strategy.checkpoint_io
        if isinstance(outer, AsyncCheckpointIO) and outer.checkpoint_io is self.checkpoint_io:
            if trainer.is_global_zero:
                outer.save_checkpoint(dict(REMOVAL_REQUEST), filepath)
            return
        super()._remove_checkpoint(trainer, filepath)


__all__ = ["BYPASSING_STRATEGIES", "PAYLOAD_NAME", "REMOVAL_REQUEST", "StoreCheckpointIO", "StoreModelCheckpoint"]
