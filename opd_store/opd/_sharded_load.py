"""Loading sharded OPD checkpoints: the exact next-update state at the same world size, the
elastic policy at another.

:func:`load_sharded_opd_checkpoint` is the sibling of
:func:`~opd_store.opd._load.load_opd_checkpoint` for checkpoints written by
:func:`~opd_store.opd._sharded.save_sharded_opd_checkpoint`. The order keeps the seed's rule that a
refused resume changes nothing:

1. every rank reads the manifest and decides the resume under the config's mode
   (:func:`~opd_store.opd._resume.validate_resume`: config fingerprint, provenance, world size; a
   world-size change only under ``elastic``); the outcome is agreed, so every rank raises the same
   ``ResumeMismatchError`` naming both sizes;
2. a first DCP load fetches the small state (the training state and this rank's own state);
   the teacher's update count is checked;
3. a second DCP load fills the student's and the optimizer's tensors in place, resharded by DCP to
   this run's mesh; every file a rank reads is checked against the manifest before any tensor
   changes (:mod:`opd_store.dcp._reader`), and a damaged one fails every rank;
4. ``set_state_dict`` hands the state to the model and optimizer, then the scheduler, the teacher
   (``teacher_state_loader``) and, last, this rank's RNG: its own, or under an elastic resume for a
   rank that did not exist, one derived from the checkpoint (:mod:`opd_store.opd._elastic`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from .. import dcp
from ..store import ReadableStore, VerifiedCopy
from ._distributed import load_collective
from ._elastic import ElasticResume
from ._load import check_teacher_count, finish_resume, read_config_dict
from ._names import CheckpointRef, require_complete, resolve_checkpoint
from ._resume import ResumeDecision, validate_resume
from ._safe_load import load_payload
from ._sharded import (
    MODEL_KEY,
    OPD_KEY,
    OPTIM_KEY,
    RANK_STATE_KEY,
    SCHEMA_SHARDED,
    TRAINING_STATE_KEY,
    group_of,
    rank_state_key,
    saves_trainable_only,
    student_state_dicts,
)

logger = logging.getLogger("opd_store.opd")


@dataclasses.dataclass
class ShardedResume:
    """What :func:`load_sharded_opd_checkpoint` restored on this rank.

    Attributes:
        trainer_state (dict): the saved trainer state (tensors on the CPU); under
            ``rollout_limit_change`` with a changed limit, without the validation keys and with
            ``rollout_limit_changed_at_update``, as the seed's loader returns it.
        rank_state (dict | None): this rank's own ``rank_state`` as saved, ``None`` for a rank
            that did not exist in the saved run.
        decision (ResumeDecision): the accepted resume (mode, accepted changes, both world sizes).
        elastic (ElasticResume): the world sizes and where this rank's RNG came from
            (``restored`` or ``derived``), and the saved ranks no rank restores.
    """

    trainer_state: dict
    rank_state: dict | None
    decision: ResumeDecision
    elastic: ElasticResume


def load_sharded_opd_checkpoint(
    checkpoint: CheckpointRef,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    config: Any,
    provenance_fingerprints: dict[str, str],
    teacher_state_loader: Callable[[dict], None],
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
) -> ShardedResume:
    """Restore a sharded OPD checkpoint onto this run's (sharded) student and optimizer.

    Rank obligations: every rank of ``process_group`` (default: the default group) calls this;
    the model and optimizer are built (and sharded) as in the saving run, over this run's mesh.

    Args:
        checkpoint (str | os.PathLike | tuple[BaseStore, int]): the step's URL or ``(store, step)``.
        model, optimizer, scheduler: built as when saved (any world size under ``elastic``).
        config, provenance_fingerprints, teacher_state_loader: as
            :func:`~opd_store.opd._load.load_opd_checkpoint`.
        storage_options (dict | None): fsspec options for a URL.
        process_group: the ranks loading together.

    Returns:
        ShardedResume: the trainer state, this rank's own state and what the resume did.

    Raises:
        IncompleteCheckpointError: the step is not complete, or a rank file is missing or
            truncated (naming step, rank and file); on every rank, nothing changed.
        IntegrityError: a file's bytes differ from the manifest (naming step, rank and file); on
            every rank, nothing changed.
        ResumeMismatchError: the resume is refused (a world-size change outside ``elastic`` names
            both sizes); on every rank, nothing changed.
        ValueError: not a sharded OPD checkpoint, or a teacher count that differs.
        DistributedLoadError: ranks failed in different ways.
    """
    group = group_of(process_group)
    rank, world_size = (0, 1) if group is None else (group.rank, group.world_size)
    store, step = resolve_checkpoint(checkpoint, storage_options)
    # Both DCP loads below read the rank files (the small state lives beside the shards): one
    # verified copy serves them, so each file is downloaded once (docs/resume.md, "One download
    # per resume"); a copy the caller made (the job's resume guard) is used as it is.
    owned = not (isinstance(store, VerifiedCopy) and store.step == step)
    reads = VerifiedCopy(store, step) if owned else store
    try:
        return _load(reads, step, rank=rank, world_size=world_size, group=group, model=model, optimizer=optimizer,
                     scheduler=scheduler, config=config, provenance_fingerprints=provenance_fingerprints,
                     teacher_state_loader=teacher_state_loader, process_group=process_group)
    finally:
        if owned:
            reads.release()


def _load(store: ReadableStore, step: int, *, rank: int, world_size: int, group: Any, model, optimizer, scheduler,
          config, provenance_fingerprints, teacher_state_loader, process_group) -> ShardedResume:
    """:func:`load_sharded_opd_checkpoint` on ``store`` (a verified copy of ``step``)."""

    def decide() -> tuple[ResumeDecision, ElasticResume, str]:
        url = require_complete(store, step).url
        manifest = store.manifest(step)
        metadata = manifest.metadata
        if metadata.get("opd_schema") != SCHEMA_SHARDED:
            raise ValueError(f"{url} is not a sharded OPD checkpoint (schema {metadata.get('opd_schema')!r}); "
                             "load it with load_opd_checkpoint")
        saved_fingerprint = metadata.get("config_fingerprint")
        saved_config = None if saved_fingerprint == config.fingerprint() else read_config_dict(store, step)
        decision = validate_resume(
            checkpoint_url=url, saved_config_fingerprint=saved_fingerprint,
            saved_provenance=metadata.get("provenance_fingerprints"), saved_world_size=manifest.world_size,
            saved_config_dict=saved_config, config=config, provenance_fingerprints=provenance_fingerprints,
            world_size=world_size)
        elastic = ElasticResume(saved_world_size=manifest.world_size, world_size=world_size, rank=rank, step=step,
                                config_fingerprint=str(saved_fingerprint))
        return decision, elastic, url

    decision, elastic, url = decide() if group is None else load_collective(group, decide)

    small: dict[str, Any] = {OPD_KEY: {TRAINING_STATE_KEY: b""}}
    if elastic.restores_own_rng:
        small[RANK_STATE_KEY] = {rank_state_key(rank): b""}
    dcp.load(small, store, step, process_group=process_group)
    training = load_payload(small[OPD_KEY][TRAINING_STATE_KEY], source=f"{url}: {OPD_KEY}.{TRAINING_STATE_KEY}")
    if not isinstance(training, dict) or training.get("schema") != SCHEMA_SHARDED:
        raise ValueError(f"{url}: malformed sharded training state (schema {getattr(training, 'get', dict)('schema')!r})")
    trainer, teacher = training["trainer"], training["teacher"]
    check_teacher_count(trainer, teacher, url)
    own = None
    if elastic.restores_own_rng:
        own = load_payload(small[RANK_STATE_KEY][rank_state_key(rank)],
                           source=f"{url}: {RANK_STATE_KEY}.{rank_state_key(rank)}")

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_sd, optim_sd = student_state_dicts(model, optimizer)
    dcp.load({MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}, store, step, process_group=process_group)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(strict=not saves_trainable_only(model)))
    finish_resume(trainer=trainer, teacher=teacher, scheduler=scheduler, scheduler_state=training["scheduler"],
                  teacher_state_loader=teacher_state_loader, decision=decision, elastic=elastic,
                  rng_state=None if own is None else own["rng"])
    return ShardedResume(trainer_state=trainer, rank_state=None if own is None else own["extra"],
                         decision=decision, elastic=elastic)


__all__ = ["ShardedResume", "load_sharded_opd_checkpoint"]
