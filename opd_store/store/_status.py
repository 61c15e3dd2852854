"""What a step of a store is: complete, incomplete, corrupt or uncommitted.

The rule everything is built on: **a checkpoint exists exactly when its manifest does**, and it is
*complete* when that manifest parses and every object it lists exists with its recorded size.
Payloads without a manifest, attempt leftovers, zero-byte or short objects and unparsable
manifests never count (a legacy checkpoint, which has no manifest, is read by its own adapter:
:mod:`opd_store.store._legacy`). The functions here decide a step's status from one storage's
answers (:class:`~opd_store.storage.Storage`), which are always fresh, so local, memory, S3 and
GCS stores answer the same way.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
from typing import TYPE_CHECKING, Any, Callable

from ..errors import CheckpointNotFoundError, ManifestError
from ..format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    is_attempt_id,
    key_in_step,
    parse_manifest,
    parse_step_dirname,
    split_key_in_step,
    split_step_rel,
    step_dirname,
    step_rel,
)
from ..storage import is_missing

if TYPE_CHECKING:
    from ..storage import Storage

logger = logging.getLogger("opd_store.store")

COMPLETE = "complete"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"
UNCOMMITTED = "uncommitted"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One defect found in a checkpoint.

    Attributes:
        name: payload name (or ``manifest.json``).
        kind: ``missing``, ``size``, ``checksum`` or ``manifest``.
        detail: human-readable description with expected and actual values.
    """

    name: str
    kind: str
    detail: str


@dataclasses.dataclass(frozen=True)
class StepState:
    """The status of one step with the manifest it was decided from.

    Attributes:
        status: ``complete``, ``incomplete``, ``corrupt`` or ``uncommitted``.
        manifest: the parsed manifest, or ``None`` (absent or unreadable).
        problems: why the step is not complete (empty when it is).
    """

    status: str
    manifest: Manifest | None
    problems: tuple[Problem, ...]


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`CheckpointStore.verify <opd_store.store._checkpoint_store.CheckpointStore.verify>`.

    Attributes:
        url: checkpoint URL.
        step: its step.
        status: ``complete``, ``incomplete``, ``corrupt`` or ``uncommitted`` (``legacy`` from
            the legacy adapter).
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
        """True when no problem was found: the step is complete (or, from the legacy adapter,
        legacy). An uncommitted, incomplete or corrupt step always has a problem."""
        return not self.problems and self.status not in (UNCOMMITTED, INCOMPLETE, CORRUPT)


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One step of a store as seen by :meth:`CheckpointStore.checkpoints <opd_store.store._checkpoint_store.CheckpointStore.checkpoints>`.

    Attributes:
        step: the step.
        url: checkpoint URL (its step prefix).
        status: ``complete``, ``incomplete``, ``corrupt`` or ``uncommitted`` (``legacy`` from
            the legacy adapter).
        manifest: the parsed manifest, when there is a readable one.
        created_at: commit time (UTC) from the manifest, else ``None``.
        total_size_bytes: bytes of every object of the step (under its step prefix and, in the
            spread layout, under each spread prefix).
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


def objects_by_step(tree: dict[str, int]) -> dict[int, dict[str, int]]:
    """Group a recursive listing of the store root (relative path -> size in bytes) by step:
    ``{step: {key in step: size_bytes}}``, the key the path under ``step-NNNNNN/`` or, for an
    object under a spread prefix, ``<prefix>/<path under the step>``
    (:func:`~opd_store.format._layout.split_step_rel`); objects of no step are left out.
    """
    by_step: dict[int, dict[str, int]] = {}
    for path, size in tree.items():
        found = split_step_rel(path)
        if found is not None:
            by_step.setdefault(found[0], {})[found[1]] = size
    return by_step


def step_prefixes(storage: "Storage") -> list[int]:
    """Every step with a prefix under the root, ascending (one delimiter listing)."""
    dirs, _files = storage.list_children("")
    return sorted(step for step in (parse_step_dirname(name) for name in dirs) if step is not None)


def newest_step(storage: "Storage", accept: Callable[[int, StepState], bool]) -> int:
    """The newest step whose state ``accept`` takes (a complete one, for ``latest_step``).

    Lists the step prefixes (one delimiter listing), then decides candidates newest first: one
    manifest read and one listing of its attempt prefix each. Skipped candidates are logged as
    warnings naming the step and the reason (a half-written newest step never wins silently).

    Raises:
        CheckpointNotFoundError: no step is accepted (the message names every step skipped).
    """
    skipped: list[str] = []
    for step in reversed(step_prefixes(storage)):
        state = step_state(storage, step)
        if accept(step, state):
            for line in skipped:
                logger.warning("latest_step(%s): skipped %s", storage.url_root, line)
            return step
        skipped.append(f"step {step} ({state.status}: {'; '.join(p.detail for p in state.problems)})")
    raise CheckpointNotFoundError(
        f"no complete checkpoint in {storage.url_root}" + (f" (skipped: {', '.join(skipped)})" if skipped else "")
    )


def read_manifest(storage: "Storage", step: int) -> Manifest | None:
    """The parsed manifest of ``step``, or ``None`` when there is none (one small read).

    Raises:
        ManifestError: the manifest exists but does not parse, is over the size limit or names
            another step.
    """
    rel = f"{step_dirname(step)}/{MANIFEST_NAME}"
    try:
        data = storage.read_bytes(rel, small=True, max_bytes=MAX_MANIFEST_BYTES)
    except Exception as exc:  # noqa: BLE001 - only a missing manifest is an answer here
        if is_missing(exc):
            return None
        raise
    return parse_manifest(data, url=storage.url(rel), expected_step=step)


def step_state(storage: "Storage", step: int, objects: dict[str, int] | None = None) -> StepState:
    """Decide the status of one step.

    Args:
        storage (Storage): the store's storage.
        step (int): the step.
        objects (dict[str, int] | None): the step's listing (keys as :func:`objects_by_step`
            makes them), when the caller already has it; otherwise the committed attempt's prefix
            is listed (one request; in the spread layout one per prefix the manifest uses).
    """
    try:
        manifest = read_manifest(storage, step)
    except ManifestError as exc:
        return StepState(CORRUPT, None, (Problem(MANIFEST_NAME, "manifest", str(exc)),))
    if manifest is None:
        return StepState(UNCOMMITTED, None, (Problem(MANIFEST_NAME, "missing", "no manifest: the step was never committed"),))
    if objects is None:
        objects = {}
        for prefix in manifest.prefixes() or (None,):
            listed = storage.list_tree(f"{step_rel(step, prefix)}/{manifest.attempt_id}")
            objects.update({key_in_step(prefix, f"{manifest.attempt_id}/{name}"): size for name, size in listed.items()})
    problems = []
    for entry in manifest.payloads:
        actual = objects.get(key_in_step(entry.prefix, entry.path))
        if actual is None:
            problems.append(Problem(entry.name, "missing", f"{entry.path} is listed in the manifest but absent"))
        elif actual != entry.size_bytes:
            problems.append(
                Problem(entry.name, "size", f"{entry.path}: expected {entry.size_bytes} bytes, found {actual}")
            )
    return StepState(INCOMPLETE if problems else COMPLETE, manifest, tuple(problems))


def checkpoint_info(storage: "Storage", step: int, objects: dict[str, int]) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of ``step`` from its listing (paths under the step prefix)."""
    heads = {split_key_in_step(key)[1].split("/", 1)[0] for key in objects}
    attempts = tuple(sorted(head for head in heads if is_attempt_id(head)))
    state = step_state(storage, step, objects)
    return CheckpointInfo(
        step=step,
        url=storage.url(step_dirname(step)),
        status=state.status,
        manifest=state.manifest,
        created_at=state.manifest.created_at if state.manifest else None,
        total_size_bytes=sum(objects.values()),
        attempts=attempts,
        problems=state.problems,
    )


__all__ = [
    "COMPLETE",
    "CORRUPT",
    "INCOMPLETE",
    "UNCOMMITTED",
    "CheckpointInfo",
    "Problem",
    "StepState",
    "VerifyReport",
    "checkpoint_info",
    "newest_step",
    "objects_by_step",
    "read_manifest",
    "step_prefixes",
    "step_state",
]
