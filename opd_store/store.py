"""``CheckpointStore``: list, read, verify, write and delete checkpoints under one URL.

The rule everything here is built on: **a checkpoint exists exactly when its manifest does**, and
it is *complete* when that manifest parses and every object it lists exists with its recorded size.
Payloads without a manifest, attempt leftovers, zero-byte or short objects and unparsable manifests
never count. Local, memory, S3 and GCS stores answer the same way because every answer comes from
the backend as it is now (see :mod:`opd_store.storage.base`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import io
import logging
import os
from typing import Any, BinaryIO

from .checksum import crc32c_hex
from .errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    IncompleteCheckpointError,
    IntegrityError,
    ManifestError,
    UnsupportedBackendError,
)
from .layout import (
    LEGACY_MARKER,
    MANIFEST_NAME,
    attempt_created_secs,
    check_payload_name,
    is_attempt_id,
    new_attempt_id,
    parse_step_dirname,
    step_dirname,
)
from .manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from .storage import Storage, open_storage
from .transaction import PartTransaction, Transaction

logger = logging.getLogger("opd_store.store")

COMPLETE = "complete"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"
LEGACY = "legacy"
UNCOMMITTED = "uncommitted"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One defect found in a checkpoint.

    Attributes:
        name: payload name (or ``manifest.json``).
        kind: ``missing``, ``size``, ``checksum``, ``manifest`` or ``legacy``.
        detail: human-readable description with expected and actual values.
    """

    name: str
    kind: str
    detail: str


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`CheckpointStore.verify`.

    Attributes:
        url: checkpoint URL.
        step: its step.
        status: ``complete``, ``incomplete``, ``corrupt``, ``legacy`` or ``uncommitted``.
        deep: whether checksums were recomputed.
        checked_objects: number of payload objects examined.
        problems: every defect found (empty when ``ok``).
    """

    url: str
    step: int
    status: str
    deep: bool
    checked_objects: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        """True when the checkpoint is complete and no problem was found."""
        return self.status in (COMPLETE, LEGACY) and not self.problems


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One step of a store as seen by :meth:`CheckpointStore.checkpoints`.

    Attributes:
        step: the step.
        url: checkpoint URL (its step prefix).
        status: ``complete``, ``incomplete``, ``corrupt``, ``legacy`` or ``uncommitted``.
        manifest: the parsed manifest, when there is a readable one.
        created_at: commit time (UTC) from the manifest, else ``None``.
        total_size_bytes: bytes of every object under the step prefix.
        attempts: attempt ids present under the step (committed and leftover).
        problems: why the step is not complete.
    """

    step: int
    url: str
    status: str
    manifest: Manifest | None
    created_at: _dt.datetime | None
    total_size_bytes: int
    attempts: tuple[str, ...]
    problems: tuple[Problem, ...]

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.manifest.metadata) if self.manifest else {}


class CheckpointStore:
    """Checkpoints under one URL, committed by write-then-commit-manifest.

    Args:
        url (str | os.PathLike): a local path or ``file://``, ``memory://``, ``s3://``, ``gs://`` or
            other fsspec URL of the store root.
        storage_options (dict | None): fsspec filesystem options (``endpoint_url``, credentials,
            ...), used by every request the store makes, listings and existence checks included.
        allow_check_then_put (bool): on a backend without a create-only write, commit with an
            ``exists`` check followed by a plain put. Two writers racing inside that window can
            both "commit" and the later manifest wins; off by default.

    Raises:
        ValueError: empty or chained URL.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        allow_check_then_put: bool = False,
    ) -> None:
        self.storage = open_storage(url, storage_options, allow_check_then_put=allow_check_then_put)
        self.storage_options = dict(storage_options or {})

    @classmethod
    def from_storage(cls, storage: Storage) -> "CheckpointStore":
        """A store over an already built :class:`~opd_store.storage.Storage` (tests wrap one)."""
        store = cls.__new__(cls)
        store.storage = storage
        store.storage_options = {}
        return store

    @property
    def url(self) -> str:
        """The store root (a plain absolute path for local stores)."""
        return self.storage.url_root

    def step_url(self, step: int) -> str:
        """URL of ``step``'s checkpoint (its step prefix)."""
        return self.storage.url(step_dirname(step))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def check_reachable(self) -> None:
        """Fail fast, before any work, when the store cannot be used.

        Raises:
            StoreUnreachableError: no such bucket, missing credentials, no connection, or a local
                root that is not a writable directory; the message names the URL and the cause.
        """
        self.storage.check_reachable()

    # -- listing ---------------------------------------------------------------------------
    def _step_prefixes(self) -> list[int]:
        dirs, _files = self.storage.list_children("")
        return sorted(step for step in (parse_step_dirname(name) for name in dirs) if step is not None)

    def steps(self) -> list[int]:
        """Steps whose manifest object exists, ascending (numeric order).

        One recursive listing of the store (paginated by the backend, no request per step). A
        listed step may still be incomplete or corrupt: use :meth:`checkpoints` or
        :meth:`is_complete` to know.
        """
        tree = self.storage.list_tree("")
        steps = set()
        for path in tree:
            head, _, tail = path.partition("/")
            if tail == MANIFEST_NAME:
                step = parse_step_dirname(head)
                if step is not None:
                    steps.add(step)
        return sorted(steps)

    def checkpoints(self) -> list["CheckpointInfo"]:
        """Every step prefix with its status, ascending.

        One recursive listing plus one manifest read per committed step. Uncommitted prefixes
        (a save in progress, or a killed one) appear with status ``uncommitted``.
        """
        by_step = objects_by_step(self.storage.list_tree(""))
        return [self._info(step, objects) for step, objects in sorted(by_step.items())]

    def _info(self, step: int, objects: dict[str, int]) -> CheckpointInfo:
        attempts = tuple(sorted({p.split("/", 1)[0] for p in objects if is_attempt_id(p.split("/", 1)[0])}))
        status, manifest, problems = self._status(step, objects)
        return CheckpointInfo(
            step=step,
            url=self.step_url(step),
            status=status,
            manifest=manifest,
            created_at=manifest.created_at if manifest else None,
            total_size_bytes=sum(objects.values()),
            attempts=attempts,
            problems=tuple(problems),
        )

    # -- completeness ------------------------------------------------------------------------
    def _read_manifest(self, step: int) -> Manifest | None:
        rel = f"{step_dirname(step)}/{MANIFEST_NAME}"
        try:
            data = self.storage.read_bytes(rel, small=True, max_bytes=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return None
        return parse_manifest(data, url=self.storage.url(rel), expected_step=step)

    def _status(
        self, step: int, objects: dict[str, int] | None = None
    ) -> tuple[str, Manifest | None, list[Problem]]:
        """(status, manifest, problems) of one step.

        ``objects`` is the step's listing (relative to the step prefix) when the caller already
        has it; otherwise the committed attempt's prefix is listed (one request).
        """
        try:
            manifest = self._read_manifest(step)
        except ManifestError as exc:
            return CORRUPT, None, [Problem(MANIFEST_NAME, "manifest", str(exc))]
        if manifest is None:
            if objects is not None:
                legacy = LEGACY_MARKER in objects
            else:
                legacy = self.storage.size(f"{step_dirname(step)}/{LEGACY_MARKER}") is not None
            if legacy:
                return LEGACY, None, []
            return UNCOMMITTED, None, [Problem(MANIFEST_NAME, "missing", "no manifest: the step was never committed")]
        if objects is None:
            listed = self.storage.list_tree(f"{step_dirname(step)}/{manifest.attempt_id}")
            objects = {f"{manifest.attempt_id}/{name}": size for name, size in listed.items()}
        problems = []
        for entry in manifest.payloads:
            actual = objects.get(entry.path)
            if actual is None:
                problems.append(Problem(entry.name, "missing", f"{entry.path} is listed in the manifest but absent"))
            elif actual != entry.size_bytes:
                problems.append(
                    Problem(entry.name, "size", f"{entry.path}: expected {entry.size_bytes} bytes, found {actual}")
                )
        return (INCOMPLETE if problems else COMPLETE), manifest, problems

    def is_complete(self, step: int) -> bool:
        """True when ``step`` has a parseable manifest and every object it lists with its size."""
        return self._status(step)[0] == COMPLETE

    def status(self, step: int) -> str:
        """``complete``, ``incomplete``, ``corrupt``, ``legacy`` or ``uncommitted`` (nothing there too)."""
        return self._status(step)[0]

    def latest_step(self, *, include_legacy: bool = False) -> int:
        """The newest complete step.

        Lists the step prefixes (one delimiter listing), then checks candidates newest first: one
        manifest read and one listing of its attempt prefix each. Skipped candidates (uncommitted,
        incomplete, corrupt) are logged as warnings naming the step and the reason.

        Args:
            include_legacy (bool): also accept seed-layout checkpoints (``COMPLETE`` marker, no
                manifest), as the OPD layer does.

        Raises:
            CheckpointNotFoundError: no complete step in the store.
        """
        skipped: list[str] = []
        for step in reversed(self._step_prefixes()):
            status, _manifest, problems = self._status(step)
            if status == COMPLETE or (include_legacy and status == LEGACY):
                for line in skipped:
                    logger.warning("latest_step(%s): skipped %s", self.url, line)
                return step
            skipped.append(f"step {step} ({status}: {'; '.join(p.detail for p in problems) or 'legacy layout'})")
        raise CheckpointNotFoundError(
            f"no complete checkpoint in {self.url}" + (f" (skipped: {', '.join(skipped)})" if skipped else "")
        )

    def manifest(self, step: int) -> Manifest:
        """The parsed manifest of ``step``.

        Raises:
            CheckpointNotFoundError: ``step`` has no manifest.
            ManifestError: the manifest does not parse or names another step.
        """
        manifest = self._read_manifest(step)
        if manifest is None:
            raise CheckpointNotFoundError(f"no manifest for step {step} at {self.step_url(step)}")
        return manifest

    # -- payload reads -----------------------------------------------------------------------
    def names(self, step: int) -> list[str]:
        """Payload names of ``step`` (from its manifest, or from the directory of a legacy step).

        Raises:
            CheckpointNotFoundError: neither a manifest nor a legacy checkpoint at ``step``.
            ManifestError: unreadable manifest.
        """
        manifest = self._read_manifest(step)
        if manifest is not None:
            return [entry.name for entry in manifest.payloads]
        objects = self.storage.list_tree(step_dirname(step))
        if LEGACY_MARKER in objects:
            return sorted(name for name in objects if name != LEGACY_MARKER)
        raise CheckpointNotFoundError(f"no checkpoint at {self.step_url(step)} (no manifest, no {LEGACY_MARKER})")

    def read(self, step: int, name: str, *, manifest: Manifest | None = None) -> bytes:
        """Bytes of the payload ``name`` of ``step``, checked against the manifest's size and CRC32C.

        Legacy (seed layout) steps have no manifest: their files are read unchecked.

        Args:
            step (int): the step.
            name (str): the payload's relative name.
            manifest (Manifest | None): the step's manifest when the caller already fetched it
                (saves one request per payload when reading several).

        Raises:
            CheckpointNotFoundError: no such step or no such payload name.
            IncompleteCheckpointError: the manifest lists the object but it is absent.
            IntegrityError: size or checksum differ (the message names URL, step, object, expected
                and actual values).
            ManifestError: unreadable manifest.
            ValueError: a legacy step was asked for a name that is not a safe relative name
                (``../``, absolute, another protocol; see :func:`opd_store.layout.check_payload_name`).
        """
        with self.open(step, name, manifest=manifest) as reader:
            return reader.read()

    def _read_legacy(self, step: int, name: str) -> bytes:
        check_payload_name(name)  # no manifest to look the name up in: never leave the step prefix
        prefix = step_dirname(step)
        if self.storage.size(f"{prefix}/{LEGACY_MARKER}") is None:
            raise CheckpointNotFoundError(f"no checkpoint at {self.step_url(step)} (no manifest, no {LEGACY_MARKER})")
        try:
            return self.storage.read_bytes(f"{prefix}/{name}")
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"legacy step {step} at {self.step_url(step)} has no file {name!r}") from exc

    def open(self, step: int, name: str, *, manifest: Manifest | None = None) -> BinaryIO:
        """A seekable binary reader over the verified bytes of a payload (see :meth:`read`).

        The whole object is checked against the manifest before the reader is returned, which is
        what ``torch.load`` needs (it seeks around the zip archive). Remote objects are fetched
        whole in one request (ranged reads through s3fs fetched 2.7x the bytes, field notes) and
        served from memory; local files are checksummed through a read-only memory map and the
        file itself is returned, so a load reads the page cache once more instead of copying.
        Payload objects are never rewritten after their commit (each attempt has its own prefix).

        Raises:
            CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError, ManifestError:
                as :meth:`read`.
        """
        if manifest is None:
            manifest = self._read_manifest(step)
            if manifest is None:
                return io.BytesIO(self._read_legacy(step, name))
        elif manifest.step != step:
            raise ValueError(f"the manifest given for step {step} is the manifest of step {manifest.step}")
        entry = manifest.entry(name)
        if entry is None:
            raise CheckpointNotFoundError(f"step {step} at {self.step_url(step)} has no payload {name!r}")
        rel = f"{step_dirname(step)}/{entry.path}"
        url = self.storage.url(rel)
        try:
            reader, size_bytes, crc = self.storage.open_checked(rel)
        except FileNotFoundError as exc:
            raise IncompleteCheckpointError(f"step {step}: payload {name!r} listed in the manifest is missing at {url}") from exc
        if size_bytes != entry.size_bytes or crc != entry.crc32c:
            reader.close()
            what = (f"has {size_bytes} bytes, manifest says {entry.size_bytes}" if size_bytes != entry.size_bytes
                    else f"has crc32c {crc}, manifest says {entry.crc32c}")
            raise IntegrityError(f"step {step}: payload {name!r} at {url} {what}")
        return reader

    def verify(self, step: int, *, deep: bool = False) -> VerifyReport:
        """Check one step: sizes of every listed object, and with ``deep`` their CRC32C too."""
        status, manifest, problems = self._status(step)
        checked = len(manifest.payloads) if manifest else 0
        if deep and manifest is not None:
            prefix = step_dirname(step)
            for entry in manifest.payloads:
                if any(p.name == entry.name for p in problems):
                    continue
                rel = f"{prefix}/{entry.path}"
                try:
                    actual = crc32c_hex(self.storage.read_bytes(rel))
                except FileNotFoundError:
                    problems.append(Problem(entry.name, "missing", f"{entry.path} vanished while verifying"))
                    continue
                if actual != entry.crc32c:
                    problems.append(
                        Problem(entry.name, "checksum", f"{entry.path}: expected crc32c {entry.crc32c}, found {actual}")
                    )
            if problems and status == COMPLETE:
                status = CORRUPT
        return VerifyReport(
            url=self.step_url(step), step=step, status=status, deep=deep, checked_objects=checked, problems=tuple(problems)
        )

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
            CommitConflictError: ``step`` already has a manifest or a legacy checkpoint; raised
                before anything is uploaded.
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
        if self.storage.size(f"{prefix}/{LEGACY_MARKER}") is not None:
            raise CommitConflictError(
                f"checkpoint already exists: {self.step_url(step)} (legacy seed-layout checkpoint of step {step})"
            )
        if attempt_id is not None and not is_attempt_id(attempt_id):
            raise ValueError(f"attempt_id {attempt_id!r} is not of the form attempt-YYYYMMDDTHHMMSSZ-<12 hex>")
        return Transaction(
            self.storage,
            step,
            attempt_id or new_attempt_id(),
            world_size=world_size,
            metadata=metadata,
            rank=rank,
        )

    def begin_part(self, step: int, *, attempt_id: str, rank: int, world_size: int) -> PartTransaction:
        """Start one rank's part of a multi-rank save under the committing rank's attempt (issue 7).

        The part writes payloads under ``step-NNNNNN/<attempt_id>/`` and never a manifest; its
        :meth:`~opd_store.transaction.PartTransaction.seal` returns the entries the committing rank
        passes to :meth:`~opd_store.transaction.Transaction.add_entry` before it commits.

        Args:
            step (int): the step being saved (the committing rank's).
            attempt_id (str): the attempt chosen by the committing rank's :meth:`begin`.
            rank (int): this part's rank, ``0 < rank < world_size`` by convention.
            world_size (int): ranks writing the checkpoint.

        Raises:
            CommitConflictError: ``step`` is already committed (nothing is written).
            ValueError: ``attempt_id`` is malformed, or ``rank`` is outside ``[0, world_size)``.
        """
        if attempt_id is None or not is_attempt_id(attempt_id):
            raise ValueError(f"attempt_id {attempt_id!r} is not of the form attempt-YYYYMMDDTHHMMSSZ-<12 hex>")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        if self.storage.size(f"{step_dirname(step)}/{MANIFEST_NAME}") is not None:
            raise CommitConflictError(f"checkpoint already exists: {self.step_url(step)} (step {step} is committed)")
        return PartTransaction(self.storage, step, attempt_id, world_size=world_size, rank=rank)

    def delete(self, step: int) -> None:
        """Delete ``step``: its manifest (or legacy marker) first, so it stops being complete at
        once, then every object under its prefix. A missing step is not an error."""
        prefix = step_dirname(step)
        self.storage.delete(f"{prefix}/{MANIFEST_NAME}")
        self.storage.delete(f"{prefix}/{LEGACY_MARKER}")
        self.storage.delete_tree(prefix)

    def attempt_age_secs(self, attempt_id: str, now_secs: float) -> float | None:
        """Age in seconds of an attempt, from the UTC time in its id."""
        created = attempt_created_secs(attempt_id)
        return None if created is None else now_secs - created


def objects_by_step(tree: dict[str, int]) -> dict[int, dict[str, int]]:
    """Group a recursive listing of the store root (relative path -> size in bytes) by step:
    ``{step: {path under step-NNNNNN/: size_bytes}}``; objects outside step prefixes are left out.
    """
    by_step: dict[int, dict[str, int]] = {}
    for path, size in tree.items():
        head, _, tail = path.partition("/")
        step = parse_step_dirname(head)
        if step is not None and tail:
            by_step.setdefault(step, {})[tail] = size
    return by_step


def as_store(
    target: "CheckpointStore | str | os.PathLike", storage_options: dict[str, Any] | None = None
) -> CheckpointStore:
    """Return ``target`` if it is a store, else open a store at that path or URL."""
    if isinstance(target, CheckpointStore):
        return target
    return CheckpointStore(target, storage_options=storage_options)


def split_checkpoint_url(
    checkpoint: str | os.PathLike, storage_options: dict[str, Any] | None = None
) -> tuple[CheckpointStore, int]:
    """Split a checkpoint URL (``.../step-000042``) into its store and step.

    Raises:
        ValueError: the last component is not a canonical ``step-NNNNNN`` name.
    """
    text = os.fspath(checkpoint).rstrip("/")
    if "://" not in text:
        text = os.path.abspath(text)  # a local path, relative or at "/", as the seed's Path allowed
    parent, _, last = text.rpartition("/")
    step = parse_step_dirname(last)
    if step is None:
        raise ValueError(f"not a checkpoint URL (expected .../step-NNNNNN): {text}")
    if parent.endswith(":/") or parent.endswith(":"):
        raise ValueError(f"not a checkpoint URL (no store root): {text}")
    return CheckpointStore(parent or "/", storage_options=storage_options), step


__all__ = [
    "COMPLETE",
    "CORRUPT",
    "INCOMPLETE",
    "LEGACY",
    "UNCOMMITTED",
    "CheckpointInfo",
    "CheckpointStore",
    "Problem",
    "VerifyReport",
    "as_store",
    "objects_by_step",
    "split_checkpoint_url",
]
