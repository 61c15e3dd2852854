"""The main job's sharded mode (``opd-store train --shard``): the student sharded with FSDP2 over a
CPU mesh, checkpointed through DCP (docs/sharded.md, "The main job").

FSDP all-gathers in every forward, so every rank runs the same number: each samples exactly
``queries_per_update`` prompts (a short batch is padded with prompts weighted 0). Data order is a
``GlobalSamplePosition`` (elastic-safe); each rank's loss is scaled by ``world_size /
contributing ranks`` so FSDP's average is over the ranks that accepted a rollout.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..opd import GlobalSamplePosition
from ._corpus import CORPUS
from ._update import UpdateOutcome, accept_rollout, sample_rollouts

PADDING_PROMPT = CORPUS[0]


def shard_student(student: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """Shard each decoder layer and the whole student over a 1-D CPU mesh of every rank (in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    for layer in student.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(student, mesh=mesh)
    return student


def sample_position(seed: int, rank: int, world_size: int, batch_size: int) -> GlobalSamplePosition:
    """The job's data order: the corpus shuffled per epoch from ``seed`` (the same on every rank)."""
    return GlobalSamplePosition(torch.Generator().manual_seed(seed), dataset_size=len(CORPUS),
                                batch_size=batch_size, rank=rank, world_size=world_size)


def prompt_batches(position: GlobalSamplePosition) -> Iterator[list[str]]:
    """This rank's prompts, one list per attempted update, epoch after epoch (a short batch at an
    epoch's end is returned short; :func:`run_sharded_update` pads it)."""
    epoch = position.epoch
    while True:
        for indices in position.iterate(epoch):
            yield [CORPUS[index] for index in indices]
        epoch += 1


def _sum(values: list[float]) -> torch.Tensor:
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return total


def run_sharded_update(*, student, teacher, tokenizer, optimizer, scheduler, prompts: list[str], width: int,
                       max_new_tokens: int, temperature: float, grad_clip: float) -> UpdateOutcome:
    """One update of the sharded student (see the module docstring).

    Rank obligations: every rank calls it once per attempted update with ``width`` equal everywhere.
    """
    padded = list(prompts) + [PADDING_PROMPT] * (width - len(prompts))
    rollouts = sample_rollouts(student, tokenizer, padded, max_new_tokens=max_new_tokens, temperature=temperature)
    real = rollouts[:len(prompts)]
    weights = [1.0 if accept_rollout(rollout, tokenizer, random) else 0.0 for rollout in real]
    weights += [0.0] * (width - len(prompts))
    accepted_here = int(sum(weights))
    counts = _sum([accepted_here, len(real) - accepted_here, 1.0 if accepted_here else 0.0])
    accepted, rejected, contributing = int(counts[0]), int(counts[1]), float(counts[2])
    lr = float(optimizer.param_groups[0]["lr"])
    if not accepted:
        return UpdateOutcome(ok=False, loss=None, lr=lr, accepted=0, rejected=rejected)
    student.train()
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float32)
    tokens = 0.0
    for weight, rollout in zip(weights, rollouts):  # every rank: the same number of forwards
        sequence = torch.cat([rollout.prompt_ids, rollout.continuation_ids]).unsqueeze(0)
        start, end = len(rollout.prompt_ids) - 1, sequence.shape[1] - 1
        student_logp = F.log_softmax(student(input_ids=sequence).logits[0, start:end], dim=-1)
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher(input_ids=sequence).logits[0, start:end], dim=-1)
        kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(dim=-1)
        total = total + weight * kl.sum()
        tokens += weight * kl.numel()
    loss = total / max(tokens, 1.0)
    (loss * (dist.get_world_size() / contributing)).backward()
    torch.nn.utils.clip_grad_norm_([p for p in student.parameters() if p.requires_grad], grad_clip)
    optimizer.step()
    scheduler.step()
    mean_loss = float(_sum([float(loss.detach()) if accepted_here else 0.0])[0]) / contributing
    return UpdateOutcome(ok=True, loss=mean_loss, lr=lr, accepted=accepted, rejected=rejected)


def full_state(student: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole adapter and optimizer state on rank 0 (``{}`` elsewhere): a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(student, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    trainable = {name for name, param in student.named_parameters() if param.requires_grad}
    return {"adapter": {key: value for key, value in model_sd.items() if key in trainable}, "optimizer": optim_sd}


__all__ = ["full_state", "prompt_batches", "run_sharded_update", "sample_position", "shard_student"]
