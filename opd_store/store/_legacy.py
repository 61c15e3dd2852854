"""The predecessor's layout, "legacy": reading its checkpoints, and importing them into any store.

The seed (the implementation opd_store replaces) saved each checkpoint as a ``step-NNNNNN/``
directory of plain files and, once it was complete, a ``COMPLETE`` marker beside them; no manifest,
no checksums. Such a step is *legacy*. The generic store knows manifests only (to it a legacy step
is ``uncommitted``); this module is the one place that knows the layout, and the entry points that
must see legacy steps ask it explicitly:

* **reads**: :class:`LegacyReader` is a store's read API with its legacy steps (status ``legacy``,
  files read unchecked, a newest step that may be legacy). ``opd-store ls``, ``latest``, ``show``,
  ``verify`` and ``delete``, ``load_opd_checkpoint``, ``load_adapter``,
  ``latest_complete_checkpoint``, the resume guard and retention planning read through it;
  retention only ever deletes complete steps, so a legacy step is reported and kept.
* **writes**: ``CheckpointStore.begin`` refuses a step holding a legacy checkpoint
  (:func:`refuse_legacy_step`: a manifest committed beside its files would hand them to
  retention), a tiered save asks the bucket the same (:func:`holds_legacy_marker`), and gc never
  collects under a legacy step.
* **import**: :func:`import_legacy_steps` copies legacy steps into any store as
  manifest-committed, verified checkpoints (``opd-store migrate``) through the one copy routine
  (:func:`opd_store.store._copy.copy_files`), with the checks of the layer that knows what the
  files are (the OPD layer's: :mod:`opd_store.opd._legacy`).
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Protocol

from ..errors import CheckpointNotFoundError, CommitConflictError, IntegrityError
from ..format import Manifest, check_payload_name, crc32c_hex, step_dirname
from ..storage import is_missing
from ._api import ReadableStore
from ._copy import FileCheck, SourceFile, copy_files
from ._status import (
    COMPLETE,
    UNCOMMITTED,
    CheckpointInfo,
    StepState,
    VerifyReport,
    checkpoint_info,
    newest_step,
    objects_by_step,
)

if TYPE_CHECKING:
    from ..storage import Storage
    from ._api import BaseStore
    from ._checkpoint_store import CheckpointStore

logger = logging.getLogger("opd_store.store")

LEGACY = "legacy"
"""The status of a legacy step (as ``ls`` shows it)."""
LEGACY_MARKER = "COMPLETE"
"""The object the seed wrote last into a complete step's directory."""


def holds_legacy_marker(objects: Mapping[str, int]) -> bool:
    """True when a step prefix's listing (paths under it) holds the legacy marker."""
    return LEGACY_MARKER in objects


def refuse_legacy_step(storage: "Storage", step: int) -> None:
    """Refuse a save of ``step`` where a legacy checkpoint is (one ``size`` request): a manifest
    committed beside its files would make them a complete step's, which retention deletes.

    Raises:
        CommitConflictError: the step prefix holds the legacy marker.
    """
    if _marked(storage, step):
        raise CommitConflictError(
            f"checkpoint already exists: {storage.url(step_dirname(step))} (a legacy checkpoint of step {step})")


def _marked(storage: "Storage", step: int) -> bool:
    """The step prefix holds the legacy marker (one ``size`` request)."""
    return storage.size(f"{step_dirname(step)}/{LEGACY_MARKER}") is not None


def _complete_or_legacy(tier: "CheckpointStore") -> Callable[[int, StepState], bool]:
    def accept(step: int, state: StepState) -> bool:
        return state.status == COMPLETE or (state.status == UNCOMMITTED and _marked(tier.storage, step))

    return accept


class LegacyReader(ReadableStore):
    """The read API of ``store`` with its legacy steps (module docstring).

    A step is legacy when ``store`` has no manifest for it and one of its plain stores
    (:meth:`~opd_store.store._api.ReadableStore.tiers`) holds the marker in the step's prefix.
    Every other answer is the store's own, at the store's cost; a legacy step costs a ``size``
    request per tier where the store found no manifest.

    Args:
        store (ReadableStore): a plain or tiered store.
    """

    def __init__(self, store: ReadableStore) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"LegacyReader({self.store!r})"

    def legacy_tier(self, step: int) -> "CheckpointStore | None":
        """The plain store holding ``step`` as a legacy checkpoint, or ``None`` when it is not one."""
        if self.store.status(step) != UNCOMMITTED:
            return None
        return next((tier for tier in self.store.tiers() if _marked(tier.storage, step)), None)

    def files(self, step: int) -> tuple["CheckpointStore", list[SourceFile]]:
        """The tier holding legacy step ``step`` and its files (the marker left out), by name.

        Raises:
            CheckpointNotFoundError: ``step`` is not a legacy step of the store.
        """
        tier = self.legacy_tier(step)
        if tier is None:
            raise CheckpointNotFoundError(f"no legacy checkpoint at {self.store.step_url(step)} "
                                          f"(no {LEGACY_MARKER} marker without a manifest)")
        prefix = step_dirname(step)
        listed = tier.storage.list_tree(prefix)
        return tier, [SourceFile(name, f"{prefix}/{name}", size) for name, size in sorted(listed.items())
                      if name != LEGACY_MARKER]

    # -- identity ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.store.url

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.store.storage_options

    def step_url(self, step: int) -> str:
        """The store's URL of ``step``; of a legacy step of a tiered store, the tier holding it."""
        tier = self.legacy_tier(step) if len(self.store.tiers()) > 1 else None
        return (tier or self.store).step_url(step)

    def tiers(self) -> list["CheckpointStore"]:
        return self.store.tiers()

    def check_reachable(self, *, write: bool = True, timeout_secs: float | None = None) -> None:
        self.store.check_reachable(write=write, timeout_secs=timeout_secs)

    # -- reads ---------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with a manifest (a legacy step has none)."""
        return self.store.steps()

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every step prefix with its status, legacy steps as ``legacy`` (a plain store: one
        recursive listing decides every step, as ``CheckpointStore.checkpoints``)."""
        tiers = self.store.tiers()
        if tiers == [self.store]:
            storage = tiers[0].storage
            by_step = objects_by_step(storage.list_tree(""))
            infos = [checkpoint_info(storage, step, objects) for step, objects in sorted(by_step.items())]
            legacy = {step for step, objects in by_step.items() if holds_legacy_marker(objects)}
        else:
            infos = self.store.checkpoints()
            legacy = {step for tier in tiers for step, objects in objects_by_step(tier.storage.list_tree("")).items()
                      if holds_legacy_marker(objects)}
        return [dataclasses.replace(info, status=LEGACY, problems=())
                if info.status == UNCOMMITTED and info.step in legacy else info for info in infos]

    def is_complete(self, step: int) -> bool:
        """True when ``step`` is complete (a legacy step never is: it has no manifest)."""
        return self.store.is_complete(step)

    def status(self, step: int) -> str:
        """The store's status of ``step``, or ``legacy``."""
        status = self.store.status(step)
        if status == UNCOMMITTED and any(_marked(tier.storage, step) for tier in self.store.tiers()):
            return LEGACY
        return status

    def latest_step(self) -> int:
        """The newest step that is complete or legacy (the resume rule of the seed and of
        ``latest_complete_checkpoint``); skipped candidates are logged.

        Raises:
            CheckpointNotFoundError: none (naming every step skipped).
        """
        found, reasons = [], []
        for tier in self.store.tiers():
            try:
                found.append(newest_step(tier.storage, _complete_or_legacy(tier)))
            except CheckpointNotFoundError as exc:
                reasons.append(str(exc))
        if not found:
            raise CheckpointNotFoundError(("no complete checkpoint in either tier: " if len(reasons) > 1 else "")
                                          + "; ".join(reasons))
        return max(found)

    def manifest(self, step: int) -> Manifest:
        return self.store.manifest(step)

    def names(self, step: int) -> list[str]:
        """Payload names of ``step``, or the files of a legacy step (the marker left out).

        Raises:
            CheckpointNotFoundError: neither a manifest nor a legacy checkpoint at ``step``.
        """
        try:
            return self.store.names(step)
        except CheckpointNotFoundError:
            if self.legacy_tier(step) is None:
                raise
        return [file.name for file in self.files(step)[1]]

    def read(self, step: int, name: str, *, manifest: Manifest | None = None) -> bytes:
        """Verified bytes of a payload, or a legacy step's file unchecked (see :meth:`open`)."""
        with self.open(step, name, manifest=manifest) as reader:
            return reader.read()

    def open(self, step: int, name: str, *, manifest: Manifest | None = None) -> BinaryIO:
        """The store's verified reader of a payload, or, for a legacy step, a reader of its file
        fetched whole and unchecked: the seed wrote no checksums.

        Raises:
            ValueError: a legacy step was asked for a name that is not a safe relative name
                (``../``, absolute, another protocol; it must never leave the step prefix).
            CheckpointNotFoundError: no such step, payload or legacy file.
            IncompleteCheckpointError, IntegrityError, ManifestError: as the store's ``open``.
        """
        try:
            return self.store.open(step, name, manifest=manifest)
        except CheckpointNotFoundError:
            tier = self.legacy_tier(step) if manifest is None else None
            if tier is None:
                raise
        check_payload_name(name)
        rel = f"{step_dirname(step)}/{name}"
        try:
            return io.BytesIO(tier.storage.read_bytes(rel))
        except Exception as exc:  # noqa: BLE001 - a missing file is named; anything else propagates
            if is_missing(exc):
                raise CheckpointNotFoundError(f"legacy step {step} at {tier.step_url(step)} has no file {name!r}") from exc
            raise

    def verify(self, step: int, *, deep: bool = False, keep=None) -> VerifyReport:
        """The store's report of ``step`` (``keep``: as the store's); a legacy step's reports status
        ``legacy`` and no problem (nothing to check it against)."""
        report = self.store.verify(step, deep=deep, keep=keep)
        if report.status == UNCOMMITTED:
            tier = next((tier for tier in self.store.tiers() if _marked(tier.storage, step)), None)
            if tier is not None:
                return VerifyReport(url=tier.step_url(step), step=step, status=LEGACY, deep=deep,
                                    checked_objects=0, problems=())
        return report


# -- import ------------------------------------------------------------------------------------
class MigrationResult(list):
    """URLs of the checkpoints a migration committed, in step order (a ``list[str]``).

    Attributes:
        skipped (list[str]): URLs of steps already committed at the destination with content
            identical to the source, so not copied again.
    """

    def __init__(self, migrated: Iterable[str] = (), skipped: Iterable[str] = ()) -> None:
        super().__init__(migrated)
        self.skipped: list[str] = list(skipped)

    def __repr__(self) -> str:
        return f"MigrationResult(migrated={list(self)!r}, skipped={self.skipped!r})"


class StepImport(Protocol):
    """One legacy step being imported, as the layer that knows its files checks and records it.

    Attributes:
        files (list[SourceFile]): the files to copy, in order (the ones whose check can refuse
            the step first).
    """

    files: list[SourceFile]

    def check(self, file: SourceFile) -> FileCheck | None:
        """The check of one file as it streams (``None``: none)."""

    def manifest_fields(self) -> tuple[int, dict[str, Any]]:
        """``(world_size, metadata)`` of the step's manifest, once every file passed its check."""


Importer = Callable[[str, list[SourceFile]], StepImport]
"""Makes the :class:`StepImport` of one legacy step from its URL and files; raises to refuse it."""


def import_legacy_steps(src: ReadableStore, dst: "BaseStore", importer: Importer, *,
                        steps: Iterable[int] | None = None) -> MigrationResult:
    """Copy legacy steps of ``src`` into ``dst`` as manifest-committed, verified checkpoints.

    Steps are imported in ascending order, one commit each. Each copy is verified: the
    destination manifest must list exactly the source's files with their sizes and checksums,
    and every payload is read back (a deep verify); a copy that differs is deleted. Idempotent: a
    step already at the destination with identical content is skipped and reported; different
    content is a conflict, never overwritten. A failure stops the import with the earlier steps
    committed (run it again: they are then skipped).

    Args:
        src (ReadableStore): the store holding the legacy steps.
        dst (BaseStore): the destination.
        importer (Importer): the checks and manifest fields of each step (:class:`StepImport`).
        steps (Iterable[int] | None): only these steps; default every legacy step of ``src``
            (a step without the marker is a save that never finished: ignored, as the seed did).

    Returns:
        MigrationResult: URLs committed, and (``skipped``) those already identical at ``dst``.

    Raises:
        CheckpointNotFoundError: a requested step is not a legacy step of ``src``.
        CommitConflictError: the destination step holds different content, or a damaged or
            uncommitted-but-listed checkpoint (naming the differing files); nothing is overwritten.
        IntegrityError: a source file changed while it was copied (nothing committed), or the
            read-back differs from the source (that copy is deleted).
        Exception: whatever ``importer`` or a check raises (nothing of that step is committed).
    """
    reader, target = LegacyReader(src), LegacyReader(dst)
    infos = {info.step: info for info in reader.checkpoints()}
    legacy_steps = [step for step, info in sorted(infos.items()) if info.status == LEGACY]
    if steps is None:
        selected = legacy_steps
        ignored = sorted(set(infos) - set(legacy_steps))
        if ignored:
            logger.info("import of legacy steps from %s: not legacy checkpoints, ignored: %s", src.url, ignored)
    else:
        selected = sorted({int(step) for step in steps})
        absent = [step for step in selected if step not in legacy_steps]
        if absent:
            details = ", ".join(f"{step} ({infos[step].status if step in infos else 'absent'})" for step in absent)
            raise CheckpointNotFoundError(f"{src.url} has no legacy checkpoint for step(s) {details}")
    result = MigrationResult()
    for step in selected:
        report = target.verify(step)
        if report.status == UNCOMMITTED:
            url = _import_step(reader, step, dst, importer)
            logger.info("migrated %s to %s", reader.step_url(step), url)
            result.append(url)
            continue
        if report.status not in (COMPLETE, LEGACY):
            raise CommitConflictError(f"cannot migrate {reader.step_url(step)}: {report.url} holds a {report.status} "
                                      "checkpoint; delete it first")
        differences = _differences(_digests(reader, step), _destination_digests(target, step, report.status))
        if differences:
            raise CommitConflictError(
                f"cannot migrate {reader.step_url(step)}: {report.url} already holds step {step} with "
                f"different content: {'; '.join(differences)}")
        logger.info("legacy import: %s already holds identical step %d; skipped", report.url, step)
        result.skipped.append(report.url)
    return result


def _import_step(reader: LegacyReader, step: int, dst: "BaseStore", importer: Importer) -> str:
    tier, files = reader.files(step)
    step_import = importer(tier.step_url(step), files)
    with dst.begin(step) as txn:
        digests = copy_files(tier.storage, step_import.files, txn, what=f"step {step}: legacy file",
                             check=step_import.check)
        # The manifest's fields come from the files (the OPD layer's training_state.pt), known once
        # they passed their checks; the transaction reads them at its commit.
        txn.world_size, metadata = step_import.manifest_fields()
        txn.metadata.update(metadata)
    url = txn.committed_url
    problems = _differences(digests, _destination_digests(LegacyReader(dst), step, COMPLETE))
    report = dst.verify(step, deep=True)
    problems.extend(f"{problem.name} ({problem.detail})" for problem in report.problems)
    if report.status != COMPLETE and not report.problems:
        problems.append(f"status {report.status}")
    if problems:
        dst.delete(step)
        raise IntegrityError(f"migrated copy {url} differs from its source (deleted): {'; '.join(problems)}")
    return url


def _digests(reader: LegacyReader, step: int) -> dict[str, tuple[int, str]]:
    out = {}
    for name in reader.names(step):
        data = reader.read(step, name)
        out[name] = (len(data), crc32c_hex(data))
    return out


def _destination_digests(reader: LegacyReader, step: int, status: str) -> dict[str, tuple[int, str]]:
    if status == COMPLETE:
        return {entry.name: (entry.size_bytes, entry.crc32c) for entry in reader.manifest(step).payloads}
    return _digests(reader, step)


def _differences(source: dict[str, tuple[int, str]], target: dict[str, tuple[int, str]]) -> list[str]:
    lines = []
    for name in sorted(set(source) | set(target)):
        if name not in target:
            lines.append(f"{name} (absent at destination)")
        elif name not in source:
            lines.append(f"{name} (only at destination)")
        elif source[name] != target[name]:
            lines.append(f"{name} (source {source[name][0]} bytes crc32c {source[name][1]}, destination "
                         f"{target[name][0]} bytes crc32c {target[name][1]})")
    return lines


__all__ = [
    "Importer",
    "LEGACY",
    "LEGACY_MARKER",
    "LegacyReader",
    "MigrationResult",
    "StepImport",
    "holds_legacy_marker",
    "import_legacy_steps",
    "refuse_legacy_step",
]
