"""Loading OPD checkpoints: one rank's exact next-update state, and finding the latest one.

The load order and what is validated: docs/resume.md ("What is validated on load").
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import yaml

from ..errors import CheckpointNotFoundError
from ..store import BaseStore, LegacyReader, ReadableStore, as_store, refuse_damaged_step_ahead
from ._distributed import check_group_args, current_group, decide_on_rank0, load_collective
from ._elastic import ElasticResume
from ._names import (
    CONFIG_YAML,
    PAYLOAD_KEYS,
    RNG_SINGLE,
    SCHEMA_SHARDED,
    SCHEMA_V1,
    SCHEMAS,
    TRAINING_STATE,
    VALIDATION_KEYS,
    CheckpointRef,
    check_pickle_opt_in,
    check_rank,
    open_checkpoint,
    rng_payload_name,
)
from ._resume import validate_resume
from ._rng import restore_rng_state
from ._safe_load import load_payload


def read_config_dict(store: ReadableStore, step: int) -> dict | None:
    """The step's ``config.yaml`` as a dict (``None`` when absent or not a mapping)."""
    try:
        data = store.read(step, CONFIG_YAML)
    except CheckpointNotFoundError:
        return None
    parsed = yaml.safe_load(data.decode("utf-8"))
    return parsed if isinstance(parsed, dict) else None


def check_teacher_count(trainer: Mapping[str, Any], teacher: Mapping[str, Any], url: str) -> None:
    """The saved teacher's ``update_count``, when present, equals ``successful_updates`` (seed).

    Raises:
        ValueError: it differs (naming ``url`` and both counts).
    """
    if teacher.get("update_count") not in (None, trainer["successful_updates"]):
        raise ValueError(
            f"restored teacher update count differs from OPD state at {url} "
            f"({teacher.get('update_count')!r} != {trainer['successful_updates']!r})"
        )


def finish_resume(*, trainer: dict, teacher: dict, scheduler: Any, scheduler_state: Any,
                  teacher_state_loader: Callable[[dict], None], decision: Any, elastic: ElasticResume,
                  rng_state: Any) -> None:
    """The last restores once every check passed: scheduler, teacher, a changed rollout limit's
    validation baseline (seed), the elastic report, and this rank's RNG state last.
    """
    scheduler.load_state_dict(scheduler_state)
    teacher_state_loader(teacher)
    if decision.rollout_limit_changed:
        for key in VALIDATION_KEYS:
            trainer.pop(key, None)
        trainer["rollout_limit_changed_at_update"] = trainer["successful_updates"]
    elastic.report()
    restore_rng_state(rng_state if rng_state is not None else elastic.derived_rng())


def load_opd_checkpoint(
    checkpoint: CheckpointRef,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    config: Any,
    provenance_fingerprints: dict[str, str],
    teacher_state_loader: Callable[[dict], None],
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> dict:
    """Restore the exact next-update state of one rank from an OPD checkpoint.

    Every check (completeness, schema, :func:`~opd_store.opd._resume.validate_resume`, the teacher's
    ``update_count``) runs before the first restore, so a refused resume changes nothing; the RNG is
    restored last (docs/resume.md, "What is validated on load"). Payloads load on the CPU.

    Args:
        checkpoint (str | os.PathLike | tuple[ReadableStore, int]): step path/URL or ``(store, step)``;
            a legacy step works too.
        optimizer (torch.optim.Optimizer): built over the same parameters as when saved.
        scheduler (Any): LR scheduler with ``load_state_dict``.
        config (Any): the current config (``fingerprint()``, ``as_dict()``, ``checkpoint.resume_mode``).
        provenance_fingerprints (dict[str, str]): this run's provenance.
        teacher_state_loader (Callable[[dict], None]): receives the saved teacher state.
        rank (int | None): ``0 <= rank < world_size``; default the process group's, or 0.
        world_size (int | None): must equal the saved one unless ``elastic``; default the group's, or 1.
        storage_options (dict | None): fsspec options for a URL.
        allow_pickle (bool): load old pickle-only payloads; local directories only.

    Returns:
        dict: the trainer state (tensors on the CPU).

    Rank obligations: under a process group of more than one rank every rank calls this (a
    collective; a failure on any rank raises on every rank) and gets its own RNG state back.

    Raises:
        ValueError: sharded checkpoint, unknown schema, malformed training state, teacher count other
            than ``successful_updates``, or ``rank`` out of range.
        IncompleteCheckpointError: (a ``ValueError``) the checkpoint is not complete.
        ResumeMismatchError: (a ``ValueError``) the resume is refused, naming every differing field.
        UnsafeCheckpointError: (a ``ValueError``) a payload needs pickle and ``allow_pickle`` is off,
            or ``allow_pickle`` was asked for a non-local store.
        IntegrityError: a payload's bytes differ from its manifest entry.
        CheckpointNotFoundError: (a ``FileNotFoundError``) a payload (this rank's RNG file) is missing.
        DistributedLoadError: (an ``OSError``) some ranks failed; raised on every rank, naming each.
    """
    load = functools.partial(
        _load_one, checkpoint, optimizer=optimizer, scheduler=scheduler, config=config,
        provenance_fingerprints=provenance_fingerprints, teacher_state_loader=teacher_state_loader,
        storage_options=storage_options, allow_pickle=allow_pickle,
    )
    group = current_group() if _process_group_size() > 1 else None
    if group is not None:

        def load_this_rank() -> dict:
            check_group_args(group, rank=rank, world_size=world_size)  # inside the collective: no rank waits alone
            return load(rank=group.rank, world_size=group.world_size)

        return load_collective(group, load_this_rank)
    return load(rank=0 if rank is None else rank, world_size=1 if world_size is None else world_size)


def _process_group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _load_one(
    checkpoint: CheckpointRef, *, optimizer, scheduler, config, provenance_fingerprints, teacher_state_loader,
    rank: int, world_size: int, storage_options, allow_pickle: bool,
) -> dict:
    check_rank(rank, world_size)
    store, step, report = open_checkpoint(checkpoint, storage_options)
    url = report.url
    check_pickle_opt_in(store, allow_pickle, url)

    # store.open: a local payload is read once by torch.load from the verified file (no bytes copy
    # of the whole payload beside the loaded tensors); a remote one is one GET held in memory.
    try:
        handle = store.open(step, TRAINING_STATE)
    except CheckpointNotFoundError as exc:
        if _metadata_of(store, step).get("opd_schema") == SCHEMA_SHARDED:
            raise ValueError(f"{url} is a sharded OPD checkpoint (schema {SCHEMA_SHARDED!r}, no {TRAINING_STATE}): "
                             "load it with load_sharded_opd_checkpoint") from exc
        raise
    with handle:
        payload = load_payload(handle, source=f"{url}/{TRAINING_STATE}", allow_pickle=allow_pickle)
    schema = payload.get("schema") if isinstance(payload, dict) else None
    if schema not in SCHEMAS:
        raise ValueError(f"unsupported OPD checkpoint schema {schema!r} at {url} (expected one of {list(SCHEMAS)})")
    absent = [key for key in PAYLOAD_KEYS if key not in payload]
    if absent or not isinstance(payload["trainer"], dict) or not isinstance(payload["teacher"], Mapping):
        raise ValueError(
            f"malformed OPD training state at {url}: missing {absent}, or trainer/teacher not mappings"
        )
    saved_world_size = payload.get("world_size")
    if (schema == SCHEMA_V1) != (saved_world_size == 1):
        raise ValueError(f"{url}: schema {schema} does not match its saved world size {saved_world_size!r}")

    saved_fingerprint = payload.get("config_fingerprint")
    # config.yaml is only consulted when the fingerprints differ (validate_resume, rules 2 and 5).
    saved_config = None if saved_fingerprint == config.fingerprint() else read_config_dict(store, step)
    decision = validate_resume(
        checkpoint_url=url,
        saved_config_fingerprint=saved_fingerprint,
        saved_provenance=payload.get("provenance_fingerprints"),
        saved_world_size=saved_world_size,
        saved_config_dict=saved_config,
        config=config,
        provenance_fingerprints=provenance_fingerprints,
        world_size=world_size,
    )

    elastic = ElasticResume(saved_world_size=saved_world_size, world_size=world_size, rank=rank, step=step,
                            config_fingerprint=str(saved_fingerprint))
    rng_state = None
    if elastic.restores_own_rng:  # else (an elastic resume's new rank) derived from the checkpoint
        rng_name = RNG_SINGLE if schema == SCHEMA_V1 else rng_payload_name(rank, saved_world_size)
        try:
            rng_bytes = store.read(step, rng_name)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{url}: step {step} has no RNG state of rank {rank} ({rng_name}); it cannot resume that rank"
            ) from exc
        rng_state = load_payload(rng_bytes, source=f"{url}/{rng_name}", allow_pickle=allow_pickle)

    state = payload["trainer"]
    check_teacher_count(state, payload["teacher"], url)

    optimizer.load_state_dict(payload["optimizer"])
    finish_resume(trainer=state, teacher=payload["teacher"], scheduler=scheduler, scheduler_state=payload["scheduler"],
                  teacher_state_loader=teacher_state_loader, decision=decision, elastic=elastic, rng_state=rng_state)
    return state


def _metadata_of(store: ReadableStore, step: int) -> dict:
    """The step's manifest metadata, empty when it has no readable manifest (a legacy step)."""
    try:
        return dict(store.manifest(step).metadata)
    except (FileNotFoundError, ValueError):
        return {}


def latest_complete_checkpoint(
    checkpoints_dir: str | os.PathLike | BaseStore, *, storage_options: dict[str, Any] | None = None
) -> str:
    """The newest complete checkpoint (manifest-committed or legacy) under a directory.

    Uncommitted steps are skipped (field notes: a half-written newest checkpoint must not win); a
    damaged committed step ahead is refused (docs/resume.md, "A damaged checkpoint"). Only manifests
    and listings are read; the load checks payload bytes.

    Args:
        checkpoints_dir (str | os.PathLike | BaseStore): local path, fsspec URL or store.
        storage_options (dict | None): fsspec options for a URL.

    Returns:
        str: the checkpoint's URL (a plain absolute path for a local store).

    Rank obligations: under a process group every rank calls this; rank 0 decides and broadcasts.

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) no complete and no damaged checkpoint.
        IntegrityError: (a ``ValueError``) a committed step newer than the newest complete one is
            damaged: one line naming the step, the file and the remedy.
    """
    reader = LegacyReader(as_store(checkpoints_dir, storage_options))

    def decide() -> str:
        try:
            step = reader.latest_step()
        except CheckpointNotFoundError as exc:
            refuse_damaged_step_ahead(reader, 0, None, "starting from scratch", shallow=True)
            raise CheckpointNotFoundError(f"in-place OPD resume has no complete checkpoint: {exc}") from exc
        refuse_damaged_step_ahead(reader, step, None, f"resuming from step {step}", shallow=True)
        return reader.step_url(step)

    group = current_group()
    return decide() if group is None else decide_on_rank0(group, decide)


__all__ = ["latest_complete_checkpoint", "load_opd_checkpoint"]
