"""``CheckpointStore``: list, read, verify, write and delete checkpoints under one URL.

The rule everything here is built on: **a checkpoint exists exactly when its manifest does**, and
it is *complete* when that manifest parses and every object it lists exists with its recorded size.
Payloads without a manifest, attempt leftovers, zero-byte or short objects and unparsable manifests
never count. Local, memory, S3 and GCS stores answer the same way because every answer comes from
the backend as it is now (see :mod:`opd_store.storage._base`). A legacy checkpoint (no manifest) is
read through :class:`~opd_store.store._legacy.LegacyReader`; this store only refuses to commit over
one.
"""

from __future__ import annotations

import logging
import os
from typing import Any, BinaryIO

from ..commit import PartTransaction, Transaction
from ..errors import CheckpointNotFoundError, CommitConflictError, UnsupportedBackendError
from ..format import MANIFEST_NAME, Manifest, check_attempt_id, new_attempt_id, step_dirname, step_rel
from ..runtime import kill_points
from ..storage import Storage, check_reachable, open_storage
from ._api import BaseStore, DurableHook, RetentionTier
from ._known_steps import KnownSteps
from ._legacy import holds_legacy_marker, refuse_legacy_step
from ._status import (
    COMPLETE,
    CheckpointInfo,
    StepState,
    VerifyReport,
    checkpoint_info,
    newest_step,
    objects_by_step,
    read_manifest,
    step_prefixes,
    step_state,
)
from ._verified_reads import KeepReader, open_payload, verify_step

logger = logging.getLogger("opd_store.store")


class CheckpointStore(BaseStore):
    """Checkpoints under one URL, committed by write-then-commit-manifest.

    Args:
        url (str | os.PathLike): a local path or ``file://``, ``memory://``, ``s3://``, ``gs://`` or
            other fsspec URL of the store root.
        storage_options (dict | None): fsspec filesystem options (``endpoint_url``, credentials,
            ...), used by every request the store makes, listings and existence checks included.
        allow_check_then_put (bool): on a backend without a create-only write, commit with an
            ``exists`` check followed by a plain put. Two writers racing inside that window can
            both "commit" and the later manifest wins; off by default.

    Attributes:
        storage (Storage): the backend (its ``layout`` is where saves put their payloads).
        known (KnownSteps): steps this instance committed or saw complete, with their manifests
            (:mod:`opd_store.store._known_steps`; the after-save retention pass reads it).

    Raises:
        ValueError: empty or chained URL, or a storage option out of range (an unknown
            ``key_layout`` is named).
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        allow_check_then_put: bool = False,
    ) -> None:
        self.storage = open_storage(url, storage_options, allow_check_then_put=allow_check_then_put)
        self._storage_options = dict(storage_options or {})
        self.known = KnownSteps()

    @classmethod
    def from_storage(cls, storage: Storage) -> "CheckpointStore":
        """A store over an already built :class:`~opd_store.storage.Storage` (tests wrap one)."""
        store = cls.__new__(cls)
        store.storage = storage
        store._storage_options = {}
        store.known = KnownSteps()
        return store

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec options the store was opened with."""
        return self._storage_options

    @property
    def url(self) -> str:
        """The store root (a plain absolute path for local stores)."""
        return self.storage.url_root

    def step_url(self, step: int) -> str:
        """URL of ``step``'s checkpoint (its step prefix)."""
        return self.storage.url(step_dirname(step))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def tiers(self) -> list["CheckpointStore"]:
        """``[self]``: a plain store reads from itself."""
        return [self]

    def check_reachable(self, *, write: bool = True, timeout_secs: float | None = None) -> None:
        """Fail fast, before any work, when the store cannot be used: a real probe (a listing;
        with ``write`` a probe object created and deleted, a missing local root created) that
        answers within ``timeout_secs`` (default: the ``connect_timeout_secs`` storage option,
        15 s) whatever the backend does (:mod:`opd_store.storage._reachability`).

        Raises:
            StoreUnreachableError: no such bucket, missing credentials, no connection, no answer
                in time, a local root that cannot be created or written (URL, operation, cause).
            StoreNotFoundError: ``write`` is false and the local root does not exist.
        """
        check_reachable(self.storage, write=write, timeout_secs=timeout_secs)

    # -- listing ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps whose manifest object exists, ascending (numeric order).

        One recursive listing of the store (paginated by the backend, no request per step). A
        listed step may still be incomplete or corrupt: use :meth:`checkpoints` or
        :meth:`is_complete` to know.
        """
        by_step = objects_by_step(self.storage.list_tree(""))
        return sorted(step for step, objects in by_step.items() if MANIFEST_NAME in objects)

    def step_prefixes(self) -> list[int]:
        """Every step with a prefix under the root, committed or not, ascending (one delimiter
        listing of the root: a page per 1,000 steps, whatever each step holds)."""
        return step_prefixes(self.storage)

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every step prefix with its status, ascending.

        One recursive listing plus one manifest read per committed step. Uncommitted prefixes
        (a save in progress, or a killed one) appear with status ``uncommitted``.
        """
        by_step = objects_by_step(self.storage.list_tree(""))
        return [checkpoint_info(self.storage, step, objects) for step, objects in sorted(by_step.items())]

    # -- completeness ------------------------------------------------------------------------
    def find_manifest(self, step: int) -> Manifest | None:
        """The parsed manifest of ``step``, or ``None`` when it has none (one small read).

        Raises:
            ManifestError: the manifest exists but does not parse or names another step.
        """
        return read_manifest(self.storage, step)

    def step_state(self, step: int, objects: dict[str, int] | None = None) -> StepState:
        """Status, manifest and problems of one step (see :func:`opd_store.store._status.step_state`).

        Args:
            step (int): the step.
            objects (dict[str, int] | None): the step's listing (paths under the step prefix) when
                the caller already has it; otherwise the committed attempt is listed (one request).
        """
        return step_state(self.storage, step, objects)

    def is_complete(self, step: int) -> bool:
        """True when ``step`` has a parseable manifest and every object it lists with its size."""
        return self.step_state(step).status == COMPLETE

    def status(self, step: int) -> str:
        """``complete``, ``incomplete``, ``corrupt`` or ``uncommitted`` (nothing there too)."""
        return self.step_state(step).status

    def latest_step(self) -> int:
        """The newest complete step.

        Lists the step prefixes (one delimiter listing), then checks candidates newest first: one
        manifest read and one listing of its attempt prefix each. Skipped candidates (uncommitted,
        incomplete, corrupt) are logged as warnings naming the step and the reason
        (:func:`opd_store.store._status.newest_step`).

        Raises:
            CheckpointNotFoundError: no complete step in the store.
        """
        return newest_step(self.storage, lambda _step, state: state.status == COMPLETE)

    def holds_step(self, step: int) -> bool:
        """True when ``step`` has a manifest, whatever its status, or a legacy checkpoint (one
        delimiter listing of the step prefix: one request on S3 and GCS)."""
        _prefixes, files = self.storage.list_children(step_dirname(step))
        return MANIFEST_NAME in files or holds_legacy_marker(files)

    def manifest(self, step: int) -> Manifest:
        """The parsed manifest of ``step``.

        Raises:
            CheckpointNotFoundError: ``step`` has no manifest.
            ManifestError: the manifest does not parse or names another step.
        """
        manifest = self.find_manifest(step)
        if manifest is None:
            raise CheckpointNotFoundError(f"no manifest for step {step} at {self.step_url(step)}")
        return manifest

    # -- payload reads -----------------------------------------------------------------------
    def names(self, step: int) -> list[str]:
        """Payload names of ``step`` (from its manifest).

        Raises:
            CheckpointNotFoundError: no manifest at ``step``.
            ManifestError: unreadable manifest.
        """
        return [entry.name for entry in self.manifest(step).payloads]

    def read(self, step: int, name: str, *, manifest: Manifest | None = None) -> bytes:
        """Bytes of the payload ``name`` of ``step``, checked against the manifest's size and CRC32C.

        Args:
            step (int): the step.
            name (str): the payload's relative name.
            manifest (Manifest | None): the step's manifest when the caller already fetched it
                (saves one request per payload when reading several).

        Raises:
            CheckpointNotFoundError: no manifest at ``step``, or no such payload name.
            IncompleteCheckpointError: the manifest lists the object but it is absent.
            IntegrityError: size or checksum differ (the message names URL, step, object, expected
                and actual values).
            ManifestError: unreadable manifest.
        """
        with self.open(step, name, manifest=manifest) as reader:
            return reader.read()

    def open(self, step: int, name: str, *, manifest: Manifest | None = None) -> BinaryIO:
        """A seekable binary reader over the verified bytes of a payload (see :meth:`read` and
        :func:`opd_store.store._verified_reads.open_payload`).

        Raises:
            CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError, ManifestError:
                as :meth:`read`.
        """
        return open_payload(self.storage, step, name, self.manifest(step) if manifest is None else manifest)

    def verify(self, step: int, *, deep: bool = False, keep: KeepReader | None = None) -> VerifyReport:
        """Check one step: sizes of every listed object, and with ``deep`` their CRC32C too, the
        reader of each intact payload handed to ``keep`` (:meth:`ReadableStore.verify <opd_store.store._api.ReadableStore.verify>`)."""
        return verify_step(self.storage, step, self.step_state(step), deep=deep, keep=keep)

    # -- writes ------------------------------------------------------------------------------
    def begin(
        self,
        step: int,
        *,
        world_size: int = 1,
        metadata: dict[str, Any] | None = None,
        attempt_id: str | None = None,
        rank: int = 0,
    ) -> Transaction:
        """Start a save attempt of ``step``; use as ``with store.begin(step) as txn: ...``.

        Args:
            step (int): the step to commit.
            world_size (int): ranks writing this checkpoint (recorded in the manifest).
            metadata (dict | None): JSON-serialisable values stored in the manifest.
            attempt_id (str | None): a given attempt id (multi-rank saves share rank 0's); a new
                one by default.
            rank (int): the committing rank, recorded as the writer.

        Raises:
            CommitConflictError: ``step`` already has a manifest, or holds a legacy checkpoint
                (:func:`~opd_store.store._legacy.refuse_legacy_step`); raised before anything is
                uploaded.
            UnsupportedBackendError: the backend cannot commit atomically and check-then-put was
                not allowed.
        """
        if not self.storage.atomic_create and not getattr(self.storage, "allow_check_then_put", False):
            raise UnsupportedBackendError(
                f"{self.url}: this fsspec backend has no create-only write, so two writers of step {step} "
                "could both commit; pass allow_check_then_put=True to accept that race (docs/protocol.md)"
            )
        prefix = step_dirname(step)
        if self.storage.size(f"{prefix}/{MANIFEST_NAME}") is not None:
            raise CommitConflictError(f"checkpoint already exists: {self.step_url(step)} (step {step} is committed)")
        refuse_legacy_step(self.storage, step)
        txn = Transaction(
            self.storage,
            step,
            new_attempt_id() if attempt_id is None else check_attempt_id(attempt_id),
            world_size=world_size,
            metadata=metadata,
            rank=rank,
        )
        # The commit listed every payload just before creating the manifest: the step is complete.
        txn.on_commit(after=lambda _url: self.known.saw_complete(txn.committed_manifest))
        return txn

    def begin_part(self, step: int, *, attempt_id: str, rank: int, world_size: int) -> PartTransaction:
        """Start one rank's part of a multi-rank save under the committing rank's attempt.

        The part writes payloads under ``step-NNNNNN/<attempt_id>/`` and never a manifest; its
        :meth:`~opd_store.commit._part_transaction.PartTransaction.seal` returns the entries the committing rank
        passes to :meth:`~opd_store.commit._transaction.Transaction.add_entry` before it commits.

        Args:
            step (int): the step being saved (the committing rank's).
            attempt_id (str): the attempt chosen by the committing rank's :meth:`begin`.
            rank (int): this part's rank, ``0 < rank < world_size`` by convention.
            world_size (int): ranks writing the checkpoint.

        Raises:
            CommitConflictError: ``step`` is already committed (nothing is written).
            ValueError: ``attempt_id`` is malformed, or ``rank`` is outside ``[0, world_size)``.
        """
        check_attempt_id(attempt_id)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        if self.storage.size(f"{step_dirname(step)}/{MANIFEST_NAME}") is not None:
            raise CommitConflictError(f"checkpoint already exists: {self.step_url(step)} (step {step} is committed)")
        return PartTransaction(self.storage, step, attempt_id, world_size=world_size, rank=rank)

    def delete(self, step: int) -> None:
        """Delete ``step``: its manifest first, so it stops being complete at once, then every
        object under its prefix and, in the spread layout, under each spread prefix of the store's
        layout (objects under prefixes of a layout the store is no longer opened with are left to
        ``opd-store gc``, as orphans). A missing step is not an error."""
        prefix = step_dirname(step)
        self.known.forget(step)
        self.storage.delete(f"{prefix}/{MANIFEST_NAME}")
        kill_points.reach("step_delete", step=step)  # test-only (the soak); nothing when not armed
        self.storage.delete_tree(prefix)
        for spread in self.storage.layout.prefix_names():
            self.storage.delete_tree(step_rel(step, spread))

    # -- durability: a committed step of a plain store is durable (Durability's defaults: no
    # background work to flush, close or resume, any save retention accepted) -------------------
    def durable_steps(self) -> list[int]:
        """Complete steps, ascending (committed is durable here)."""
        return [info.step for info in self.checkpoints() if info.status == COMPLETE]

    def latest_durable_step(self) -> int:
        """:meth:`latest_step` (committed is durable here).

        Raises:
            CheckpointNotFoundError: no complete step.
        """
        return self.latest_step()

    def is_durable(self, step: int) -> bool:
        """:meth:`is_complete` (committed is durable here)."""
        return self.is_complete(step)

    def when_durable(self, step: int, hook: DurableHook) -> None:
        """Run ``hook(self)`` now, in the calling thread: a committed step is durable here. Its
        exception propagates to the caller."""
        hook(self)

    def durable_store(self) -> "CheckpointStore":
        """This store: every committed step of a plain store is durable."""
        return self

    def retention_tiers(self, policy: Any) -> list[RetentionTier]:
        """One tier: this store, with ``policy``."""
        return [RetentionTier(self, policy)]


__all__ = ["CheckpointStore"]
