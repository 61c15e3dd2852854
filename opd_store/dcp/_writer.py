"""``StoreWriter``: DCP's ``StorageWriter`` over any opd_store store, committed by one manifest.

DCP's planners and collectives run unchanged; this class decides where bytes go and when the
checkpoint exists: ``prepare_global_plan`` (coordinator) opens the one attempt; ``write_data``
(every rank) writes ``__<rank>_0.distcp`` (its shards) and ``__<rank>_1.distcp`` (whole tensors
and objects) into the attempt or a sealed part; ``finish`` (coordinator) adds every rank's
entries, extra payloads and ``.metadata``, then creates the manifest (the commit). Nothing is
renamed or deleted (DCP's fsspec writer's ``.metadata.tmp`` rename is a copy and delete on S3);
a failure anywhere commits nothing. The attempt id travels by one broadcast on ``process_group``
because DCP's plan cache would replay a stale id in plans. docs/sharded.md, "The storage layer".
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Sequence

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..format import PayloadEntry, step_dirname
from ..pipeline import AfterCommit
from ..store import BaseStore, as_store
from ._items import write_items
from ._metadata_io import METADATA_NAME, SHARD_FILE, SHARED_FILE, data_file_name, dumps_metadata
from ._store_address import StoreAddress, is_step_url

logger = logging.getLogger("opd_store.dcp")

DCP_VERSION = "1.0.0"
"""The metadata version DCP's own writers record (``filesystem.CURRENT_DCP_VERSION``)."""
_PART_FQN = "__opd_store_part__/"
ExtraPayloads = Callable[[Any], None]
"""``write(txn)``: write more payloads into the coordinator's transaction before DCP's metadata."""


_GROUP_NOT_GIVEN = object()
"""``StoreWriter(process_group=...)`` left out: the attempt id travels in DCP's plans."""


@dataclasses.dataclass(frozen=True)
class AttemptPlan:
    """What the coordinator shares with every rank in DCP's global plan (``storage_data``).

    Attributes:
        attempt_id (str): the attempt every rank writes under; read from here only without
            ``broadcast`` (a cached plan may hold an earlier save's).
        world_size (int): ranks in the save's process group.
        broadcast (bool): the id comes by one broadcast at the start of ``write_data``; the same on
            every save, so a cached plan still says it rightly.
    """

    attempt_id: str
    world_size: int
    broadcast: bool = False


def mesh_of(state_dict: Any) -> tuple[list[int], list[str] | None] | None:
    """Shape and dimension names of the device mesh of the first ``DTensor`` in a flat state dict."""
    from torch.distributed.tensor import DTensor

    for value in (state_dict or {}).values():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
            return list(mesh.shape), names
    return None


class StoreWriter(StorageWriter):
    """DCP storage writer committing one opd_store checkpoint (module docstring).

    Args:
        store (BaseStore | str | os.PathLike): a store (plain or tiered) or its URL.
        step (int): the step to commit; must not be committed yet.
        storage_options (dict | None): fsspec options when ``store`` is a URL.
        metadata (dict | None): manifest metadata (JSON); the writer adds ``checkpoint_format: "dcp"``
            and ``mesh_shape``/``mesh_dim_names``.
        mesh_shape (list[int] | None): default the first ``DTensor``'s mesh, or ``[world_size]``.
        extra_payloads (Callable[[Transaction], None] | None): writes more payloads in ``finish``.
        after_commit (AfterCommit | None): this store and step's after-commit stage
            (:meth:`run_after_commit`, coordinator).
        extensions (Sequence[StreamTransformExtension] | None): DCP's stream transforms
            (``[ZStandard()]``), recorded per item and as ``dcp_stream_transforms`` in the manifest.
        process_group (ProcessGroup | None): the group given to ``dcp.save`` (``None``: default);
            the attempt id is broadcast on it. Left out, the id travels in plans and plan caching is
            refused.

    Attributes:
        committed_url (str | None): the step's URL, set on the coordinator once committed.

    Raises:
        ValueError: a negative ``step``, or an ``after_commit`` of another store or step.

    Rank obligations: every rank of the group uses a writer of the same store, step, extensions
    and ``process_group`` choice; rank 0 is the coordinator.

    Pickles as its store's address (``StoreAddress``); one with an ``after_commit`` stage or an open
    attempt does not.
    """

    def __init__(self, store: BaseStore | str | os.PathLike, step: int, *,
                 storage_options: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
                 mesh_shape: list[int] | None = None, extra_payloads: ExtraPayloads | None = None,
                 after_commit: AfterCommit | None = None, extensions: Sequence[Any] | None = None,
                 process_group: Any = _GROUP_NOT_GIVEN) -> None:
        super().__init__()
        step_dirname(step)  # a non-negative int, else ValueError
        self.store = as_store(store, storage_options)
        self.step = step
        if after_commit is not None and (after_commit.store.url != self.store.url or after_commit.step != step):
            raise ValueError(f"StoreWriter for step {step} of {self.store.url} was given the after-commit stage "
                             f"of step {after_commit.step} of {after_commit.store.url}")
        self.after_commit = after_commit
        self.metadata = dict(metadata or {})
        self.mesh_shape = None if mesh_shape is None else [int(n) for n in mesh_shape]
        self.extra_payloads = extra_payloads
        self.extensions = tuple(extensions or ())
        self.process_group = process_group
        self.rank = 0
        self.is_coordinator = True
        self.committed_url: str | None = None
        self._txn = None
        self._attempt: AttemptPlan | None = None

    # -- pickling: DCP's process-based async_save ------------------------------------------------
    def __reduce__(self):
        """The writer as another process rebuilds it: its store's address instead of the store.

        Raises:
            TypeError: an ``after_commit`` stage, an open attempt, or a store another process
                cannot open as the same store (naming it).
        """
        if self.after_commit is not None:
            raise TypeError(f"StoreWriter for {self.checkpoint_id} has an after_commit stage, which runs in the "
                            "process that saves; it cannot be sent to another process")
        if self._txn is not None:
            raise TypeError(f"StoreWriter for {self.checkpoint_id} has an open attempt; it cannot be sent to "
                            "another process")
        state = dict(self.__dict__, store=StoreAddress.of(self.store))
        # DCP's background process saves with its own default group; "not given" is a flag there.
        state["process_group"] = "not given" if self.process_group is _GROUP_NOT_GIVEN else None
        return (_rebuild_writer, (state,))

    # -- DCP's StorageWriter -------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new save: an attempt left open by a failed save is discarded; a ``checkpoint_id``
        must be this writer's step URL (``store.step_url(step)``).

        Raises:
            ValueError: ``checkpoint_id`` names another location.
        """
        self.abort()
        self.committed_url = None
        if checkpoint_id is not None and os.fspath(checkpoint_id).rstrip("/") != self.checkpoint_id:
            raise ValueError(f"StoreWriter for {self.checkpoint_id} was given checkpoint_id {checkpoint_id!r}; "
                             "make one writer per step (StoreWriter(store, step))")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record this rank's role (DCP passes ``rank`` and ``use_collectives``).

        Raises:
            ValueError: ``use_collectives=False`` (one manifest must name every rank's files), or a
                ``process_group`` in which this process has another rank than in DCP's group.
        """
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self._attempt = None
        if not kwargs.get("use_collectives", True):
            raise ValueError("StoreWriter needs dcp.save(use_collectives=True): one manifest commits every rank's files")
        group_rank = self._group_rank()
        if group_rank is not None and group_rank != self.rank:
            raise ValueError(f"StoreWriter for {self.checkpoint_id}: this process is rank {self.rank} of the group "
                             f"dcp.save uses but rank {group_rank} of the writer's process_group; give the writer "
                             "the group given to dcp.save")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Open the attempt (coordinator) and say in every plan how its id travels.

        Raises:
            CommitConflictError: (a ``FileExistsError``) the step is already committed; nothing written.
            UnsupportedBackendError: the backend has no create-only write.
            ValueError: ``process_group``'s size differs from DCP's group, or DCP's plan cache handed
                back plans to a writer without ``process_group``; nothing written.
        """
        self.abort()
        world_size = len(plans)
        broadcast = world_size > 1 and self.process_group is not _GROUP_NOT_GIVEN
        if broadcast:
            import torch.distributed as dist

            group_size = dist.get_world_size(self.process_group)
            if group_size != world_size:
                raise ValueError(f"StoreWriter for {self.checkpoint_id}: dcp.save plans for {world_size} ranks but "
                                 f"the writer's process_group has {group_size}; give the writer the group given "
                                 "to dcp.save")
        elif world_size > 1 and any(not plan.usable for plan in plans):
            raise ValueError(f"StoreWriter for {self.checkpoint_id}: DCP's plan cache reuses earlier plans, whose "
                             "attempt id is an earlier save's; pass StoreWriter(..., process_group=<the group given "
                             "to dcp.save, None for the default group>) to use plan caching")
        self._txn = self.store.begin(self.step, world_size=world_size, metadata=self.metadata, rank=self.rank)
        self._attempt = AttemptPlan(self._txn.attempt_id, world_size, broadcast)
        return [dataclasses.replace(plan, storage_data=self._attempt) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as payloads of the shared attempt (see the module docstring).

        Raises:
            UnsafeCheckpointError: an object that weights-only loading cannot restore (key named).
            CommitConflictError: (a rank part) the step was committed meanwhile.
            OSError: a payload could not be written (this rank's payloads are discarded).
        """
        shared = self._shared_attempt(plan.storage_data)
        if self.is_coordinator:
            target = self._txn
            mesh = mesh_of(getattr(planner, "state_dict", None))
            self._txn.metadata.update(self._format_metadata(shared.world_size, mesh))
        else:
            target = self.store.begin_part(self.step, attempt_id=shared.attempt_id, rank=self.rank,
                                           world_size=shared.world_size)
        try:
            files = ((SHARD_FILE, [i for i in plan.items if i.type == WriteItemType.SHARD]),
                     (SHARED_FILE, [i for i in plan.items if i.type != WriteItemType.SHARD]))
            results: list[WriteResult] = []
            for index, items in files:
                if items:
                    name = data_file_name(self.rank, index)
                    with target.open(name) as writer:
                        results += write_items(writer, name, items, planner, self.extensions)
            if not self.is_coordinator:
                entries = tuple(entry.model_dump() for entry in target.seal())
                results.append(WriteResult(index=MetadataIndex(f"{_PART_FQN}{self.rank}"), size_in_bytes=0,
                                           storage_data=entries))
        except BaseException:
            target.abort()
            if self.is_coordinator:
                self._txn = None
            raise
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Add every rank's files, write the extra payloads and DCP's metadata, commit (coordinator).

        Raises:
            CommitConflictError: another attempt committed the step first.
            CommitError: the manifest create failed.
            IncompleteCheckpointError: a file is not stored with the size written.
            ValueError: no open attempt (``prepare_global_plan`` did not run here).
        """
        txn, self._txn = self._txn, None
        if txn is None:
            raise ValueError(f"{self.checkpoint_id}: finish without an open attempt (was prepare_global_plan run?)")
        storage_data = {}
        try:
            for rank_results in results:
                for result in rank_results:
                    if result.index.fqn.startswith(_PART_FQN):
                        for entry in result.storage_data:
                            txn.add_entry(PayloadEntry(**entry))
                    else:
                        storage_data[result.index] = result.storage_data
            metadata.version = DCP_VERSION
            metadata.storage_data = storage_data
            metadata.storage_meta = self.storage_meta()
            if self.extra_payloads is not None:
                self.extra_payloads(txn)
            txn.write_bytes(METADATA_NAME, dumps_metadata(metadata))
        except BaseException:
            txn.abort()
            raise
        self.committed_url = txn.commit()  # aborts or keeps the payloads itself, by the failure's kind
        logger.info("committed DCP checkpoint %s (world size %d)", self.committed_url, txn.world_size)

    def storage_meta(self) -> StorageMeta | None:
        """``checkpoint_id`` the step's URL; ``save_id`` this save's attempt id once known."""
        return StorageMeta(checkpoint_id=self.checkpoint_id,
                           save_id=None if self._attempt is None else self._attempt.attempt_id)

    @property
    def checkpoint_id(self) -> str:
        """The step's URL."""
        return self.store.step_url(self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for a store's step URL (pass ``storage_writer=StoreWriter(store, step)``)."""
        return is_step_url(checkpoint_id)

    # -- opd_store ------------------------------------------------------------------------------
    def run_after_commit(self) -> None:
        """Run the after-commit stage once, on the coordinator after ``finish`` committed; else nothing.

        Raises:
            RetentionError: (plain store) the retention pass failed; the step stays committed.
        """
        after, self.after_commit = self.after_commit, None
        if after is not None and self.committed_url is not None:
            after.run(self.committed_url)

    def abort(self) -> None:
        """Discard the attempt this coordinator opened and never committed (safe to call anywhere)."""
        txn, self._txn = self._txn, None
        if txn is not None:
            txn.abort()

    def _format_metadata(self, world_size: int, mesh: tuple[list[int], list[str] | None] | None) -> dict:
        shape = self.mesh_shape or (mesh[0] if mesh else [world_size])
        names = mesh[1] if mesh and not self.mesh_shape else None
        metadata = {"checkpoint_format": "dcp", "dcp_world_size": world_size, "mesh_shape": shape,
                    "mesh_dim_names": names}
        if self.extensions:  # as DCP records them per item: readable without torch
            metadata["dcp_stream_transforms"] = [ext.get_descriptor() for ext in reversed(self.extensions)]
        return metadata

    def _group_rank(self) -> int | None:
        """This process's rank in the writer's ``process_group`` (``None``: none given, or no
        process group initialised)."""
        import torch.distributed as dist

        if self.process_group is _GROUP_NOT_GIVEN or not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.get_rank(self.process_group)

    def _shared_attempt(self, shared: Any) -> AttemptPlan:
        """This save's attempt on this rank: the coordinator's own, else from the broadcast or the plan.

        Raises:
            ValueError: the plan carries no :class:`AttemptPlan` (another writer planned the save).
        """
        if not isinstance(shared, AttemptPlan):
            raise ValueError(f"{self.checkpoint_id}: rank {self.rank}'s save plan carries {shared!r}, not the "
                             "attempt of a StoreWriter; every rank must save with a StoreWriter")
        if not shared.broadcast:
            return self._txn_attempt() if self.is_coordinator else shared
        import torch.distributed as dist

        message = [dataclasses.asdict(self._txn_attempt()) if self.is_coordinator else None]
        dist.broadcast_object_list(message, group=None if self.process_group is _GROUP_NOT_GIVEN else self.process_group,
                                   group_src=0)
        self._attempt = AttemptPlan(**message[0])
        return self._attempt

    def _txn_attempt(self) -> AttemptPlan:
        if self._attempt is None or self._txn is None:
            raise ValueError(f"{self.checkpoint_id}: write_data on the coordinator without an open attempt "
                             "(was prepare_global_plan run?)")
        return self._attempt


def _rebuild_writer(state: dict[str, Any]) -> StoreWriter:
    """A :class:`StoreWriter` from :meth:`StoreWriter.__reduce__`'s state, its store reopened."""
    writer = StoreWriter.__new__(StoreWriter)
    group = _GROUP_NOT_GIVEN if state["process_group"] == "not given" else None
    writer.__dict__.update(state, store=state["store"].open(), process_group=group)
    return writer


__all__ = ["AttemptPlan", "DCP_VERSION", "ExtraPayloads", "StoreWriter", "mesh_of"]
