"""The main job: a small, real on-policy distillation run that checkpoints to a store and resumes.

``opd-store train`` runs :func:`train`. The run is deterministic given its config: the same updates
happen in the same order with the same random draws, so a run killed at any point and resumed from
its latest complete checkpoint ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from typing import Any, Callable, TextIO

import numpy as np
import torch

from .._version import __version__
from ..errors import CheckpointNotFoundError, ResumeMismatchError
from ..format import parse_step_dirname
from ..opd import (
    OPDConfig,
    agree_on_notice,
    agreement_group,
    current_group,
    decide_on_rank0,
    load_adapter,
    load_opd_checkpoint,
    load_sharded_opd_checkpoint,
    payload_rank,
    save_opd_checkpoint,
    save_sharded_opd_checkpoint,
)
from ..retention import RetentionPolicy, RunLineage, check_retention
from ..runtime import PreemptionWatcher, check_secs, kill_points
from ..store import BaseStore, ReadableStore, ResumePoint, find_resume_point
from ._checkpoint_kind import check_checkpoint_kind
from ._corpus import CORPUS, prompts_at
from ._ledger import JobLedger
from ._models import ModelSpec, build_student, build_teacher, build_tokenizer
from ._resume_check import check_steps_ahead
from ._saving import JobSaves, emit
from ._sharding import full_state, prompt_batches, run_sharded_update, sample_position, shard_student
from ._update import run_update

STUDENT_NAME = "opd-store/tiny-llama-2x64-lora"
TEACHER_NAME = "opd-store/tiny-llama-3x64"


def job_config(*, updates: int, checkpoint_every: int, store_url: str, seed: int = 0,
               resume_mode: str = "exact", retention: RetentionPolicy | None = None) -> OPDConfig:
    """The main job's OPD config (tiny models, CPU-sized batches).

    ``updates`` (``training.total_updates``) shapes the learning-rate decay, so it is part of the
    config fingerprint: resuming with another ``--updates`` is refused under ``exact``.
    ``retention`` fills ``checkpoint.keep_last``/``keep_every`` (``None``: keep every step); the
    checkpoint section is execution-only, so a resume may change it.
    """
    retention = retention or RetentionPolicy()
    spec = ModelSpec()
    return OPDConfig.model_validate(
        {
            "model": {
                "student": STUDENT_NAME,
                "teacher": TEACHER_NAME,
                "dtype": "float32",
                "lora_rank": spec.lora_rank,
                "lora_alpha": float(spec.lora_alpha),
                "lora_dropout": 0.0,
                "target_modules": ["q_proj", "v_proj"],
            },
            "training": {
                "seed": seed,
                "learning_rate": 5e-3,
                "warmup_updates": min(2, updates),
                "total_updates": updates,
                "weight_decay": 0.01,
                "grad_clip": 1.0,
                "loss": "forward_kl",
                "queries_per_update": 2,
                "rollouts_per_query": 1,
            },
            "rollout": {"temperature": 1.0, "max_new_tokens": 6, "rollout_limit": 1},
            "execution": {"inference_batch_size": 1, "teacher_inference_batch_size": 1, "num_workers": 0},
            "logging": {"log_every": 1},
            "checkpoint": {"dir": store_url, "every_updates": checkpoint_every, "resume_mode": resume_mode,
                           "keep_last": retention.keep_last, "keep_every": retention.keep_every},
        }
    )


def provenance_fingerprints(tokenizer) -> dict[str, str]:
    """What the run was built from: corpus and vocabulary hashes, and the code revision."""
    corpus = hashlib.sha256("\n".join(CORPUS).encode()).hexdigest()
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    return {"corpus": corpus, "tokenizer": vocab, "code_revision": __version__}


def warmup_decay(warmup_updates: int, total_updates: int) -> Callable[[int], float]:
    """Linear warmup over ``warmup_updates`` then cosine decay to 10% at ``total_updates``."""

    def factor(update: int) -> float:
        if update < warmup_updates:
            return (update + 1) / max(1, warmup_updates)
        progress = min(1.0, (update - warmup_updates) / max(1, total_updates - warmup_updates))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


@dataclasses.dataclass
class TrainResult:
    """Summary of one ``train`` invocation.

    Attributes:
        resumed_from: checkpoint URL the run resumed from, or ``None``.
        resumed_step: its step, or ``None``.
        attempted_updates / successful_updates: final trainer counters.
        saves: one dict per checkpoint saved (``step``, ``url``, ``seconds``, ``size_bytes``; with
            ``async_save`` also ``blocked_seconds``, the time training waited for the snapshot).
        preempted: the ``preempted`` event when a preemption notice ended the run early, else ``None``.
    """

    resumed_from: str | None
    resumed_step: int | None
    attempted_updates: int
    successful_updates: int
    saves: list[dict[str, Any]]
    preempted: dict[str, Any] | None = None


class TeacherState:
    """The frozen teacher's checkpoint state: its name and the update count it has served."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.update_count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.name, "update_count": self.update_count}

    def load(self, state: dict[str, Any]) -> None:
        if state.get("model") != self.name:
            raise ResumeMismatchError(f"checkpoint teacher {state.get('model')!r} is not {self.name!r}")
        self.update_count = int(state["update_count"])


def train(
    *,
    store: BaseStore,
    updates: int,
    checkpoint_every: int,
    resume: str = "auto",
    seed: int = 0,
    log: TextIO | None = None,
    events: TextIO | None = None,
    resume_mode: str = "exact",
    final_state_path: str | None = None,
    preemption: PreemptionWatcher | None = None,
    async_save: bool = False,
    retention: RetentionPolicy | None = None,
    shard: bool = False,
    rank_timeout_secs: float = 30.0,
    checkpoint_every_auto: bool = False,
    progress_every_secs: float = 60.0,
    notice_deadline_secs: float | None = None,
    journal_sinks: list | None = None,
    process_started_secs: float | None = None,
) -> TrainResult:
    """Run (or continue) the OPD job until ``updates`` successful updates.

    Behaviour: docs/resume.md, docs/spot.md, docs/sharded.md, docs/tiered.md, docs/ledger.md.

    Args:
        store (BaseStore): checked for reachability first; a ``TieredStore`` first queues local
            steps never uploaded and is flushed before return.
        updates (int), checkpoint_every (int): successful updates to reach, and to save after
            (with ``checkpoint_every_auto``: the starting interval, moved toward Young/Daly's).
        resume (str): ``auto`` (newest step that verifies deeply), ``never``, or a step number.
        seed (int): seeds models, data order and every RNG (rank ``r`` uses ``seed + r``).
        log, events (TextIO | None): one JSON line per attempted update (``step``, ``ok``, ``loss``,
            ``lr``...) / per event (``resumed``, ``saved``, ``preempted``, ``flushed``...).
        resume_mode (str): the config's ``checkpoint.resume_mode``.
        final_state_path (str | None): ``torch.save`` target of the final state (not after a preemption).
        preemption (PreemptionWatcher | None): checked (agreed across ranks) at every update boundary;
            a notice means one synchronous save, a ``preempted`` event, return.
        async_save (bool): periodic saves through ``AsyncCheckpointer``; the last is waited for.
        retention (RetentionPolicy | None): applied once each step is durable; ``None`` keeps all.
        shard (bool): FSDP2 student checkpointed through DCP.
        rank_timeout_secs (float): timeout of the group a notice is agreed in.
        progress_every_secs (float): seconds between journal ``progress`` events (0: every update).
        notice_deadline_secs (float | None): a signal's deadline; one a save cannot meet skips it.
        journal_sinks (list | None): ``observe(event)`` targets on rank 0 (the Prometheus exporter).
        process_started_secs (float | None): process start, seconds since the epoch (default: now).

    Returns:
        TrainResult: counters, saves and the ``preempted`` event, if any.

    Every rank calls this with the same arguments; rank 0 decides the resume target and alone writes
    ``log``, ``events`` and ``final_state_path``.

    Raises:
        StoreUnreachableError: the store cannot be used (before any training).
        CheckpointNotFoundError: ``resume`` names a step that is not complete.
        IntegrityError / CommitConflictError: a step past the resume point is damaged / intact.
        ResumeMismatchError: another config, provenance or world size, or the other ``shard`` setting.
        UploadError: a tiered store's background upload (or retention after one) failed.
        RetentionError: a retention pass after a save to a plain store failed (the step committed).
        ValueError: ``updates`` or ``checkpoint_every`` < 1, a bad ``resume``, a ``*_secs`` that is
            NaN, infinite or negative (``rank_timeout_secs``, ``notice_deadline_secs``: or 0), or
            ``retention`` for a store that applies its own.
        TypeError: ``retention`` is not a ``RetentionPolicy`` or ``None`` (before any work).
    """
    if updates < 1 or checkpoint_every < 1:
        raise ValueError(f"updates ({updates}) and checkpoint_every ({checkpoint_every}) must be >= 1")
    rank_timeout_secs = check_secs(rank_timeout_secs, "rank_timeout_secs", positive=True)
    progress_every_secs = check_secs(progress_every_secs, "progress_every_secs")
    if notice_deadline_secs is not None:
        notice_deadline_secs = check_secs(notice_deadline_secs, "notice_deadline_secs", positive=True)
    retention = None if check_retention(retention) is None or retention.keeps_all else retention
    if retention is not None:
        store.check_save_retention(retention)  # before anything is built or written
    store.check_reachable()
    group = current_group()
    rank, world_size = (group.rank, group.world_size) if group else (0, 1)
    # Fails before models are built; on rank 0 (or alone) the resumed step's payloads are kept as the
    # guard read them, so the load below reads each byte once (docs/resume.md, "One download per resume").
    resumed_from, point = _resume_target(store, resume, updates, group, keep=_loaded_here(rank, world_size),
                                         every=None if checkpoint_every_auto else checkpoint_every)
    target_step = None if resumed_from is None else parse_step_dirname(resumed_from.rstrip("/").rpartition("/")[2])
    try:
        saved_world_size = check_checkpoint_kind(store, resumed_from, shard=shard)  # --shard as saved, before models
    except BaseException:
        point.release()
        raise
    gather_final = final_state_path is not None
    if rank != 0:
        log = events = open(os.devnull, "w")  # noqa: SIM115 - rank 0 reports for the job
        final_state_path = None
    store.upload_pending()  # a tiered store: local steps an earlier process committed, never uploaded
    log = log or sys.stdout
    events = events or open(os.devnull, "w")  # noqa: SIM115
    torch.set_num_threads(1)  # bit-exact CPU math across machines with different core counts
    config = job_config(updates=updates, checkpoint_every=checkpoint_every, store_url=store.url, seed=seed,
                        resume_mode=resume_mode, retention=retention)
    ledger = JobLedger(store, group=group, updates=updates, checkpoint_every=checkpoint_every,
                       auto=checkpoint_every_auto, progress_every_secs=progress_every_secs,
                       notice_deadline_secs=notice_deadline_secs, async_save=async_save, shard=shard,
                       sinks=journal_sinks, started_secs=process_started_secs)
    ledger.start(target_step)  # the journal's start event; with auto, the schedule (a collective)
    trainer: dict[str, Any] = {"attempted_updates": 0, "successful_updates": 0, "query_update": 0}
    try:
        return _run(store=store, updates=updates, seed=seed, log=log, events=events, final_state_path=final_state_path,
                    gather_final=gather_final, preemption=preemption, async_save=async_save, retention=retention,
                    shard=shard, rank_timeout_secs=rank_timeout_secs, group=group, rank=rank, world_size=world_size,
                    resumed_from=resumed_from, point=point, saved_world_size=saved_world_size, config=config,
                    ledger=ledger, trainer=trainer)
    except BaseException as exc:
        point.release()  # when the failure came before the load released it
        ledger.exit("failed", trainer, exc)
        raise


def _run(*, store: BaseStore, updates: int, seed: int, log: TextIO, events: TextIO, final_state_path: str | None,
         gather_final: bool, preemption: PreemptionWatcher | None, async_save: bool,
         retention: RetentionPolicy | None, shard: bool, rank_timeout_secs: float, group, rank: int, world_size: int,
         resumed_from: str | None, point: ResumePoint, saved_world_size: int | None, config: OPDConfig,
         ledger: JobLedger, trainer: dict[str, Any]) -> TrainResult:
    """The body of :func:`train` once its arguments are checked and its ledger started (same
    errors); ``trainer`` is filled in place, so a failure's ``exit`` event has the counters;
    ``point`` holds the payloads the resume guard read (released once loaded)."""

    tokenizer = build_tokenizer()
    student = build_student(len(tokenizer), seed)
    if shard:
        shard_student(student, world_size)  # before the optimizer: FSDP2 replaces the parameters
    teacher = build_teacher(len(tokenizer), seed)
    teacher_state = TeacherState(TEACHER_NAME)
    provenance = provenance_fingerprints(tokenizer)
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable,
        lr=config.training.learning_rate,
        betas=tuple(config.training.betas),
        eps=config.training.adam_eps,
        weight_decay=config.training.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_decay(config.training.warmup_updates, config.training.total_updates)
    )
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)

    resumed_step = None
    if resumed_from is not None:
        load_kwargs = dict(optimizer=optimizer, scheduler=scheduler, config=config, provenance_fingerprints=provenance,
                           teacher_state_loader=teacher_state.load, storage_options=store.storage_options)
        checkpoint = resumed_from if point.copy is None else (point.copy, point.step)
        try:
            if shard:
                loaded = load_sharded_opd_checkpoint(checkpoint, model=student, **load_kwargs).trainer_state
            else:
                load_adapter(checkpoint, student, storage_options=store.storage_options)
                loaded = load_opd_checkpoint(checkpoint, **load_kwargs)
        finally:
            point.release()
        trainer.clear()
        trainer.update(loaded)
        extra = ({"saved_world_size": saved_world_size, "world_size": world_size,  # elastic (else refused)
                  "unclaimed_ranks": list(range(world_size, saved_world_size))}
                 if saved_world_size not in (None, world_size) else {})
        if not shard and "samples_done" not in trainer:
            # A checkpoint of an earlier version: its cursor was query_update * W + r at its own world
            # size W, so the global index is counted at W, not at this run's size (an elastic resume).
            trainer["samples_done"] = (trainer["query_update"] * (saved_world_size or world_size)
                                       * config.training.queries_per_update)
        resumed_step = int(trainer["successful_updates"])
        emit(events, {"event": "resumed", "url": resumed_from, "step": resumed_step, **extra})
    ledger.resumed(resumed_step)
    position = sample_position(seed, rank, world_size, config.training.queries_per_update) if shard else None
    if position is not None and "data_position" in trainer:
        position.load_state_dict(trainer["data_position"])
    batches = prompt_batches(position) if position is not None else None
    agreement = None  # with several ranks and a watcher: the group a notice is agreed in, at every boundary
    if group is not None:
        emit(events, {"event": "started", "world_size": world_size, "pids": group.all_gather(os.getpid())})
        agreement = agreement_group(rank_timeout_secs) if preemption is not None else None

    # Every manifest records this run's id and the step it resumed from, so retention (here or an
    # operator's `opd-store gc`) keeps that step until the run has a second checkpoint.
    lineage = (decide_on_rank0(group, lambda: RunLineage.new(parent_step=resumed_step)) if group is not None
               else RunLineage.new(parent_step=resumed_step))
    save_kwargs = dict(
        checkpoints_dir=store, model=student, processor=tokenizer, optimizer=optimizer, scheduler=scheduler,
        config=config, provenance_fingerprints=provenance, lineage=lineage, retention=retention,
    )
    saves = JobSaves(store, events, save_kwargs, async_save=async_save,
                     save=save_sharded_opd_checkpoint if shard else save_opd_checkpoint, ledger=ledger)
    preempted: dict[str, Any] | None = None
    update_kwargs = dict(student=student, teacher=teacher, tokenizer=tokenizer, optimizer=optimizer,
                         scheduler=scheduler, max_new_tokens=config.rollout.max_new_tokens,
                         temperature=config.rollout.temperature, grad_clip=config.training.grad_clip or float("inf"))
    try:
        while trainer["successful_updates"] < updates:
            notice = agree_on_notice(preemption, agreement) if preemption is not None else None
            if notice is not None:  # every rank, at the same boundary
                preempted = saves.on_notice(notice, trainer, teacher_state.state_dict())
                break
            kill_points.update_started(trainer["attempted_updates"] + 1)  # test-only (the soak); nothing when not armed
            update_began = time.perf_counter()
            if batches is not None:
                outcome = run_sharded_update(prompts=next(batches), width=config.training.queries_per_update,
                                             **update_kwargs)
                trainer["data_position"] = position.state_dict()
            else:
                # A global sample index (the same on every rank), so an elastic resume re-splits the
                # corpus without skipping or repeating a prompt; at a constant world size it is the
                # cursor query_update * N + r of earlier versions.
                width = config.training.queries_per_update
                done = trainer.setdefault("samples_done", trainer["query_update"] * world_size * width)
                outcome = run_update(prompts=prompts_at(done + rank * width, width), world_size=world_size,
                                     **update_kwargs)
                trainer["samples_done"] = done + world_size * width
            trainer["attempted_updates"] += 1
            trainer["query_update"] += 1
            if outcome.ok:
                trainer["successful_updates"] += 1
                teacher_state.update_count = trainer["successful_updates"]
            emit(
                log,
                {
                    "attempted_update": trainer["attempted_updates"],
                    "step": trainer["successful_updates"],
                    "ok": outcome.ok,
                    "loss": outcome.loss,
                    "lr": outcome.lr,
                    "accepted": outcome.accepted,
                    "rejected": outcome.rejected,
                },
            )
            emit(events, {"event": "update", "attempted_update": trainer["attempted_updates"], "ok": outcome.ok})
            ledger.update_done(trainer, time.perf_counter() - update_began)  # journaled before the next update
            saves.report_finished()
            if outcome.ok and ledger.save_due(trainer["successful_updates"]):
                saves.periodic(trainer, teacher_state.state_dict())
        if preempted is None:
            saves.finish()
    finally:
        saves.close()
    store.flush()  # the last checkpoint (the preemption save too) is durable before the job reports success
    try:
        durable = store.latest_durable_step()
    except CheckpointNotFoundError:
        durable = None
    emit(events, {"event": "flushed", "durable_step": durable})
    if gather_final and preempted is None:
        if shard:  # a collective: every rank takes part, rank 0 writes
            final = {**full_state(student, optimizer), "trainer": dict(trainer)}
        else:
            final = {"adapter": {name: p.detach().clone() for name, p in student.named_parameters() if p.requires_grad},
                     "optimizer": optimizer.state_dict(), "trainer": dict(trainer)}
        if final_state_path is not None:
            torch.save(final, final_state_path)
    ledger.exit("preempted" if preempted is not None else "finished", trainer)
    return TrainResult(resumed_from, resumed_step, trainer["attempted_updates"], trainer["successful_updates"],
                       saves.saves, preempted)


def _resume_target(store: ReadableStore, resume: str, updates: int, group=None, *,
                   keep: Callable[[str], bool] | None = None, every: int | None = None) -> tuple[str | None, ResumePoint]:
    """The checkpoint to resume (``auto``: the newest step that verifies deeply, damaged newer steps
    skipped with a warning), after refusing a run that would save a step already committed
    (:mod:`opd_store.job._resume_check`); with a process group, one decision (rank 0's) for every rank.

    Returns:
        tuple[str | None, ResumePoint]: the step's URL (``None``: from scratch) and, on the rank
        that decided, the payloads of ``auto``'s step the check read and ``keep`` selects (every
        other rank: no copy). Release the point after loading.
    """
    if resume not in ("auto", "never") and not str(resume).isdigit():
        raise ValueError(f"--resume must be auto, never or a step number, got {resume!r}")
    point = ResumePoint(None)

    def decide() -> str | None:
        nonlocal point
        if resume == "auto":
            point = find_resume_point(store, keep=keep)
        elif resume != "never":
            point = ResumePoint(_complete_step(store, int(resume)))
        try:
            check_steps_ahead(store, point.step, updates, every=every, known=point.skipped)
        except BaseException:
            point.release()
            raise
        return None if point.step is None else store.step_url(point.step)

    url = decide() if group is None else decide_on_rank0(group, decide)
    return url, point


def _loaded_here(rank: int, world_size: int) -> Callable[[str], bool]:
    """Which payloads of the resumed step this process loads itself, so the guard keeps them:
    every one alone; with several ranks, all but another rank's own files (``rng-rank-XX.pt``,
    DCP's ``__<rank>_<n>.distcp``: :func:`~opd_store.opd.payload_rank`), which that rank reads itself."""
    if world_size == 1:
        return lambda _name: True
    return lambda name: payload_rank(name) in (None, rank)


def _complete_step(store: ReadableStore, step: int) -> int:
    if not store.is_complete(step):
        complete = [info.step for info in store.checkpoints() if info.status == "complete"]
        raise CheckpointNotFoundError(
            f"--resume {step}: step {step} is not a complete checkpoint in {store.url}; complete steps: {complete or 'none'}"
        )
    return step


__all__ = ["TrainResult", "job_config", "provenance_fingerprints", "train", "warmup_decay"]
