"""The API every store offers, in three parts: what readers need, what writers need, and what
*durable* means.

* :class:`ReadableStore`: identity and reads (steps, statuses, manifests, verified payloads). A
  loader takes one.
* :class:`WritableStore`: ``begin``, ``begin_part`` and ``delete``. A save's write stage takes one.
* :class:`Durability`: when a committed step survives losing this machine, the work that gets it
  there (``when_durable``, ``flush``, ``close``) and the plain stores retention runs on.

:class:`BaseStore` is the three together; two classes implement it:
:class:`~opd_store.store._checkpoint_store.CheckpointStore` (checkpoints under one URL) and
:class:`~opd_store.tiered._store.TieredStore` (a local store in front of a bucket store, composed of
two ``CheckpointStore`` objects). The code above the store layer takes the part it uses and never
asks which store it holds.

*Durable* is the one notion that differs: a step of a plain store is durable once its manifest
is committed; a step of a tiered store once it is complete in the bucket. :meth:`Durability.when_durable`
is how the save pipeline runs its after-commit hooks (retention) at the right time and against
the right store: at once on a plain store, after the upload on a tiered one.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

if TYPE_CHECKING:
    from ..format import Manifest
    from ._checkpoint_store import CheckpointStore
    from ._status import CheckpointInfo, VerifyReport

DurableHook = Callable[["CheckpointStore"], object]
"""Work to run once a step is durable: ``hook(durable_store)``, where ``durable_store`` is the plain
store that holds the durable copy (the store itself, or a tiered store's bucket)."""


@dataclasses.dataclass(frozen=True)
class RetentionTier:
    """One plain store a retention or gc pass runs on, with what it must keep.

    Attributes:
        store (CheckpointStore): the tier.
        policy (Any): the :class:`~opd_store.retention._policy.RetentionPolicy` that applies to it.
        not_durable (frozenset[int]): its steps that are not durable yet (never deleted).
    """

    store: "CheckpointStore"
    policy: Any
    not_durable: frozenset = frozenset()


class ReadableStore(abc.ABC):
    """What a reader needs of a store: its identity and its checkpoints, verified on the way out."""

    # -- identity ------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The URL a run is identified by (a plain absolute path for local stores)."""

    @property
    @abc.abstractmethod
    def storage_options(self) -> dict[str, Any]:
        """fsspec options of the store's URL (for opening its checkpoint URLs again)."""

    @abc.abstractmethod
    def step_url(self, step: int) -> str:
        """URL of ``step``'s checkpoint (its step prefix)."""

    @abc.abstractmethod
    def tiers(self) -> list["CheckpointStore"]:
        """The plain stores this store reads from: itself, or a tiered store's local tier and bucket."""

    @abc.abstractmethod
    def check_reachable(self, *, write: bool = True, timeout_secs: float | None = None) -> None:
        """Fail fast, before any work, when the store cannot be used; answers within the bound.

        Args:
            write (bool): prove a save can write (a probe object is created and deleted, a missing
                local root created); ``False`` proves reads only.
            timeout_secs (float | None): the bound in seconds; the store's ``connect_timeout_secs``
                storage option (default 15) when not given.

        Raises:
            StoreUnreachableError: naming the URL, the operation and the cause.
            StoreNotFoundError: a read-only check of a local root that does not exist.
        """

    # -- reads ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def steps(self) -> list[int]:
        """Steps whose manifest exists, ascending."""

    @abc.abstractmethod
    def checkpoints(self) -> list["CheckpointInfo"]:
        """Every step prefix with its status, ascending."""

    @abc.abstractmethod
    def is_complete(self, step: int) -> bool:
        """True when ``step`` is complete."""

    @abc.abstractmethod
    def status(self, step: int) -> str:
        """``complete``, ``incomplete``, ``corrupt`` or ``uncommitted``."""

    @abc.abstractmethod
    def latest_step(self) -> int:
        """The newest complete step.

        Raises:
            CheckpointNotFoundError: no complete step.
        """

    @abc.abstractmethod
    def manifest(self, step: int) -> "Manifest":
        """The parsed manifest of ``step``.

        Raises:
            CheckpointNotFoundError: no manifest.
            ManifestError: an unreadable manifest.
        """

    @abc.abstractmethod
    def names(self, step: int) -> list[str]:
        """Payload names of ``step``."""

    @abc.abstractmethod
    def read(self, step: int, name: str, *, manifest: "Manifest | None" = None) -> bytes:
        """Verified bytes of a payload (size and CRC32C against the manifest)."""

    @abc.abstractmethod
    def open(self, step: int, name: str, *, manifest: "Manifest | None" = None) -> BinaryIO:
        """A seekable reader of the verified bytes of a payload."""

    @abc.abstractmethod
    def verify(self, step: int, *, deep: bool = False,
               keep: Callable[[str, BinaryIO], None] | None = None) -> "VerifyReport":
        """Check one step's objects (sizes; with ``deep`` their CRC32C too, each payload read once).

        Args:
            step (int): the step.
            deep (bool): read every payload and check its CRC32C.
            keep (Callable[[str, BinaryIO], None] | None): with ``deep``, receives ``(name,
                reader)`` of each payload found intact and owns the reader (closed when ``None``);
                how a resume loads the bytes it verified (:class:`~opd_store.store._verified_copy.VerifiedCopy`).
        """


class WritableStore(abc.ABC):
    """What a writer needs of a store: save attempts, and deleting a step."""

    @abc.abstractmethod
    def begin(self, step: int, *, world_size: int = 1, metadata: dict[str, Any] | None = None,
              attempt_id: str | None = None, rank: int = 0):
        """Start a save attempt of ``step`` (a :class:`~opd_store.commit._transaction.Transaction`)."""

    @abc.abstractmethod
    def begin_part(self, step: int, *, attempt_id: str, rank: int, world_size: int):
        """Start one rank's part of a multi-rank save (a :class:`~opd_store.commit._part_transaction.PartTransaction`)."""

    @abc.abstractmethod
    def delete(self, step: int) -> None:
        """Delete ``step`` (manifest first); a missing step is not an error."""


class Durability(abc.ABC):
    """The durability protocol: when a committed step survives losing this machine, and the work
    that gets it there. The defaults are those of a store whose commits are durable when they
    return and that holds no background work (a plain store)."""

    @abc.abstractmethod
    def durable_steps(self) -> list[int]:
        """Steps complete where they survive losing this machine, ascending."""

    @abc.abstractmethod
    def latest_durable_step(self) -> int:
        """The newest durable step.

        Raises:
            CheckpointNotFoundError: none.
        """

    @abc.abstractmethod
    def is_durable(self, step: int) -> bool:
        """True when ``step`` is durable."""

    @abc.abstractmethod
    def when_durable(self, step: int, hook: DurableHook) -> None:
        """Run ``hook(durable_store)`` once the committed ``step`` is durable.

        A plain store runs it at once, in the calling thread, and lets its exception propagate. A
        tiered store runs it on its upload worker after the step's upload; a failure is raised at
        the next save, ``flush`` or ``close``.
        """

    @abc.abstractmethod
    def durable_store(self) -> "CheckpointStore":
        """The plain store that holds the durable copies (the store itself, or a tiered store's
        bucket): where what must outlive this machine goes, such as the run journal
        (:mod:`opd_store.ledger`). No I/O."""

    @abc.abstractmethod
    def retention_tiers(self, policy: Any) -> list[RetentionTier]:
        """The plain stores a retention or gc pass with ``policy`` runs on, durable tier first: the
        store itself, or a tiered store's bucket (``policy``) and local tier (its own policy,
        every step that is not durable yet protected)."""

    def upload_pending(self) -> list[int]:
        """Resume durability work an earlier process left unfinished; returns the steps queued
        (none by default)."""
        return []

    def flush(self, timeout_secs: float | None = None) -> None:
        """Block until every committed step is durable; raise background failures not raised yet
        (nothing to wait for by default)."""

    def close(self, timeout_secs: float | None = None) -> None:
        """Flush, then release background resources; saves are refused afterwards where the store
        has any (reads keep working). Nothing to release by default."""

    def check_save_retention(self, policy: Any) -> None:
        """Refuse a save's retention policy that would compete with retention the store applies
        itself (any policy is accepted by default).

        Raises:
            ValueError: the store applies its own retention to the durable tier (a tiered store's
                ``bucket_retention``) and ``policy`` would run beside it.
        """

    def __enter__(self) -> "Durability":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


class BaseStore(ReadableStore, WritableStore, Durability):
    """The whole store API (see the module docstring): what ``CheckpointStore`` and ``TieredStore``
    implement, and what the save entry points accept."""


__all__ = ["BaseStore", "DurableHook", "Durability", "ReadableStore", "RetentionTier", "WritableStore"]
