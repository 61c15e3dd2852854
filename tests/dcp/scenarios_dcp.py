"""Rank scenarios of the DCP storage layer (run by tests/dcp/harness.py in every rank).

``scenario_<name>(ctx)`` runs on every rank of the launch and returns what that rank observed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sharded_models import compare, full_state, local_shards, mlp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import opd_store.dcp._writer as dcp_writer
from opd_store.dcp import StoreReader, StoreWriter, async_save, load, save
from opd_testkit.damage import damage_payload
from scenarios_dcp_plans import scenario_empty_ranks  # noqa: F401 - run by the remote backends' launch

RESHARD_PAIRS = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 2))


def _save_mlp(ctx, size: int, step: int, *, plain_dcp: bool = False):
    group = ctx.prefix_group(size)
    model, optimizer = mlp(group, seed=size)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if plain_dcp:  # DCP's own entry point with opd_store's writer
        dcp.save(state, storage_writer=StoreWriter(ctx.store(), step), process_group=group)
        url = ctx.store().step_url(step)
    else:
        url = save(state, ctx.store(), step, process_group=group)
    return url, full_state(model, optimizer), model


def _load_mlp(ctx, size: int, step: int):
    group = ctx.prefix_group(size)
    model, optimizer = mlp(group, seed=100 + size, train_steps=2)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    load({"model": model_sd, "optim": optim_sd}, ctx.store(), step, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return full_state(model, optimizer)


def scenario_resharding(ctx) -> dict:
    """Save the MLP from 1, 2, 4 and 8 ranks (steps 1, 2, 4, 8), then load each pair's save on the
    other size; rank 0 compares every element of the gathered state with what was saved."""
    saved, out = {}, {"pairs": {}}
    for size in (1, 2, 4, 8):
        if size <= ctx.world_size and ctx.rank < size:
            _url, state, _model = _save_mlp(ctx, size, step=size, plain_dcp=size == 4)
            saved[size] = state
        ctx.barrier()
    for source, target in RESHARD_PAIRS:
        if max(source, target) > ctx.world_size:
            continue
        if ctx.rank < target:
            state = _load_mlp(ctx, target, source)
            if ctx.rank == 0:
                out["pairs"][f"{source}->{target}"] = compare(saved[source], state)
        ctx.barrier()
    return out


def _damage(ctx, step: int, name: str, how: str) -> None:
    """Rank 0 damages one committed file through the backend's own client (as another program would)."""
    if ctx.rank == 0:
        damage_payload(ctx.backend, step, name, how)
    ctx.barrier()


def _refused_load(ctx, step: int, size: int) -> dict:
    """Load a damaged step on ``size`` ranks: the error every rank raised and whether any local
    shard of the model changed."""
    group = ctx.prefix_group(size)
    model, optimizer = mlp(group, seed=77)
    before = local_shards(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    outcome = {}
    try:
        load({"model": model_sd, "optim": optim_sd}, ctx.store(), step, process_group=group)
        outcome["loaded"] = True
    except Exception as exc:  # noqa: BLE001 - the outcome is the observation
        outcome["error"] = {"type": type(exc).__name__, "message": str(exc),
                            "bases": [c.__name__ for c in type(exc).__mro__]}
    after = local_shards(model)
    outcome["unchanged"] = all(torch.equal(before[name], after[name]) for name in before)
    return outcome


def scenario_backend(ctx) -> dict:
    """On one backend with 4 ranks: a plain ``dcp.save`` with StoreWriter, a resharded load on 2,
    ``dcp.async_save``, a failing rank, and damaged files (missing, truncated, flipped)."""
    out: dict = {}
    url, saved, _model = _save_mlp(ctx, 4, step=1, plain_dcp=True)
    out["url"] = url
    if ctx.rank < 2:
        state = _load_mlp(ctx, 2, 1)
        if ctx.rank == 0:
            out["reshard_4_to_2"] = compare(saved, state)
    ctx.barrier()

    # async_save on a group of its own (its collectives run on DCP's background thread)
    side = dist.new_group(backend="gloo")
    model, optimizer = mlp(None, seed=4)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    started = time.perf_counter()
    future = async_save({"model": model_sd, "optim": optim_sd}, ctx.store(), 6, process_group=side)
    out["async_blocked_secs"] = time.perf_counter() - started
    out["async_url"] = future.result(timeout=120)
    ctx.barrier()
    check = _load_mlp(ctx, 4, 6)
    if ctx.rank == 0:
        out["async_roundtrip"] = compare(saved, check)  # the same seed and steps as step 1
    ctx.barrier()

    # a rank whose write fails: nothing committed, the same error on every rank
    original = dcp_writer.write_items

    def failing(writer, name, items, planner, *extensions):
        if ctx.rank == 2:
            writer.write(b"some bytes")
            raise OSError("injected write failure on rank 2")
        return original(writer, name, items, planner, *extensions)

    dcp_writer.write_items = failing
    try:
        _save_mlp(ctx, 4, step=5)
        out["failed_save"] = {"committed": True}
    except Exception as exc:  # noqa: BLE001 - the observation
        out["failed_save"] = {"type": type(exc).__name__, "message": str(exc),
                              "failures": {str(k): v for k, v in getattr(exc, "failures", {}).items()}}
    finally:
        dcp_writer.write_items = original
    ctx.barrier()
    out["steps_after_failure"] = ctx.store().steps()
    out["latest_after_failure"] = ctx.store().latest_step()

    # damaged files: each on a step of its own
    for step, name, how in ((2, "__1_0.distcp", "delete"), (3, "__2_0.distcp", "truncate"),
                            (4, "__3_0.distcp", "flip")):
        _save_mlp(ctx, 4, step=step)
        _damage(ctx, step, name, how)
        out[how] = _refused_load(ctx, step, 4)
        ctx.barrier()
    if ctx.rank < 2:  # a flipped file read by a resharded load: only the reading rank can see it
        out["flip_on_2"] = _refused_load(ctx, 4, 2)
    ctx.barrier()
    out["latest_at_end"] = ctx.store().latest_step()
    return out


def scenario_reader_contract(ctx) -> dict:
    """StoreReader refuses an uncommitted step before planning; DCP's metadata decodes safely."""
    out = {}
    reader = StoreReader(ctx.store(), 1)
    metadata = reader.read_metadata()
    out["metadata_keys"] = sorted(metadata.state_dict_metadata)[:3]
    try:
        StoreReader(ctx.store(), 999).read_metadata()
    except Exception as exc:  # noqa: BLE001
        out["uncommitted"] = type(exc).__name__
    return out
