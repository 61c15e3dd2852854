"""Helpers shared by the scenario tests: stores on every backend, a tiny real PEFT
student with dropout, the OPD call arguments, and a fresh-"machine" subprocess environment."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch
from opd_testkit.stores import EMULATOR_ENV, open_store  # noqa: F401 - the tests import open_store here

from opd_store.job import _machines as machines

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB = 32
PROVENANCE = {"corpus": "sha256:scenario", "code_revision": "scenario"}


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def config(updates: int = 8):
    """The main job's real pydantic ``OPDConfig``."""
    from opd_store.job._train import job_config

    return job_config(updates=updates, checkpoint_every=2, store_url="scenario")


def student(dropout: float = 0.0, seed: int = 0):
    """A tiny Llama (random init from ``seed``, no downloads) with a LoRA adapter on
    ``q_proj``/``v_proj``; ``dropout`` sets both the attention and the LoRA dropout."""
    import transformers
    from peft import LoraConfig, get_peft_model

    llama = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        attention_dropout=dropout,
    )
    saved = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        base = transformers.LlamaForCausalLM(llama)
        torch.manual_seed(seed + 1)
        lora = LoraConfig(r=2, lora_alpha=4, lora_dropout=dropout, target_modules=["q_proj", "v_proj"])
        return get_peft_model(base, lora)
    finally:
        torch.set_rng_state(saved)


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def save(store, *, model, optimizer, scheduler, trainer_state: dict, teacher_state: dict | None = None,
         cfg=None, **kwargs) -> str:
    from opd_store.opd import save_opd_checkpoint

    return save_opd_checkpoint(
        checkpoints_dir=store, model=model, processor=None, optimizer=optimizer, scheduler=scheduler,
        trainer_state=trainer_state, config=cfg or config(), provenance_fingerprints=dict(PROVENANCE),
        teacher_state=teacher_state if teacher_state is not None else {}, **kwargs,
    )


def load(checkpoint, *, model, optimizer, scheduler, cfg=None, storage_options=None) -> dict:
    from opd_store.opd import load_adapter, load_opd_checkpoint

    load_adapter(checkpoint, model, storage_options=storage_options)
    return load_opd_checkpoint(
        checkpoint, optimizer=optimizer, scheduler=scheduler, config=cfg or config(),
        provenance_fingerprints=dict(PROVENANCE), teacher_state_loader=lambda state: None,
        storage_options=storage_options,
    )


def base_state(step: int, **extra) -> dict:
    state = {"attempted_updates": step, "successful_updates": step, "query_update": step}
    state.update(extra)
    return state


def fresh_machine(base: Path, extra_env: dict[str, str] | None = None) -> tuple[dict[str, str], Path]:
    """A fresh machine (:func:`opd_store.job._machines.fresh_machine`) with the emulator
    environment and this worktree's opd_store and test helpers first on ``PYTHONPATH``."""
    return machines.fresh_machine(base, {**EMULATOR_ENV, **(extra_env or {})},
                                  pythonpath=[str(REPO_ROOT), str(REPO_ROOT / "tests")])


def store_args(backend) -> list[str]:
    """``opd-store`` options that reach ``backend`` from another process."""
    import json

    out = []
    for key, value in backend.storage_options.items():
        if key == "session":
            continue
        out += ["--storage-option", f"{key}={json.dumps(value)}"]
    return out


PYTHON = sys.executable
