"""Rank scenarios of the OPD layer on sharded students (run by tests/dcp/harness.py in every rank).

A 4-rank launch: a PEFT LoRA student and a full-parameter student sharded with FSDP2, saved with
``save_sharded_opd_checkpoint`` and loaded with ``load_sharded_opd_checkpoint`` at the same world
size (exact), at 2 (refused under ``exact``; ``elastic``) and from 2 on 4 (new ranks derive their
RNG); the preemption agreement; and last, a rank that dies while the others wait on it.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from sharded_models import compare, draws, full_state, local_shards, lora_student, mlp, seed_rank

from opd_store.opd import (
    GlobalSamplePosition,
    OPDConfig,
    agree_on_notice,
    agreement_group,
    load_sharded_opd_checkpoint,
    save_sharded_opd_checkpoint,
)
from opd_store.runtime import PreemptionWatcher

PROVENANCE = {"corpus": "c0ffee", "code_revision": "abc"}


def config(mode: str) -> OPDConfig:
    return OPDConfig.model_validate({"checkpoint": {"resume_mode": mode}})


def _scheduler(optimizer, steps: int = 1):
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0 / (update + 1))
    for _ in range(steps):
        scheduler.step()
    return scheduler


def _position(rank: int, world_size: int) -> GlobalSamplePosition:
    return GlobalSamplePosition(torch.Generator().manual_seed(5), dataset_size=40, batch_size=3, rank=rank,
                                world_size=world_size)


def _save(ctx, model, optimizer, group, step: int, *, trainer_extra=None, mode="exact", **kwargs) -> str:
    trainer = {"attempted_updates": step + 1, "successful_updates": step, "query_update": step + 1,
               "loss_history": [0.5, 0.25], **(trainer_extra or {})}
    return save_sharded_opd_checkpoint(
        checkpoints_dir=ctx.store(), model=model, optimizer=optimizer, scheduler=_scheduler(optimizer),
        trainer_state=trainer, config=config(mode), provenance_fingerprints=PROVENANCE,
        teacher_state={"update_count": step}, rank_state={"rank_marker": torch.tensor([ctx.rank])},
        process_group=group, **kwargs)


def _load(ctx, model, optimizer, group, url: str, mode: str):
    scheduler = _scheduler(optimizer, steps=3)
    teacher = {}
    resume = load_sharded_opd_checkpoint(url, model=model, optimizer=optimizer, scheduler=scheduler,
                                         config=config(mode), provenance_fingerprints=PROVENANCE,
                                         teacher_state_loader=teacher.update, process_group=group)
    return resume, scheduler, teacher


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "bases": [c.__name__ for c in type(exc).__mro__],
            "failures": {str(k): v for k, v in (getattr(exc, "failures", None) or {}).items()}}


def scenario_lora(ctx) -> dict:
    out: dict = {}
    world, pair = ctx.prefix_group(4), ctx.prefix_group(2)
    model, optimizer = lora_student(world, seed=0)
    position = _position(ctx.rank, 4)
    batches = position.iterate(0)
    out["consumed"] = [next(batches) for _ in range(2)]  # 2 steps of 4 ranks x 3 samples
    seed_rank(ctx.rank)
    url = _save(ctx, model, optimizer, world, 2, trainer_extra={"data_position": position.state_dict()})
    out["url"], out["draws_after_save"] = url, draws()
    saved = full_state(model, optimizer, trainable_only=True)
    if ctx.rank == 0:
        torch.save(saved, ctx.out / "lora-step-2.pt")

    try:  # the seed's rules, checked on every rank: rank 2 alone passes rollouts
        _save(ctx, model, optimizer, world, 3, trainer_extra={"rollouts": [1]} if ctx.rank == 2 else None)
        out["rule"] = {"committed": True}
    except Exception as exc:  # noqa: BLE001 - the observation
        out["rule"] = _error(exc)
    out["steps_after_rule"] = ctx.store().steps()

    # exact, same world size: everything back, this rank's RNG last
    fresh, fresh_optimizer = lora_student(world, seed=9, train_steps=2)
    seed_rank(ctx.rank + 50)
    resume, scheduler, teacher = _load(ctx, fresh, fresh_optimizer, world, url, "exact")
    out["exact"] = {"draws": draws(), "trainer": {k: v for k, v in resume.trainer_state.items() if k != "data_position"},
                    "marker": resume.rank_state["rank_marker"].tolist(), "scheduler_epoch": scheduler.last_epoch,
                    "teacher": teacher, "rng": resume.elastic.rng_source}
    state = full_state(fresh, fresh_optimizer, trainable_only=True)
    if ctx.rank == 0:
        out["exact"]["state"] = compare(saved, state)

    if pair is not None:  # 2 ranks under exact: refused naming both sizes, nothing changed
        small, small_optimizer = lora_student(pair, seed=11)
        before = local_shards(small)
        try:
            _load(ctx, small, small_optimizer, pair, url, "exact")
            out["exact_on_2"] = {"loaded": True}
        except Exception as exc:  # noqa: BLE001
            out["exact_on_2"] = _error(exc)
        out["exact_on_2"]["unchanged"] = all(torch.equal(before[k], v) for k, v in local_shards(small).items())
        resume, _s, _t = _load(ctx, small, small_optimizer, pair, url, "elastic")
        out["elastic_on_2"] = {"draws": draws(), "rng": resume.elastic.rng_source,
                               "unclaimed": list(resume.elastic.unclaimed_ranks),
                               "marker": resume.rank_state["rank_marker"].tolist()}
        rest = _position(ctx.rank, 2)
        rest.load_state_dict(resume.trainer_state["data_position"])
        out["elastic_on_2"]["rest_of_epoch"] = list(rest.iterate(0))
        state = full_state(small, small_optimizer, trainable_only=True)
        if ctx.rank == 0:
            out["elastic_on_2"]["state"] = compare(saved, state)
        # saved from 2 ranks (step 5), loaded on 4 below: ranks 2 and 3 are new
        _save(ctx, small, small_optimizer, pair, 5, mode="elastic")
    ctx.barrier()
    grown, grown_optimizer = lora_student(world, seed=13)
    resume, _s, _t = _load(ctx, grown, grown_optimizer, world, ctx.store().step_url(5), "elastic")
    out["elastic_2_to_4"] = {"draws": draws(), "rng": resume.elastic.rng_source,
                             "rank_state": None if resume.rank_state is None else resume.rank_state["rank_marker"].tolist(),
                             "world_sizes": [resume.decision.saved_world_size, resume.decision.world_size]}
    state = full_state(grown, grown_optimizer, trainable_only=True)
    if ctx.rank == 0:
        out["elastic_2_to_4"]["state"] = compare(saved, state)
    return out


def scenario_full_parameter(ctx) -> dict:
    """A full-parameter student (every parameter trains): saved on 4, elastic load on 2."""
    out: dict = {}
    world, pair = ctx.prefix_group(4), ctx.prefix_group(2)
    model, optimizer = mlp(world, seed=21)
    url = _save(ctx, model, optimizer, world, 7)
    saved = full_state(model, optimizer)
    if pair is not None:
        fresh, fresh_optimizer = mlp(pair, seed=22, train_steps=3)
        _load(ctx, fresh, fresh_optimizer, pair, url, "elastic")
        state = full_state(fresh, fresh_optimizer)
        if ctx.rank == 0:
            out["state"] = compare(saved, state)
    ctx.barrier()
    return out


def scenario_preemption(ctx) -> dict:
    """A SIGTERM seen by rank 2 alone stops every rank at the same update boundary."""
    group = agreement_group(20)
    seen = []
    with PreemptionWatcher(signals=("SIGTERM",)) as watcher:
        for boundary in range(6):
            if ctx.rank == 2 and boundary == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            notice = agree_on_notice(watcher, group)
            seen.append(None if notice is None else [notice.source, notice.detail])
            if notice is not None:
                break
    return {"seen": seen}


def scenario_rank_dies(ctx) -> dict:
    """Rank 3 dies; the others, waiting on it in the agreement collective of a group with a
    5-second timeout, give up within that bound (last scenario: the group is broken afterwards)."""
    group = agreement_group(5)
    agree_on_notice(None, group)  # everyone is here
    if ctx.rank == 3:
        os._exit(9)
    started = time.monotonic()
    try:
        agree_on_notice(None, group)
        return {"gave_up": False}
    except Exception as exc:  # noqa: BLE001 - the observation
        return {"gave_up": True, "secs": time.monotonic() - started, "raised": type(exc).__name__,
                "message": str(exc)[:300]}
