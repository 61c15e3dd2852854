"""Small real objects for OPD checkpoint tests, shared by tests/, their child processes and bench/.

A config offering only the seed's contract (:class:`TinyConfig`), a stand-in adapter model
(:class:`StubAdapterModel`), a Linear layer with AdamW and LambdaLR after real updates
(:func:`make_training`), the arguments of valid ``save_opd_checkpoint``/``load_opd_checkpoint``
calls (:func:`save_kwargs`, :func:`load_kwargs`), global-RNG probes, a structural bit-for-bit
comparison (:func:`assert_same`) and a tiny real PEFT LoRA student (:class:`PeftFactory`).
"""

from __future__ import annotations

import hashlib
import json
import random
import types
from pathlib import Path

import numpy as np
import torch


class TinyConfig:
    """A config that offers only the seed's contract: ``fingerprint()`` and ``as_dict()``, plus
    ``checkpoint.resume_mode`` (no execution-only markings)."""

    def __init__(self, data: dict | None = None, resume_mode: str = "exact") -> None:
        self.data = dict(data or {"lr": 0.001, "rollout_limit": 8})
        self.checkpoint = types.SimpleNamespace(resume_mode=resume_mode)

    def as_dict(self) -> dict:
        return json.loads(json.dumps(self.data))

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.data, sort_keys=True).encode()).hexdigest()


class StubAdapterModel:
    """Stands in for a PEFT model where only ``save_pretrained`` matters (rule tests)."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.weights = {"lora_A.weight": torch.randn(2, 4, generator=generator)}

    def save_pretrained(self, directory: str) -> None:
        from safetensors.torch import save_file

        Path(directory).mkdir(parents=True, exist_ok=True)
        save_file(self.weights, str(Path(directory) / "adapter_model.safetensors"))
        (Path(directory) / "adapter_config.json").write_text('{"r": 2}', encoding="utf-8")


def make_training(seed: int = 0, steps: int = 2):
    """A Linear layer, AdamW and LambdaLR after ``steps`` real updates."""
    generator = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(steps):
        loss = layer(torch.randn(5, 4, generator=generator)).pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return layer, optimizer, scheduler


def trainer_state(successful: int = 2, attempted: int | None = None, **extra) -> dict:
    state = {
        "attempted_updates": successful + 1 if attempted is None else attempted,
        "successful_updates": successful,
        "query_update": successful,
        "validation_baseline": 0.5,
        "last_validation_artifact": f"val-{successful}.json",
        "validation_baseline_step": successful,
    }
    state.update(extra)
    return state


PROVENANCE = {"code_revision": "abc123", "teacher_weights": "sha256:teacher"}


def save_kwargs(checkpoints_dir, *, storage_options=None, successful: int = 2, config=None, **overrides) -> dict:
    """Keyword arguments of a valid ``save_opd_checkpoint`` call with small objects."""
    _layer, optimizer, scheduler = make_training()
    kwargs = dict(
        checkpoints_dir=checkpoints_dir,
        model=StubAdapterModel(),
        processor=None,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=trainer_state(successful),
        config=config or TinyConfig(),
        provenance_fingerprints=dict(PROVENANCE),
        teacher_state={"update_count": successful, "ema": torch.arange(3.0)},
        storage_options=storage_options,
    )
    kwargs.update(overrides)
    return kwargs


def load_kwargs(*, config=None, world_size: int = 1, rank: int = 0, storage_options=None, loaded=None) -> dict:
    """Keyword arguments of a ``load_opd_checkpoint`` call into fresh small objects."""
    _layer, optimizer, scheduler = make_training(seed=99, steps=0)
    sink = loaded if loaded is not None else []
    return dict(
        optimizer=optimizer,
        scheduler=scheduler,
        config=config or TinyConfig(),
        provenance_fingerprints=dict(PROVENANCE),
        teacher_state_loader=sink.append,
        rank=rank,
        world_size=world_size,
        storage_options=storage_options,
    )


def rng_fingerprint() -> tuple:
    """Every global RNG state of this process, comparable with ``==``."""
    return (
        random.getstate(),
        tuple(np.asarray(x).tobytes() if isinstance(x, np.ndarray) else x for x in np.random.get_state()),
        torch.get_rng_state().numpy().tobytes(),
    )


def next_draws() -> tuple:
    """The next values of the three global generators (consumes them)."""
    return (random.random(), np.random.rand(4).tobytes(), torch.rand(4).numpy().tobytes())


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def assert_same(a, b, path: str = "value") -> None:
    """Structural bit-for-bit equality (tensors compared with dtype and ``torch.equal``)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.cpu(), b.cpu()), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{index}]")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


class PeftFactory:
    """Builds a tiny Llama (about 3.6k parameters, random init with a fixed seed, no downloads)
    with a LoRA adapter on ``q_proj``/``v_proj``, and a word-level fast tokenizer."""

    def __init__(self) -> None:
        import transformers
        from peft import LoraConfig, get_peft_model
        from tokenizers import Tokenizer, models, pre_tokenizers

        self.transformers = transformers
        self._get_peft_model = get_peft_model
        self._lora_config = LoraConfig
        self._tokenizers = (Tokenizer, models, pre_tokenizers)

    def model(self, base_seed: int = 0, lora_seed: int = 1):
        config = self.transformers.LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        torch.manual_seed(base_seed)
        base = self.transformers.LlamaForCausalLM(config)
        torch.manual_seed(lora_seed)
        lora = self._lora_config(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        return self._get_peft_model(base, lora)

    def tokenizer(self):
        Tokenizer, models, pre_tokenizers = self._tokenizers
        vocab = {f"w{i}": i for i in range(30)}
        vocab.update({"[UNK]": 30, "[PAD]": 31})
        backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        return self.transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")

    @staticmethod
    def train(model, steps: int = 2, seed: int = 5):
        """AdamW + LambdaLR over the trainable (LoRA) parameters after ``steps`` real updates."""
        generator = torch.Generator().manual_seed(seed)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        for _ in range(steps):
            ids = torch.randint(0, 30, (2, 6), generator=generator)
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        return optimizer, scheduler

    @staticmethod
    def fresh_optim(model):
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return optimizer, scheduler
