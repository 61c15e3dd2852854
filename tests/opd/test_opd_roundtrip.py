"""Full round trip with a real (tiny) PEFT LoRA student, AdamW and LambdaLR after real updates.

After loading into fresh objects, the adapter weights, optimizer, scheduler, teacher, trainer state
and the next draws of ``random``, numpy and torch equal what was saved, bit for bit; world sizes
1, 2 and 4 (single-writer mode), each rank getting its own RNG back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opd_store.opd import OPDConfig, load_adapter, load_opd_checkpoint, save_opd_checkpoint
from opd_store.opd._rng import capture_rng_state
from opd_store.store import CheckpointStore

CASES = [("local", 1), ("memory", 1), ("s3", 1), ("local", 2), ("memory", 4)]


def _peft_state(model):
    from peft.utils import get_peft_model_state_dict

    return {key: value.detach().clone() for key, value in get_peft_model_state_dict(model).items()}


@pytest.mark.parametrize(("backend_name", "world_size"), CASES, ids=[f"{b}-ws{w}" for b, w in CASES])
def test_round_trip_restores_everything_bit_for_bit(request, peft_factory, opd, backend_name, world_size):
    backend = opd.backend_named(request, backend_name)
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    config = OPDConfig()
    model = peft_factory.model()
    tokenizer = peft_factory.tokenizer()
    optimizer, scheduler = peft_factory.train(model, steps=2)
    adapter = _peft_state(model)
    assert any(key.endswith("lora_B.weight") and value.abs().sum() > 0 for key, value in adapter.items())

    # Each rank's generators are in their own state; single-writer mode gathers them on rank 0.
    rank_states, expected_draws = [], []
    for rank in range(world_size):
        opd.seed_all(1000 + rank)
        opd.next_draws()
        rank_states.append(capture_rng_state())
        expected_draws.append(opd.next_draws())
    teacher = {"update_count": 2, "ema": torch.randn(3, dtype=torch.float64), "name": "teacher-a"}
    trainer = opd.trainer_state(2, history=[np.float32(0.25), np.int64(3)], best=np.arange(3, dtype=np.int16))
    opd.seed_all(7)
    if world_size == 1:
        rank_states = None  # this process's state, captured by the save itself
        state_before = opd.rng_fingerprint()
    url = save_opd_checkpoint(
        checkpoints_dir=store,
        model=model,
        processor=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=trainer,
        config=config,
        provenance_fingerprints=dict(opd.PROVENANCE),
        teacher_state=teacher,
        world_size=world_size,
        rank_rng_states=rank_states,
    )
    if world_size == 1:
        assert opd.rng_fingerprint() == state_before
        expected_draws = [opd.next_draws()]

    for rank in range(world_size):
        fresh = peft_factory.model(lora_seed=50 + rank)  # same base weights, different adapter
        assert any(not torch.equal(value, adapter[key]) for key, value in _peft_state(fresh).items())
        fresh_optimizer, fresh_scheduler = peft_factory.fresh_optim(fresh)
        opd.seed_all(4242)  # scramble the generators

        # Rank 0 opens the URL; the others reuse the store (each new S3 client costs ~1 s here).
        ref = url if rank == 0 else (store, 2)
        processor = load_adapter(ref, fresh, storage_options=backend.storage_options)
        loaded_teacher: list = []
        state = load_opd_checkpoint(
            ref,
            optimizer=fresh_optimizer,
            scheduler=fresh_scheduler,
            config=OPDConfig(),
            provenance_fingerprints=dict(opd.PROVENANCE),
            teacher_state_loader=loaded_teacher.append,
            rank=rank,
            world_size=world_size,
            storage_options=backend.storage_options,
        )
        assert opd.next_draws() == expected_draws[rank], f"rank {rank} RNG"

        opd.assert_same(_peft_state(fresh), adapter, "adapter")
        opd.assert_same(fresh_optimizer.state_dict(), optimizer.state_dict(), "optimizer")
        opd.assert_same(fresh_scheduler.state_dict(), scheduler.state_dict(), "scheduler")
        assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
        opd.assert_same(loaded_teacher, [teacher], "teacher")
        expected_trainer = opd.trainer_state(2, history=[0.25, 3], best=torch.arange(3, dtype=torch.int16))
        opd.assert_same(state, expected_trainer, "trainer")
        assert type(processor).__name__ == type(tokenizer).__name__
        assert processor("w1 w7 w29")["input_ids"] == tokenizer("w1 w7 w29")["input_ids"] == [1, 7, 29]

    if world_size == 1:
        # The restored objects take the same next update as the originals did.
        ids = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(3))
        for m, opt in ((model, optimizer), (fresh, fresh_optimizer)):
            loss = m(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        opd.assert_same(_peft_state(fresh), _peft_state(model), "adapter after one more update")


def test_load_adapter_refuses_missing_and_unexpected_keys(tmp_path, peft_factory, opd):
    from peft import LoraConfig, get_peft_model

    model = peft_factory.model()
    optimizer, scheduler = peft_factory.train(model, steps=1)
    kwargs = opd.save_kwargs(str(tmp_path), successful=1)
    kwargs.update(model=model, optimizer=optimizer, scheduler=scheduler, teacher_state={})
    url = save_opd_checkpoint(**kwargs)

    import transformers

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(model.base_model.model.config)
    other = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj"]))
    before = _peft_state(other)
    with pytest.raises(ValueError) as info:
        load_adapter(url, other)
    message = str(info.value)
    assert "missing keys" in message and "k_proj.lora_A.weight" in message
    assert "unexpected keys" in message and "v_proj.lora_A.weight" in message
    opd.assert_same(_peft_state(other), before, "untouched adapter")
    with pytest.raises(TypeError, match="PEFT"):
        load_adapter(url, torch.nn.Linear(2, 2))

    fresh = peft_factory.model(lora_seed=3)
    assert load_adapter(url, fresh) is None  # no processor was saved
    opd.assert_same(_peft_state(fresh), _peft_state(model), "adapter")
