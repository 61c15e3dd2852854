"""One on-policy distillation update: sample rollouts from the student, score them with the teacher,
step the student's LoRA adapter.

Every random draw goes through torch's global CPU generator (``torch.multinomial``), and the
acceptance rule through Python's ``random``, so resuming bit-exactly needs every RNG restored.
"""

from __future__ import annotations

import dataclasses
import random

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Rollout:
    """A prompt and the student's sampled continuation.

    Attributes:
        prompt_ids (torch.Tensor): int64, shape ``[prompt_len]`` (starts with ``<bos>``).
        continuation_ids (torch.Tensor): int64, shape ``[new_tokens]``.
    """

    prompt_ids: torch.Tensor
    continuation_ids: torch.Tensor


@dataclasses.dataclass(frozen=True)
class UpdateOutcome:
    """What one attempted update did.

    Attributes:
        ok: True when at least one rollout was accepted and the optimizer stepped.
        loss: distillation loss (forward KL, nats per token) of the update, or ``None``.
        lr: learning rate used for the step.
        accepted / rejected: rollout counts.
    """

    ok: bool
    loss: float | None
    lr: float
    accepted: int
    rejected: int


def encode_prompt(tokenizer, prompt: str, max_prompt_tokens: int) -> torch.Tensor:
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][:max_prompt_tokens]
    return torch.tensor([tokenizer.bos_token_id, *ids], dtype=torch.long)


@torch.no_grad()
def sample_rollouts(student, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float,
                    max_prompt_tokens: int = 16) -> list[Rollout]:
    """Sample one continuation per prompt from the student (ancestral sampling, no KV cache)."""
    student.eval()
    rollouts = []
    for prompt in prompts:
        prompt_ids = encode_prompt(tokenizer, prompt, max_prompt_tokens)
        sequence = prompt_ids
        for _ in range(max_new_tokens):
            logits = student(input_ids=sequence.unsqueeze(0)).logits[0, -1]
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1)
            sequence = torch.cat([sequence, token])
        rollouts.append(Rollout(prompt_ids, sequence[len(prompt_ids):]))
    return rollouts


def accept_rollout(rollout: Rollout, tokenizer, rng: random.Random | None = None) -> bool:
    """The verifier: refuses continuations with special tokens, and a random audit refuses 45%.

    The audit draws from Python's global ``random`` (so that RNG's state is part of the run's
    state), which makes some updates fail by design when every rollout is refused.
    """
    special = {tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id}
    if any(int(token) in special for token in rollout.continuation_ids):
        return False
    return (rng or random).random() >= 0.45


def distillation_loss(student, teacher, rollouts: list[Rollout]) -> torch.Tensor:
    """Mean forward KL(teacher || student) over the continuation tokens of ``rollouts``.

    Returns:
        torch.Tensor: float32 scalar with a gradient through the student's adapter.
    """
    student.train()
    total = torch.zeros((), dtype=torch.float32)
    count = 0
    for rollout in rollouts:
        sequence = torch.cat([rollout.prompt_ids, rollout.continuation_ids]).unsqueeze(0)
        start = len(rollout.prompt_ids) - 1
        end = sequence.shape[1] - 1
        student_logits = student(input_ids=sequence).logits[0, start:end]
        with torch.no_grad():
            teacher_logits = teacher(input_ids=sequence).logits[0, start:end]
        teacher_logp = F.log_softmax(teacher_logits, dim=-1)
        student_logp = F.log_softmax(student_logits, dim=-1)
        kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(dim=-1)
        total = total + kl.sum()
        count += kl.numel()
    return total / max(count, 1)


def run_update(*, student, teacher, tokenizer, optimizer, scheduler, prompts: list[str], max_new_tokens: int,
               temperature: float, grad_clip: float, world_size: int = 1) -> UpdateOutcome:
    """Attempt one update. The update-local failure queue (refused rollouts) lives and dies here.

    With ``world_size > 1`` (an initialised ``torch.distributed`` group) every rank samples
    its own ``prompts``; the update succeeds when any rank accepted a rollout, and the adapter's
    gradients (float32, the parameters' shapes) and the loss are averaged over the ranks that
    accepted one, so every replica takes the same optimizer step. Rank obligations: every rank
    calls this once per attempted update (it runs collectives).
    """
    rollouts = sample_rollouts(student, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature)
    failure_queue = [r for r in rollouts if not accept_rollout(r, tokenizer)]
    accepted = [r for r in rollouts if all(r is not f for f in failure_queue)]
    lr = float(optimizer.param_groups[0]["lr"])
    counts = _sum_over_ranks(torch.tensor([len(accepted), len(failure_queue)], dtype=torch.int64), world_size)
    accepted_total, rejected_total = int(counts[0]), int(counts[1])
    if not accepted_total:
        return UpdateOutcome(ok=False, loss=None, lr=lr, accepted=0, rejected=rejected_total)
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    if accepted:
        loss = distillation_loss(student, teacher, accepted)
        loss.backward()
        loss_value = loss.detach()
    else:
        loss_value = torch.zeros((), dtype=torch.float32)
    if world_size > 1:
        # Average over the ranks that contributed a loss (a rank with none adds zeros).
        contributing = _sum_over_ranks(torch.tensor([1.0 if accepted else 0.0]), world_size)
        for param in trainable:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad.copy_(_sum_over_ranks(param.grad, world_size) / contributing)
        loss_value = _sum_over_ranks(loss_value.reshape(1), world_size)[0] / contributing[0]
    torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
    optimizer.step()
    scheduler.step()
    return UpdateOutcome(ok=True, loss=float(loss_value), lr=lr, accepted=accepted_total, rejected=rejected_total)


def _sum_over_ranks(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """``tensor`` summed over every rank (a collective when ``world_size > 1``); a new tensor."""
    if world_size == 1:
        return tensor
    import torch.distributed as dist

    total = tensor.clone()
    dist.all_reduce(total)
    return total


__all__ = ["Rollout", "UpdateOutcome", "accept_rollout", "distillation_loss", "run_update", "sample_rollouts"]
