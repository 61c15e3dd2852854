"""Rank scenarios for what PyTorch's own DCP tests found (run by tests/dcp/harness.py in every rank):
ranks with nothing to write, DCP's plan cache, DCP's process-based ``async_save``.

``scenario_<name>(ctx)`` runs on every rank of the launch and returns what that rank observed.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sharded_models import compare, full_state, mesh_of, mlp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import Shard, distribute_tensor

import opd_store.dcp._writer as dcp_writer
from opd_store.dcp import StoreWriter, async_save, load, save

SIZES = (2, 4, 8)


def _sizes(ctx) -> list[int]:
    return [size for size in SIZES if size <= ctx.world_size]


def _side_groups(ctx) -> dict:
    """A second gloo group over each prefix (every rank creates each, in order): the barrier that
    holds the coordinator back runs on it, never on the group DCP saves with."""
    return {size: dist.new_group(list(range(size)), backend="gloo") for size in _sizes(ctx)}


def _replicated_and_uneven(group, size: int) -> dict:
    """A replicated tensor (DCP keeps one copy, on one rank) and a DTensor of ``size // 2 + 1`` rows
    sharded over ``size`` ranks (the last ranks hold empty shards): most ranks write nothing."""
    rows = size // 2 + 1
    uneven = distribute_tensor(torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3), mesh_of(group),
                               [Shard(0)])
    return {"replicated": torch.arange(4.0), "uneven": uneven}


class _CoordinatorLast:
    """Every non-coordinating rank writes and seals its part before the coordinator writes anything
    (the order in which a local store's step directory did not exist yet): the others reach a
    barrier of ``side`` once their ``write_data`` returned; the coordinator, which must first send
    the attempt id, waits on it before its first item (``write_items``), or at the end of its
    ``write_data`` when it has none (its ``.metadata`` comes later, in ``finish``)."""

    def __init__(self, side) -> None:
        self.side = side
        self.write_data, self.write_items = StoreWriter.write_data, dcp_writer.write_items

    def __enter__(self):
        write_data, write_items, side = self.write_data, self.write_items, self.side
        waited = []

        def held_write_items(*args, **kwargs):
            if not waited:
                dist.barrier(group=side)
                waited.append(True)
            return write_items(*args, **kwargs)

        def ordered_write_data(writer, plan, planner):
            if not writer.is_coordinator:
                try:
                    return write_data(writer, plan, planner)
                finally:  # a failed part must not leave the coordinator waiting
                    dist.barrier(group=side)
            dcp_writer.write_items = held_write_items
            try:
                written = write_data(writer, plan, planner)
            finally:
                dcp_writer.write_items = write_items
            if not waited:
                dist.barrier(group=side)
            return written

        StoreWriter.write_data = ordered_write_data
        return self

    def __exit__(self, *exc) -> None:
        StoreWriter.write_data, dcp_writer.write_items = self.write_data, self.write_items


def scenario_empty_ranks(ctx) -> dict:
    """From 2, 4 and 8 ranks: ``{"replicated": torch.arange(4.0)}`` (one rank writes, the others
    nothing) with the coordinator held back until every other rank sealed (steps 102, 104, 108), and
    a replicated tensor with uneven shards, not held back (steps 112, 114, 118); each loaded on its
    ranks. A launch of 4 runs the sizes 2 and 4."""
    sides = _side_groups(ctx)
    out: dict = {"saved": {}, "loaded": {}}
    for size in _sizes(ctx):
        for delayed, step in ((True, 100 + size), (False, 110 + size)):
            if ctx.rank < size:
                group = ctx.prefix_group(size)
                if delayed:
                    with _CoordinatorLast(sides[size]):
                        url = save({"replicated": torch.arange(4.0)}, ctx.store(), step, process_group=group)
                    target = {"replicated": torch.zeros(4)}
                else:
                    url = save(_replicated_and_uneven(group, size), ctx.store(), step, process_group=group)
                    target = {"replicated": torch.zeros(4),
                              "uneven": distribute_tensor(torch.zeros(size // 2 + 1, 3), mesh_of(group), [Shard(0)])}
                load(target, ctx.store(), step, process_group=group)
                out["saved"][str(step)] = url
                out["loaded"][str(step)] = {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).tolist()
                                            for key, value in target.items()}
            ctx.barrier()
    return out


def _caching_planner(name: str) -> DefaultSavePlanner:
    """DCP's plan cache is one per planner class *name* in each process (SavePlanner's class
    dicts), whatever the group: one name per world size keeps 2- and 4-rank saves apart."""
    return type(name, (DefaultSavePlanner,), {})(enable_plan_caching=True)


def scenario_plan_caching(ctx) -> dict:
    """Three consecutive saves with ``enable_plan_caching=True`` at 2 and 4 ranks (steps 21-23 and
    41-43; the second and third reuse DCP's cached plans), each loaded back; then a writer not told
    the group refuses the cached plan of a second save (steps 31, 32 at 2 ranks)."""
    out: dict = {"saved": {}, "compared": {}, "cached_plans": {}}
    prepare_global_plan = StoreWriter.prepare_global_plan

    def counting(writer, plans):  # the coordinator: how many plans DCP's cache stood in for
        out["cached_plans"][str(writer.step)] = sum(not plan.usable for plan in plans)
        return prepare_global_plan(writer, plans)

    StoreWriter.prepare_global_plan = counting
    for size, first in ((2, 21), (4, 41)):
        if ctx.rank < size:
            group = ctx.prefix_group(size)
            for step in range(first, first + 3):
                model, optimizer = mlp(group, seed=step)
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                planner = _caching_planner(f"CachingPlanner{size}")
                if step == first + 1:  # DCP's own entry point, the writer told the group
                    dcp.save(state, storage_writer=StoreWriter(ctx.store(), step, process_group=group),
                             planner=planner, process_group=group)
                    url = ctx.store().step_url(step)
                else:
                    url = save(state, ctx.store(), step, process_group=group, planner=planner)
                saved = full_state(model, optimizer)
                restored, restored_optim = mlp(group, seed=500 + step, train_steps=2)
                model_sd, optim_sd = get_state_dict(restored, restored_optim)
                load({"model": model_sd, "optim": optim_sd}, ctx.store(), step, process_group=group)
                set_state_dict(restored, restored_optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
                loaded = full_state(restored, restored_optim)
                if ctx.rank == 0:
                    out["saved"][str(step)] = url
                    out["compared"][str(step)] = compare(saved, loaded)
        ctx.barrier()
    if ctx.rank < 2:
        group = ctx.prefix_group(2)
        for step in (31, 32):
            model, optimizer = mlp(group, seed=step)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            try:
                dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=StoreWriter(ctx.store(), step),
                         planner=_caching_planner("CachingPlannerNoGroup"), process_group=group)
                out[f"no_group_{step}"] = "committed"
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException: the observation
                out[f"no_group_{step}"] = f"{type(exc).__name__}: {exc}"
    StoreWriter.prepare_global_plan = prepare_global_plan
    ctx.barrier()
    out["steps"] = ctx.store().steps()
    return out


def scenario_process_async(ctx) -> dict:
    """``async_save`` from 2 ranks with DCP's thread executor (step 51) and process executor (step
    52), the same state; a refused object through each (steps 53, 54: nothing committed, the error
    from ``result()``); a ``memory://`` store through the process executor (refused)."""
    out: dict = {"pid": os.getpid()}
    if ctx.rank < 2:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's background process group rendezvous
        group = ctx.prefix_group(2)
        side = dist.new_group([0, 1], backend="gloo")
        model, optimizer = mlp(group, seed=5)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        for kind, step in ((AsyncCheckpointerType.THREAD, 51), (AsyncCheckpointerType.PROCESS, 52)):
            pending = async_save({"model": model_sd, "optim": optim_sd}, ctx.store(), step, process_group=side,
                                 async_checkpointer_type=kind)
            out[kind.value] = pending.result(timeout=300)
        saved = full_state(model, optimizer)
        for step in (51, 52):
            restored, restored_optim = mlp(group, seed=99, train_steps=2)
            model_sd2, optim_sd2 = get_state_dict(restored, restored_optim)
            load({"model": model_sd2, "optim": optim_sd2}, ctx.store(), step, process_group=group)
            set_state_dict(restored, restored_optim, model_state_dict=model_sd2, optim_state_dict=optim_sd2)
            loaded = full_state(restored, restored_optim)
            if ctx.rank == 0:
                out[f"compared_{step}"] = compare(saved, loaded)
        bad = {"model": model_sd, "extra": {f"rank{ctx.rank}": torch.optim.AdamW if ctx.rank == 1 else 1}}
        for kind, step in ((AsyncCheckpointerType.THREAD, 53), (AsyncCheckpointerType.PROCESS, 54)):
            pending = async_save(bad, ctx.store(), step, process_group=side, async_checkpointer_type=kind)
            try:
                out[f"refused_{kind.value}"] = {"committed": pending.result(timeout=300)}
            except Exception as exc:  # noqa: BLE001 - the observation
                out[f"refused_{kind.value}"] = {"type": type(exc).__name__, "message": str(exc),
                                                "failures": sorted(getattr(exc, "failures", {}) or {})}
        memory = async_save({"model": model_sd}, f"memory://process-{ctx.rank}/run", 55, process_group=side,
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        try:
            memory.result(timeout=300)
            out["memory"] = "committed"
        except Exception as exc:  # noqa: BLE001 - the observation
            out["memory"] = f"{type(exc).__name__}: {exc}"
    ctx.barrier()
    out["steps"] = ctx.store().steps()
    return out
