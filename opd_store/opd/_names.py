"""OPD checkpoint names: the payload layout, checkpoint references, and the checks every load shares.

The seed's payload names inside a committed attempt (``adapter/``, ``processor/``, ``rng.pt`` /
``rng-rank-XX.pt``, ``training_state.pt``, ``config.yaml``): docs/resume.md, "What is saved". The
manifest replaces the seed's ``COMPLETE`` marker; the seed's own directories still load through
:class:`~opd_store.store.LegacyReader`. A checkpoint is named by its step prefix's path or URL,
or a ``(store, step)`` pair; a checkpoints directory by a path, URL or store.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Union

from ..errors import IncompleteCheckpointError, UnsafeCheckpointError
from ..format import parse_step_dirname, step_dirname
from ..storage import refuse_mistyped_url
from ..store import UNCOMMITTED, CheckpointStore, LegacyReader, ReadableStore, VerifyReport, remedy, split_checkpoint_url

SCHEMA_V1 = "opd_checkpoint_v1"
SCHEMA_V2 = "opd_checkpoint_v2"
SCHEMAS = (SCHEMA_V1, SCHEMA_V2)
SCHEMA_SHARDED = "opd_sharded_v1"  # opd_store.opd._sharded: DCP files, no training_state.pt
TRAINING_STATE = "training_state.pt"
CONFIG_YAML = "config.yaml"
RNG_SINGLE = "rng.pt"
ADAPTER_DIR = "adapter"
PROCESSOR_DIR = "processor"
REQUIRED_TRAINER_KEYS = ("attempted_updates", "successful_updates", "query_update")
FORBIDDEN_TRAINER_KEYS = ("rollouts", "failure_queue")
VALIDATION_KEYS = ("validation_baseline", "last_validation_artifact", "validation_baseline_step")
PAYLOAD_KEYS = (
    "trainer", "optimizer", "scheduler", "config_fingerprint", "provenance_fingerprints", "world_size", "teacher",
)
PROCESSOR_MARKERS = ("tokenizer_config.json", "preprocessor_config.json", "processor_config.json")

CheckpointRef = Union[str, os.PathLike, "tuple[ReadableStore, int]"]


def rng_payload_name(rank: int, world_size: int) -> str:
    """Payload name of ``rank``'s RNG state: ``rng.pt`` for one rank, else ``rng-rank-XX.pt`` (seed)."""
    return RNG_SINGLE if world_size == 1 else f"rng-rank-{rank:02d}.pt"


_RNG_PART = re.compile(r"rng-rank-(\d+)\.pt")


def payload_rank(name: str) -> int | None:
    """The rank whose own file payload ``name`` is (``rng-rank-XX.pt``; a sharded checkpoint's
    ``__<rank>_<n>.distcp``, :func:`opd_store.dcp.writer_rank`), ``None`` for a shared payload."""
    part = _RNG_PART.fullmatch(name)
    if part is not None:
        return int(part.group(1))
    from ..dcp import writer_rank  # torch.distributed.checkpoint: imported by the sharded path only

    return writer_rank(name)


def resolve_checkpoint(
    checkpoint: CheckpointRef, storage_options: dict[str, Any] | None = None
) -> tuple[ReadableStore, int]:
    """Turn a checkpoint reference into ``(store, step)``.

    Args:
        checkpoint (str | os.PathLike | tuple[ReadableStore, int]): the step prefix's path or URL,
            or a store and a step.
        storage_options (dict | None): fsspec options for a URL (ignored for a store).

    Raises:
        ValueError: the path does not end in ``step-NNNNNN``, or the step is not a non-negative int.
        TypeError: a bare store (it names no step).
    """
    if isinstance(checkpoint, tuple) and len(checkpoint) == 2 and isinstance(checkpoint[0], ReadableStore):
        store, step = checkpoint
        step_dirname(step)  # validates
        return store, step
    if isinstance(checkpoint, ReadableStore):
        raise TypeError("a store names no checkpoint: pass (store, step) or the step's URL")
    text = os.fspath(checkpoint)
    if "://" not in text:
        refuse_mistyped_url(text)
        # A local path: made absolute first, so a bare "step-000042" (in the working directory)
        # names its parent too (split_checkpoint_url refuses a path without a parent).
        path = Path(os.path.abspath(text))
        step = parse_step_dirname(path.name)
        if step is None:
            raise ValueError(f"not a checkpoint path (expected .../step-NNNNNN): {text}")
        return CheckpointStore(str(path.parent), storage_options=storage_options), step
    return split_checkpoint_url(checkpoint, storage_options)


def require_complete(store: ReadableStore, step: int) -> VerifyReport:
    """The step's report (sizes checked), or raise when it is not complete.

    Raises:
        IncompleteCheckpointError: naming the URL, the status, every problem and, for a damaged
            committed step, the remedy (docs/resume.md, "A damaged checkpoint").
    """
    report = store.verify(step)
    if not report.ok:
        reasons = "; ".join(problem.detail for problem in report.problems) or report.status
        fix = "" if report.status == UNCOMMITTED else f"; the step is damaged: {remedy(store.url, step)}"
        raise IncompleteCheckpointError(f"OPD checkpoint is incomplete: {report.url} (step {step} {report.status}: "
                                        f"{reasons}){fix}")
    return report


def open_checkpoint(
    checkpoint: CheckpointRef, storage_options: dict[str, Any] | None = None
) -> tuple[LegacyReader, int, VerifyReport]:
    """A checkpoint reference as a reader of its store that also reads legacy steps, its step and
    its report, once it is complete (:func:`resolve_checkpoint`, :func:`require_complete`).

    Raises:
        ValueError, TypeError: as :func:`resolve_checkpoint`.
        IncompleteCheckpointError: as :func:`require_complete`.
    """
    store, step = resolve_checkpoint(checkpoint, storage_options)
    reader = LegacyReader(store)
    return reader, step, require_complete(reader, step)


def check_pickle_opt_in(store: ReadableStore, allow_pickle: bool, url: str) -> None:
    """Refuse ``allow_pickle`` for a store that is not a local directory (a bucket checkpoint
    never runs code on load).

    Raises:
        UnsafeCheckpointError: ``allow_pickle`` for a remote store.
    """
    if allow_pickle and "://" in store.url:
        raise UnsafeCheckpointError(
            f"{url}: allow_pickle applies only to checkpoints in a local directory; payloads from "
            f"{store.url} are only ever loaded weights-only (a bucket checkpoint never runs code). "
            "Load the old checkpoint from its local directory, or migrate it after re-saving."
        )


def check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def check_rank(rank: Any, world_size: Any) -> None:
    check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


__all__ = [
    "ADAPTER_DIR",
    "CONFIG_YAML",
    "CheckpointRef",
    "FORBIDDEN_TRAINER_KEYS",
    "PAYLOAD_KEYS",
    "PROCESSOR_DIR",
    "PROCESSOR_MARKERS",
    "SCHEMA_SHARDED",
    "REQUIRED_TRAINER_KEYS",
    "RNG_SINGLE",
    "SCHEMAS",
    "SCHEMA_V1",
    "SCHEMA_V2",
    "TRAINING_STATE",
    "VALIDATION_KEYS",
    "check_pickle_opt_in",
    "check_rank",
    "check_world_size",
    "open_checkpoint",
    "payload_rank",
    "require_complete",
    "resolve_checkpoint",
    "rng_payload_name",
]
