"""The main job's models: a tiny student with a LoRA adapter, a frozen teacher, a local tokenizer.

Everything is built from configs with a fixed seed: no downloads, identical on every machine.
"""

from __future__ import annotations

import dataclasses

import torch

from ._corpus import CORPUS

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Sizes of the student and teacher (same Llama family).

    Attributes:
        hidden_size: width of both models.
        student_layers / teacher_layers: decoder layers.
        heads: attention heads.
        lora_rank / lora_alpha: the student's LoRA adapter on ``q_proj`` and ``v_proj``.
        max_positions: longest prompt + continuation, in tokens.
    """

    hidden_size: int = 64
    student_layers: int = 2
    teacher_layers: int = 3
    heads: int = 4
    lora_rank: int = 4
    lora_alpha: int = 8
    max_positions: int = 64


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` trained on the built-in corpus (deterministic).

    Returns:
        transformers.PreTrainedTokenizerFast: saved with the adapter as the checkpoint's processor.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=1)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def _llama(vocab_size: int, layers: int, spec: ModelSpec, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def build_student(vocab_size: int, seed: int, spec: ModelSpec = ModelSpec()):
    """The student: a small Llama (random init from ``seed``) wrapped with a PEFT LoRA adapter.

    Only the adapter's ``lora_A``/``lora_B`` weights (float32) are trainable. Building it leaves the
    global torch RNG untouched.
    """
    from peft import LoraConfig, get_peft_model

    base = _llama(vocab_size, spec.student_layers, spec, seed)
    lora = LoraConfig(
        r=spec.lora_rank, lora_alpha=spec.lora_alpha, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed + 1)
    try:
        model = get_peft_model(base, lora)
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def build_teacher(vocab_size: int, seed: int, spec: ModelSpec = ModelSpec()):
    """The frozen teacher: a deeper Llama of the same family (random init from ``seed + 1000``)."""
    model = _llama(vocab_size, spec.teacher_layers, spec, seed + 1000)
    model.requires_grad_(False)
    model.eval()
    return model


__all__ = ["ModelSpec", "build_student", "build_teacher", "build_tokenizer"]
