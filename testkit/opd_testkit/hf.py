"""A tiny real Hugging Face ``Trainer`` for the integration tests: a one-layer Llama built from its
config (no download), 32 training sequences of 8 tokens, CPU, one intra-op thread.

:func:`tiny_trainer` builds the ``Trainer`` the callback tests, the resume table and the 2-rank
children (``tests/integrations/rank_child.py``) share; with ``scores`` it also evaluates and picks
its best checkpoint by a score that depends only on the step (``compute_metrics``), so which
checkpoint is best is chosen by the test, not by the loss curve. transformers and torch are
imported when it is called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def tiny_model(seed: int = 0):
    """The one-layer Llama (vocabulary 64, hidden size 32), weights drawn from ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16))


def sequences(count: int = 32) -> list[dict[str, Any]]:
    """``count`` examples ``{"input_ids": [i .. i+7], "labels": same}`` (tensors)."""
    import torch

    return [{"input_ids": torch.arange(8) + i, "labels": torch.arange(8) + i} for i in range(count)]


def tiny_trainer(output_dir: str, *, callbacks: Sequence[Any] = (), model: Any = None, max_steps: int = 4,
                 save_steps: int = 2, scores: Mapping[int, float] | None = None, **args: Any):
    """A ``transformers.Trainer`` of :func:`tiny_model` (or ``model``) on :func:`sequences`.

    Args:
        output_dir (str): ``TrainingArguments.output_dir``.
        callbacks (Sequence): the trainer's callbacks.
        model (torch.nn.Module | None): the model to train (a retry in the same process passes the
            first trainer's); default a new :func:`tiny_model`.
        max_steps (int): steps of the run.
        save_steps (int): save cadence (steps).
        scores (Mapping[int, float] | None): evaluate at every save and take ``eval_score`` =
            ``scores[global_step]`` as ``metric_for_best_model`` (greater is better), with
            ``load_best_model_at_end``.
        **args: more ``TrainingArguments`` fields.
    """
    import torch
    from transformers import Trainer, TrainingArguments

    torch.set_num_threads(1)
    settings: dict[str, Any] = dict(output_dir=output_dir, max_steps=max_steps, save_steps=save_steps,
                                    per_device_train_batch_size=2, report_to=[], use_cpu=True, disable_tqdm=True,
                                    seed=0, logging_steps=1, dataloader_num_workers=0)
    extra: dict[str, Any] = {}
    if scores is not None:
        settings.update(eval_strategy="steps", eval_steps=save_steps, metric_for_best_model="score",
                        greater_is_better=True, load_best_model_at_end=True, per_device_eval_batch_size=4)
        extra = {"eval_dataset": sequences(4),
                 "compute_metrics": lambda _prediction: {"score": scores[trainer.state.global_step]}}
    settings.update(args)
    trainer = Trainer(model=model if model is not None else tiny_model(), args=TrainingArguments(**settings),
                      train_dataset=sequences(), callbacks=list(callbacks), **extra)
    return trainer


def weights(trainer) -> dict[str, Any]:
    """Every parameter of the trainer's model, detached copies (for bit-exact comparisons)."""
    return {name: param.detach().clone() for name, param in trainer.model.named_parameters()}


__all__ = ["sequences", "tiny_model", "tiny_trainer", "weights"]
