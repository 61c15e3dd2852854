"""Loading OPD checkpoints: the exact next-update state of one rank, and finding the latest one.

The load order (seed, with every check moved before the first restore so a refused resume
changes nothing) is documented on :func:`load_opd_checkpoint`; the resume modes are decided by
:mod:`opd_store.opd._resume`. Adapter weights and the processor load through
:mod:`opd_store.opd._adapter`.
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
    """The step's ``config.yaml`` as a dict (``None`` when absent or not a mapping): consulted
    only when the config fingerprints differ (:func:`~opd_store.opd._resume.validate_resume`)."""
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
    """The last restores of a resume, once every check passed and the model and optimizer are
    restored: the scheduler, the teacher, a changed rollout limit's new validation baseline (seed:
    the validation keys dropped from ``trainer``, ``rollout_limit_changed_at_update`` set), the
    elastic report, and this rank's RNG state last (``rng_state``, or one derived from the
    checkpoint for a rank the saved run did not have)."""
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

    Every check runs before the first restore, so a refused resume changes nothing (the seed's
    order otherwise): completeness, schema, the resume mode's validation
    (:func:`~opd_store.opd._resume.validate_resume`, docs/resume.md), the teacher's
    ``update_count``; then optimizer, scheduler, teacher and this rank's RNG state last, so nothing
    that runs during the restore moves the generators afterwards (field notes). Payloads load on
    the CPU; ``Optimizer.load_state_dict`` moves the state to each parameter's device and dtype.

    Rank obligations: every rank calls this with its own ``rank`` and the same ``world_size`` and
    gets its own RNG state back; under a process group of more than one rank both default to the
    group's and the load is a collective (a failure on any rank raises on every rank).

    Args:
        checkpoint (str | os.PathLike | tuple[ReadableStore, int]): the step prefix's path or
            URL, or ``(store, step)``; a legacy step (the seed's own directory) works too.
        optimizer (torch.optim.Optimizer): built over the same parameters as when saved.
        scheduler (Any): LR scheduler with ``load_state_dict``.
        config (Any): the current config (``fingerprint()``, ``as_dict()``, optional
            ``checkpoint.resume_mode`` and execution-only markings).
        provenance_fingerprints (dict[str, str]): this run's provenance.
        teacher_state_loader (Callable[[dict], None]): receives the saved teacher state.
        rank (int | None): this process's rank, ``0 <= rank < world_size``; default the process
            group's, or 0 without one.
        world_size (int | None): this run's world size; must equal the saved one (except under
            ``elastic``); default the process group's, or 1 without one.
        storage_options (dict | None): fsspec options for a URL.
        allow_pickle (bool): opt-in to load old pickle-only payloads with plain pickle; honoured
            only for local directories (a bucket checkpoint never runs code on load).

    Returns:
        dict: the trainer state (tensors on the CPU; under ``rollout_limit_change`` with a changed
        limit, without the validation keys: docs/resume.md).

    Raises:
        ValueError: the checkpoint is sharded (load it with ``load_sharded_opd_checkpoint``), is
            incomplete (:class:`~opd_store.errors.IncompleteCheckpointError`, naming its URL), has
            an unknown schema, a malformed training state or a teacher update count other than
            ``successful_updates``, or ``rank`` is out of range.
        opd_store.errors.ResumeMismatchError: (a ``ValueError``) the resume is refused, naming every
            differing field or both world sizes (the same on every rank).
        opd_store.errors.UnsafeCheckpointError: (a ``ValueError``) a payload needs plain pickle and
            ``allow_pickle`` is off, or ``allow_pickle`` was asked for a non-local store.
        opd_store.errors.IntegrityError: a payload's bytes differ from its manifest entry.
        FileNotFoundError: a payload (such as this rank's RNG file) is missing.
        opd_store.errors.DistributedLoadError: (an ``OSError``) ranks of a process group failed
            differently, or some did not; raised on every rank, naming each failing rank.
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

    Steps are ordered numerically. Uncommitted steps (a save that never committed) are skipped and
    logged, never chosen (field notes: a half-written newest checkpoint must not win). A committed
    step newer than the one found that is damaged (a payload missing or short, an unreadable
    manifest) is in the way of the run resumed from it, which would save that step again: it is
    refused with the remedy, as when no complete step is left beside a damaged one (a caller
    starting from scratch on ``FileNotFoundError`` would hit it too). The rule is
    :mod:`opd_store.store._resume_guard`'s (docs/resume.md, "A damaged checkpoint"). Only the
    manifests and listings are read: a flipped byte of the step returned is found by the load,
    which reads each payload once, checked.

    Args:
        checkpoints_dir (str | os.PathLike | BaseStore): local path, fsspec URL or store.
        storage_options (dict | None): fsspec options for a URL.

    Rank obligations: with a ``torch.distributed`` process group of more than one rank
    initialised, every rank calls this (a collective): rank 0 decides and broadcasts, so every rank
    resumes from the same step even while another writer commits a newer one.

    Returns:
        str: the checkpoint's URL (a plain absolute path for a local store).

    Raises:
        FileNotFoundError: no complete checkpoint and no damaged one
            (:class:`~opd_store.errors.CheckpointNotFoundError`; seed message).
        opd_store.errors.IntegrityError: (a ``ValueError``) a committed step newer than the newest
            complete one (or, without one, any committed step) is damaged: one line naming the
            step, the file and the remedy.
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
