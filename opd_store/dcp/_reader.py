"""``StoreReader``: DCP's ``StorageReader`` over a committed opd_store checkpoint.

``dcp.load(state_dict, storage_reader=StoreReader(store, step))`` keeps DCP's planners and
resharding; this class adds that nothing reaches a tensor before every byte this rank reads is
checked, and that a damaged checkpoint fails every rank: ``read_metadata`` decodes verified
metadata safely; ``prepare_local_plan`` (inside DCP's planning collective) checks every file's
presence and size, then fetches and checks the files this rank reads; ``read_data`` hands object
items on only once weights-only loading accepted them. The price (a rank's files in memory before
its tensors fill): docs/performance.md. docs/sharded.md, "The storage layer".
"""

from __future__ import annotations

import logging
import os
from typing import Any, BinaryIO

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError
from ..format import step_dirname
from ..store import COMPLETE, UNCOMMITTED, BaseStore, as_store, remedy
from ._items import read_items, resolve_transforms
from ._metadata_io import METADATA_NAME, describe_file, loads_metadata
from ._store_address import StoreAddress, is_step_url

logger = logging.getLogger("opd_store.dcp")


class StoreReader(StorageReader):
    """DCP storage reader of one committed step.

    Args:
        store (BaseStore | str | os.PathLike): a store (plain or tiered) or its URL.
        step (int): a committed step written by ``StoreWriter`` (or adopted).
        storage_options (dict | None): fsspec options when ``store`` is a URL.
        extension_registry (ExtensionRegistry | None): rebuilds items' stream transforms
            (``FileSystemReader``'s ``_extension_registry``); ``None``: DCP's default (``ZStandard``).

    Rank obligations: every rank of the group passed to ``dcp.load`` uses a reader of the same store
    and step.

    Pickles as its store's address and step (``memory://`` and tiered stores refused).
    """

    def __init__(self, store: BaseStore | str | os.PathLike, step: int, *,
                 storage_options: dict[str, Any] | None = None, extension_registry: Any = None) -> None:
        super().__init__()
        step_dirname(step)
        self.store = as_store(store, storage_options)
        self.step = step
        self.extension_registry = extension_registry
        self.rank = 0
        self.manifest = None
        self.storage_data: dict = {}
        self.metadata_error: Exception | None = None
        self._files: dict[str, BinaryIO] = {}

    def __reduce__(self):
        """Rebuilt in another process from the store's address, the step and the registry.

        Raises:
            TypeError: a store another process cannot open as the same store (naming it).
        """
        return (_rebuild_reader, (StoreAddress.of(self.store), self.step, self.extension_registry))

    @property
    def checkpoint_id(self) -> str:
        """The step's URL."""
        return self.store.step_url(self.step)

    # -- DCP's StorageReader -------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new load: files held from an earlier one are released.

        Raises:
            ValueError: ``checkpoint_id`` names another location than this reader's step.
        """
        self._close_files()
        self.manifest = None
        if checkpoint_id is not None and os.fspath(checkpoint_id).rstrip("/") != self.checkpoint_id:
            raise ValueError(f"StoreReader for {self.checkpoint_id} was given checkpoint_id {checkpoint_id!r}; "
                             "make one reader per step (StoreReader(store, step))")

    def read_metadata(self) -> Metadata:
        """The step's DCP metadata (manifest read, ``.metadata`` checked and decoded safely).

        Raises:
            CheckpointNotFoundError: the step has no manifest (uncommitted, or nothing there).
            ManifestError: the manifest is unreadable.
            IntegrityError, IncompleteCheckpointError: the ``.metadata`` payload is damaged or absent.
            UnsafeCheckpointError: the metadata names a global outside DCP's metadata classes.
            ValueError: the checkpoint was not written through DCP (no ``.metadata`` payload).
        """
        self.metadata_error = None
        try:
            manifest = self.store.manifest(self.step)
            if manifest.entry(METADATA_NAME) is None:
                raise ValueError(f"{self.checkpoint_id}: step {self.step} is not a DCP checkpoint (no "
                                 f"{METADATA_NAME} payload); load it with load_opd_checkpoint")
            self.manifest = manifest
            data = self.store.read(self.step, METADATA_NAME, manifest=manifest)
            return loads_metadata(data, source=f"{self.checkpoint_id}/{METADATA_NAME}")
        except Exception as exc:
            # DCP turns a failed read_metadata into an AssertionError naming it; the typed error is
            # kept for opd_store.dcp.load to raise instead.
            self.metadata_error = exc
            raise

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.rank = int(kwargs.get("rank") or 0)
        if self.manifest is None:  # read_metadata was not called on this instance (a caller's metadata)
            self.manifest = self.store.manifest(self.step)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Check the whole step's files, then fetch and check the files this rank reads.

        Raises:
            IncompleteCheckpointError: a file of the manifest is missing or resized (every rank raises
                it), naming step, rank and file.
            IntegrityError: a file this rank reads differs from its manifest entry (step, rank, file).
            StreamTransformError: an item's transform the registry cannot rebuild.
            ValueError: an item of the plan has no place in the metadata.
        """
        self._close_files()
        self._check_complete()
        names = []
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if info is None:
                raise ValueError(f"{self.checkpoint_id}: DCP metadata has no storage for {item.storage_index.fqn!r}")
            if info.relative_path not in names:
                names.append(info.relative_path)
            if getattr(info, "transform_descriptors", None):  # refused here, before any rank reads
                resolve_transforms(info.transform_descriptors, self._registry(),
                                   where=f"{self.checkpoint_id} (step {self.step}): {describe_file(info.relative_path)}")
        for name in sorted(names):
            self._files[name] = self._open_checked(name)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items from the files checked in :meth:`prepare_local_plan`.

        Raises:
            UnsafeCheckpointError: an object item weights-only loading refuses.
            ValueError: a file that was not checked (a plan changed after planning), or an item
                inconsistent with its file.
        """
        per_file: dict[str, list] = {}
        for request in plan.items:
            per_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
        try:
            for name, requests in per_file.items():
                reader = self._files.get(name)
                if reader is None:
                    raise ValueError(f"{self.checkpoint_id}: {describe_file(name)} was not checked before reading")
                read_items(reader, requests, self.storage_data, planner,
                           where=f"{self.checkpoint_id}: {describe_file(name)}", registry=self._registry())
        finally:
            self._close_files()
        future: Future = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for a store's step URL (pass ``storage_reader=StoreReader(store, step)``)."""
        return is_step_url(checkpoint_id)

    # -- checks --------------------------------------------------------------------------------
    def _registry(self) -> Any:
        from torch.distributed.checkpoint._extension import ExtensionRegistry

        if self.extension_registry is None:
            self.extension_registry = ExtensionRegistry()
        return self.extension_registry

    def _check_complete(self) -> None:
        report = self.store.verify(self.step)  # one listing of the committed attempt: every size
        status, problems = report.status, report.problems
        if status == COMPLETE:
            return
        if status == UNCOMMITTED:
            raise CheckpointNotFoundError(f"{self.checkpoint_id}: step {self.step} is not committed")
        details = "; ".join(f"{describe_file(p.name)}: {p.detail}" for p in problems) or status
        raise IncompleteCheckpointError(f"{self.checkpoint_id}: step {self.step} cannot be loaded ({status}): {details}; "
                                        f"{remedy(self.store.url, self.step)}")

    def _open_checked(self, name: str) -> BinaryIO:
        try:
            return self.store.open(self.step, name, manifest=self.manifest)
        except IntegrityError as exc:
            raise IntegrityError(f"step {self.step}: {describe_file(name)} failed its check on rank {self.rank}: {exc}") from exc
        except IncompleteCheckpointError as exc:
            raise IncompleteCheckpointError(f"step {self.step}: {describe_file(name)} is missing: {exc}") from exc

    def _close_files(self) -> None:
        files, self._files = self._files, {}
        for reader in files.values():
            try:
                reader.close()
            except Exception:  # noqa: BLE001 - a reader that fails to close holds nothing we need
                logger.debug("could not close a checkpoint reader", exc_info=True)


def _rebuild_reader(address: StoreAddress, step: int, extension_registry: Any) -> StoreReader:
    """A :class:`StoreReader` from :meth:`StoreReader.__reduce__`'s arguments."""
    return StoreReader(address.open(), step, extension_registry=extension_registry)


__all__ = ["StoreReader"]
