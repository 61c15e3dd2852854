"""A tiny real TRL on-policy distillation run (``GKDTrainer``) checkpointing into a store.

The student is the main job's small Llama with a LoRA adapter, the teacher a deeper frozen Llama of
the same family, the tokenizer a word-level one trained on the built-in corpus with a chat template;
everything is built from configs (no download, no network). Used by ``examples/trl_gkd_spot.py``,
``tests/integrations`` and ``bench/hf_callback.py``.

One *start* (:func:`run_start`) builds the trainer, resumes from the store's newest complete
checkpoint if there is one (:func:`opd_store.integrations.transformers.store_checkpoint`), trains
to ``max_steps`` with :class:`~opd_store.integrations.transformers.StoreCallback` committing each
save, and reports events (``resumed``, ``step``, ``saved``) to a callable, so a supervisor can kill
it at a chosen point.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from ._compare import adapter_and_optimizer_differences
from ._corpus import CORPUS

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


@dataclasses.dataclass(frozen=True)
class GKDSpec:
    """The run's shape: steps, save cadence, batch size and GKD's on-policy fraction."""

    max_steps: int = 6
    save_steps: int = 2
    batch_size: int = 2
    seed: int = 0
    lmbda: float = 0.5
    learning_rate: float = 1e-3
    save_total_limit: int = 1


def chat_tokenizer():
    """The main job's tokenizer with a chat template (GKD's collator applies it)."""
    from ._models import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def dataset(rows: int = 24):
    """``rows`` conversations (user prompt, assistant answer) from the built-in corpus."""
    from datasets import Dataset

    return Dataset.from_list([
        {"messages": [{"role": "user", "content": CORPUS[i % len(CORPUS)]},
                      {"role": "assistant", "content": CORPUS[(i + 1) % len(CORPUS)]}]}
        for i in range(rows)
    ])


def build_trainer(output_dir: str, spec: GKDSpec = GKDSpec(), callbacks: list | None = None, **config: Any):
    """A ``GKDTrainer`` over the tiny student (LoRA) and teacher, on CPU; ``config`` overrides
    ``GKDConfig`` fields."""
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from ._models import build_student, build_teacher

    tokenizer = chat_tokenizer()
    args = GKDConfig(**{
        "output_dir": output_dir, "max_steps": spec.max_steps, "save_steps": spec.save_steps,
        "per_device_train_batch_size": spec.batch_size, "learning_rate": spec.learning_rate,
        "logging_steps": 1, "report_to": [], "seed": spec.seed, "lmbda": spec.lmbda, "max_new_tokens": 4,
        "use_cpu": True, "save_total_limit": spec.save_total_limit, "disable_tqdm": True,
        "dataloader_num_workers": 0, "max_length": 32, **config,
    })
    return GKDTrainer(
        model=build_student(len(tokenizer), seed=spec.seed), teacher_model=build_teacher(len(tokenizer), seed=spec.seed),
        args=args, train_dataset=dataset(), processing_class=tokenizer, callbacks=callbacks,
    )


def final_state(trainer) -> dict[str, Any]:
    """What must match an uninterrupted run: adapter tensors, optimizer state, logged losses."""
    adapter = {name: param.detach().clone() for name, param in trainer.model.named_parameters() if param.requires_grad}
    return {
        "adapter": adapter,
        "optimizer": trainer.optimizer.state_dict(),
        "losses": [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry],
        "global_step": trainer.state.global_step,
    }


def compare_states(reference: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """Every difference between two :func:`final_state` results (empty when bit-identical)."""
    problems = []
    if reference["global_step"] != candidate["global_step"]:
        problems.append(f"global_step {candidate['global_step']} != {reference['global_step']}")
    problems += adapter_and_optimizer_differences(reference, candidate)
    if reference["losses"] != candidate["losses"]:
        problems.append(f"logged losses differ: {candidate['losses']} != {reference['losses']}")
    return problems


def run_start(
    store_url: str | None,
    output_dir: str,
    *,
    storage_options: dict[str, Any] | None = None,
    spec: GKDSpec = GKDSpec(),
    events: Callable[[dict[str, Any]], None] | None = None,
    async_upload: bool = False,
    retention: Any = None,
    journal_progress_secs: float = 60.0,
) -> dict[str, Any]:
    """One process start: resume from the store if it holds a checkpoint, train to the end.

    Sets torch to one intra-op thread for the process (as ``opd-store train`` does), so a start on
    a machine with another core count computes the same bits.

    ``store_url=None`` trains without the callback (the reference). ``events`` receives
    ``{"event": "resumed", "step": N}``, ``{"event": "step", "step": N}`` after every update and
    ``{"event": "saved", "step": N}`` after every commit. ``journal_progress_secs``: the callback's
    (its run journal's ``progress`` interval; 0: every update).

    Returns:
        dict: :func:`final_state` of the finished run, plus ``"log_history"``.
    """
    from transformers import TrainerCallback

    from ..integrations.transformers import StoreCallback, store_checkpoint

    emit = events or (lambda event: None)

    class Reporter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            emit({"event": "step", "step": state.global_step})

        def on_save(self, args, state, control, **kwargs):
            if store_callback is not None and state.global_step in store_callback.committed_steps:
                emit({"event": "saved", "step": state.global_step})

    torch.set_num_threads(1)  # bit-exact CPU math across machines with different core counts
    store_callback = None
    callbacks: list = []
    if store_url is not None:
        store_callback = StoreCallback(store_url, storage_options=storage_options, async_upload=async_upload,
                                       retention=retention, journal_progress_secs=journal_progress_secs)
        callbacks.append(store_callback)
    callbacks.append(Reporter())
    os.makedirs(output_dir, exist_ok=True)
    trainer = build_trainer(output_dir, spec, callbacks=callbacks)
    resume = None
    if store_url is not None:
        resume = store_checkpoint(store_url, storage_options=storage_options, trainer=trainer)
        if resume is not None:
            emit({"event": "resumed", "step": int(resume.rsplit("-", 1)[1])})
    trainer.train(resume_from_checkpoint=resume)
    result = final_state(trainer)
    result["log_history"] = trainer.state.log_history
    return result


__all__ = ["CHAT_TEMPLATE", "GKDSpec", "build_trainer", "chat_tokenizer", "compare_states", "dataset", "final_state",
           "run_start"]
