"""Saving OPD checkpoints of a sharded (FSDP2) student through DCP: the seed's rules, DCP's layout.

Every rank writes its own shards through :mod:`opd_store.dcp` and one manifest commits them; the
rules are checked on every rank and agreed in one collective before anything is written, so no
rank waits alone. The keys a checkpoint holds: docs/sharded.md, "OPD checkpoints of a sharded
student".
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import dcp
from ..format import torch_save
from ..pipeline import AfterCommit, agree
from ..retention import RetentionPolicy, RunLineage, check_retention
from ..store import BaseStore, as_store
from ._distributed import RankGroup
from ._names import CONFIG_YAML, PROCESSOR_DIR, SCHEMA_SHARDED
from ._rng import capture_rng_state, preserve_global_rng
from ._safe_load import sanitize_state
from ._save import stream_pretrained
from ._snapshot import check_provenance, check_trainer_state, config_record, manifest_metadata

logger = logging.getLogger("opd_store.opd")

MODEL_KEY, OPTIM_KEY, OPD_KEY, RANK_STATE_KEY = "model", "optim", "opd", "rank_state"
TRAINING_STATE_KEY = "training_state"


def rank_state_key(rank: int) -> str:
    """``rank-00003``: the key of a rank's own state under ``rank_state``."""
    return f"rank-{rank:05d}"


def saves_trainable_only(model: torch.nn.Module) -> bool:
    """True when the student has frozen parameters (LoRA): only trainable ones are checkpointed, the
    frozen base is rebuilt from its own weights (the seed's adapter-only save assumes it).
    """
    return any(not param.requires_grad for param in model.parameters())


def student_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``(model, optimizer)`` state dicts in DCP's form (``get_state_dict``), the model's filtered by
    :func:`saves_trainable_only`.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    if saves_trainable_only(model):
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        model_sd = {key: value for key, value in model_sd.items() if key in trainable}
    return model_sd, optim_sd


def group_of(process_group: Any) -> RankGroup | None:
    """The saving/loading group (``None``: one process, no collectives).

    Raises:
        ValueError: ``process_group`` given while ``torch.distributed`` is not initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        return None
    return RankGroup.of(process_group)


def _blob(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch_save(obj, buffer)
    return buffer.getvalue()


def _prepare(*, store: BaseStore, optimizer, scheduler, trainer_state, config, provenance_fingerprints,
             teacher_state, processor, rank_state, lineage, retention, own_rng, world_size: int) -> dict[str, Any]:
    """Check the seed's rules and build this rank's blobs and the manifest metadata (no I/O)."""
    step = check_trainer_state(trainer_state, teacher_state)
    provenance = check_provenance(provenance_fingerprints)
    fingerprint, config_yaml = config_record(config)
    trainer = sanitize_state(trainer_state, path="trainer_state")
    training = {
        "schema": SCHEMA_SHARDED,
        "trainer": trainer,
        "scheduler": sanitize_state(scheduler.state_dict(), path="scheduler.state_dict()"),
        "teacher": sanitize_state(teacher_state, path="teacher_state"),
        "config_fingerprint": fingerprint,
        "provenance_fingerprints": provenance,
        "world_size": world_size,
        "param_group_count": len(optimizer.param_groups),
    }
    rank_blob = _blob({"rng": sanitize_state(own_rng, path="rng"),
                       "extra": sanitize_state(rank_state, path="rank_state")})
    metadata = manifest_metadata(schema=SCHEMA_SHARDED, trainer_state=trainer, step=step, fingerprint=fingerprint,
                                 provenance=provenance, world_size=world_size, processor=processor, lineage=lineage)
    if check_retention(retention) is not None and not retention.keeps_all:
        store.check_save_retention(retention)
    training_blob = _blob(training)
    return {"step": step, "training_blob": training_blob, "rank_blob": rank_blob, "metadata": metadata,
            "config_yaml": config_yaml, "digest": hashlib.sha256(config_yaml).hexdigest()[:16]}


def save_sharded_opd_checkpoint(
    *,
    checkpoints_dir: str | os.PathLike | BaseStore,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict,
    config: Any,
    provenance_fingerprints: dict[str, str],
    teacher_state: dict,
    processor: Any = None,
    rank_state: dict | None = None,
    storage_options: dict[str, Any] | None = None,
    retention: RetentionPolicy | None = None,
    lineage: RunLineage | None = None,
    process_group: Any = None,
) -> str:
    """Commit one OPD checkpoint of a sharded (or replicated) student through DCP.

    Args:
        checkpoints_dir (str | os.PathLike | BaseStore): plain or tiered store, or URL.
        model (torch.nn.Module): the student, sharded with ``fully_shard`` or not.
        optimizer (torch.optim.Optimizer): over the student's (sharded) parameters.
        scheduler (Any): LR scheduler with ``state_dict()``.
        trainer_state, config, provenance_fingerprints, teacher_state: as ``save_opd_checkpoint``.
        processor (Any | None): saved as ``processor/...`` (rank 0).
        rank_state (dict | None): this rank's own extra state, restored to the same rank; replicated
            state (``GlobalSamplePosition``) goes into ``trainer_state``.
        storage_options (dict | None): fsspec options for a URL.
        retention (RetentionPolicy | None): applied by rank 0 once the step is durable.
        lineage (RunLineage | None): recorded in the manifest.
        process_group: the ranks saving together (default: the default group).

    Returns:
        str: the committed checkpoint's URL, the same on every rank.

    Rank obligations: every rank of ``process_group`` calls this with the same step after the
    update; trainer, scheduler and teacher state are rank 0's, RNG and ``rank_state`` each rank's.

    Raises:
        ValueError: (one process) a rule is broken (``UnsafeCheckpointError`` for unloadable state).
        TypeError: (one process) ``retention`` is not a ``RetentionPolicy`` or ``None``.
        DistributedSaveError: (a group) any rank's checks or writes failed, on every rank, naming each.
        DistributedCommitConflictError / CommitConflictError: the step is already committed.
        RetentionError: (rank 0) the retention pass after the commit failed; the step is committed.
    """
    group = group_of(process_group)
    world_size = 1 if group is None else group.world_size
    rank = 0 if group is None else group.rank
    store = as_store(checkpoints_dir, storage_options)
    with preserve_global_rng():
        own_rng = capture_rng_state()
        prepared, error = None, None
        try:
            prepared = _prepare(store=store, optimizer=optimizer, scheduler=scheduler, trainer_state=trainer_state,
                                config=config, provenance_fingerprints=provenance_fingerprints,
                                teacher_state=teacher_state, processor=processor, rank_state=rank_state,
                                lineage=lineage, retention=retention, own_rng=own_rng, world_size=world_size)
            model_sd, optim_sd = student_state_dicts(model, optimizer)
        except Exception as exc:  # noqa: BLE001 - agreed with every rank below
            error = exc
        # every rank learns whether every rank is ready to save the same step with the same config
        agree(group, None, error, url=store.url, step=None if prepared is None else prepared["step"],
              same=None if prepared is None else prepared["digest"], same_name="config digest")
        step = prepared["step"]
        state: dict[str, Any] = {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd,
                                 RANK_STATE_KEY: {rank_state_key(rank): prepared["rank_blob"]}}
        if rank == 0:
            state[OPD_KEY] = {TRAINING_STATE_KEY: prepared["training_blob"]}

        def extras(txn) -> None:
            txn.write_bytes(CONFIG_YAML, prepared["config_yaml"])
            if processor is not None:
                with tempfile.TemporaryDirectory(prefix="opd-processor-") as tmp:
                    stream_pretrained(txn, processor, Path(tmp) / PROCESSOR_DIR, PROCESSOR_DIR)

        url = dcp.save(state, store, step, process_group=process_group, metadata=prepared["metadata"],
                       extra_payloads=extras, after_commit=AfterCommit(store, step, retention=retention, lineage=lineage))
    logger.info("committed sharded OPD checkpoint %s (world size %d, rank %d)", url, world_size, rank)
    return url


__all__ = [
    "MODEL_KEY",
    "OPD_KEY",
    "OPTIM_KEY",
    "RANK_STATE_KEY",
    "SCHEMA_SHARDED",
    "TRAINING_STATE_KEY",
    "group_of",
    "rank_state_key",
    "save_sharded_opd_checkpoint",
    "saves_trainable_only",
    "student_state_dicts",
]
