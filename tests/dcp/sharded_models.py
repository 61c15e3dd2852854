"""Tiny sharded students for the rank scenarios: built from seeds, sharded with FSDP2 on a CPU mesh.

Imported by the launcher before it forks (tests/dcp/harness.py), so every rank shares the imports.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def mesh_of(group) -> DeviceMesh:
    """A 1-D CPU device mesh over ``group`` (the launch's world or a prefix subgroup)."""
    return DeviceMesh.from_group(group or dist.group.WORLD, "cpu", mesh_dim_names=("shard",))


def mlp(group, *, seed: int, train_steps: int = 1):
    """A full-parameter student: odd sizes, so 4 and 8 ranks get uneven (and empty) shards; AdamW
    after ``train_steps`` real steps (``step``, ``exp_avg``, ``exp_avg_sq`` all populated)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    mesh = mesh_of(group)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(train_steps):
        model(torch.arange(26, dtype=torch.float32).reshape(2, 13) / (10 + step)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def lora_student(group, *, seed: int, train_steps: int = 1):
    """The main job's student (tiny Llama with a PEFT LoRA adapter), each decoder layer and the
    root sharded; only the adapter trains."""
    from opd_store.job import build_student

    model = build_student(32, seed)
    mesh = mesh_of(group)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.arange(12).reshape(2, 6) % 32
    for _ in range(train_steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def full_state(model, optimizer, *, trainable_only: bool = False) -> dict:
    """The whole (unsharded) model and optimizer state on rank 0 of the model's group, CPU tensors;
    ``{}`` elsewhere. A collective over the group."""
    model_sd, optim_sd = get_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainable_only:
        names = {name for name, param in model.named_parameters() if param.requires_grad}
        model_sd = {key: value for key, value in model_sd.items() if key in names}
    return {"model": model_sd, "optim": optim_sd}


def local_shards(model) -> dict[str, torch.Tensor]:
    """Copies of this rank's local parameter shards (to prove a refused load changed nothing)."""
    out = {}
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        out[name] = local.detach().clone()
    return out


def compare(expected: dict, actual: dict) -> dict:
    """Every tensor of two :func:`full_state` results: ``{"tensors": n, "elements": n, "differing": [...]}``."""
    differing, tensors, elements = [], 0, 0

    def walk(a, b, path):
        nonlocal tensors, elements
        if isinstance(a, torch.Tensor):
            tensors += 1
            elements += a.numel()
            if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
                differing.append(path)
        elif isinstance(a, dict):
            if set(a) != set(b if isinstance(b, dict) else {}):
                differing.append(f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b or {}))}")
                return
            for key in a:
                walk(a[key], b[key], f"{path}.{key}")
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                differing.append(path)
                return
            for index, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{index}]")
        elif a != b:
            differing.append(f"{path}: {a!r} vs {b!r}")

    walk(expected, actual, "")
    return {"tensors": tensors, "elements": elements, "differing": differing}


def draws() -> list[float]:
    """One draw from every global generator a checkpoint restores."""
    return [random.random(), float(np.random.rand()), *torch.rand(2, dtype=torch.float64).tolist()]


def seed_rank(rank: int) -> None:
    random.seed(1000 + rank)
    np.random.seed(2000 + rank)
    torch.manual_seed(3000 + rank)
