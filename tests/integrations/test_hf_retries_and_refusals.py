"""The Hugging Face integration's answers to a retry in the same process, what a killed
just-in-time save leaves behind, and what it does not support (refused, not half-done)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from opd_testkit.hf import tiny_model, tiny_trainer
from transformers import TrainerCallback, TrainerControl, TrainerState

from opd_store import CheckpointStore
from opd_store.integrations._run_config import RunConfig, check_resume, trainer_run_config
from opd_store.integrations.transformers import StoreCallback, resume_from_store, store_checkpoint


class Crash(Exception):
    pass


class CrashAtStep3(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise Crash


def test_a_new_trainer_in_the_same_process_resumes_where_the_crashed_one_committed(tmp_path):
    """A retry in the same process (a notebook, a supervisor loop) builds a new Trainer around the
    same model object, whose config the first run's saves filled in (``architectures``,
    ``dtype``): the recorded run config is what those saves write, so the retry is the same run.
    Its output directory also holds a just-in-time save of step 4 killed before it finished
    (``checkpoint-is-incomplete.txt``): removed when training begins, so step 4 saves and commits."""
    store_url, out = str(tmp_path / "store"), str(tmp_path / "out")
    model = tiny_model()
    assert model.config.architectures is None
    first = tiny_trainer(out, model=model, callbacks=[StoreCallback(store_url), CrashAtStep3()])
    with pytest.raises(Crash):
        first.train()
    assert model.config.architectures == ["LlamaForCausalLM"] and model.config.dtype == "float32"  # filled by the save
    jit = Path(out) / "checkpoint-4"
    jit.mkdir()
    (jit / "checkpoint-is-incomplete.txt").write_text("Checkpoint started at step 4 and in progress...")
    (jit / "optimizer.pt").write_bytes(b"half")

    retry = tiny_trainer(out, model=model, callbacks=[StoreCallback(store_url)])
    resume_from_store(retry, store_url)
    store = CheckpointStore(store_url)
    assert retry.state.global_step == 4 and store.steps() == [2, 4]
    assert store.manifest(4).metadata["parent_step"] == 2
    assert "checkpoint-is-incomplete.txt" not in store.names(4)
    assert store.read(4, "optimizer.pt") == (jit / "optimizer.pt").read_bytes() != b"half"


def test_a_run_config_recorded_before_the_first_save_still_matches(tmp_path):
    """Manifests written before the rule recorded ``architectures`` and ``dtype`` as ``None`` (the
    config before its first save): read as not filled yet, they still resume under ``exact``."""
    trainer = tiny_trainer(str(tmp_path / "out"))
    current = trainer_run_config(trainer.args, trainer.model)
    old = copy.deepcopy(current.sections)
    old["model"].update(architectures=None, dtype=None)
    saved = RunConfig(old, current.execution_only, current.provenance).to_metadata(1)
    decision = check_resume(saved, current, checkpoint_url="memory://x/step-000002", world_size=1)
    assert decision.mode == "exact"
    old["model"]["hidden_size"] = 64  # anything else still differs
    saved = RunConfig(old, current.execution_only, current.provenance).to_metadata(1)
    with pytest.raises(ValueError, match=r"model\.hidden_size: saved 64, current 32"):
        check_resume(saved, current, checkpoint_url="memory://x/step-000002", world_size=1)


def test_elastic_is_refused_in_one_line(tmp_path):
    store_url = str(tmp_path / "store")
    with pytest.raises(ValueError, match=r"^resume_mode 'elastic' is not supported with the Hugging Face Trainer: "
                                         r"the Trainer restores each rank's rng_state_\{rank\}\.pth"):
        StoreCallback(store_url, resume_mode="elastic")
    with pytest.raises(ValueError, match=r"^resume_mode 'elastic' is not supported"):
        store_checkpoint(store_url, tmp_path / "out", resume_mode="elastic")
    assert not (tmp_path / "store").exists() and not (tmp_path / "out").exists()  # refused before any I/O


def test_a_retention_that_is_not_a_policy_is_refused_at_construction(tmp_path):
    """Before, ``retention=3`` was accepted and ``train()`` died at the first save, after its commit,
    with ``AttributeError: 'int' object has no attribute 'keeps_all'``."""
    store_url = str(tmp_path / "store")
    with pytest.raises(TypeError) as raised:
        StoreCallback(store_url, retention=3)
    assert str(raised.value) == ("retention takes a RetentionPolicy or None, got 3 (int) "
                                 "(for the newest 3 steps: retention=RetentionPolicy(keep_last=3))")
    with pytest.raises(TypeError, match=r"^retention takes a RetentionPolicy or None, got 'last' \(str\)$"):
        StoreCallback(store_url, retention="last")
    assert not (tmp_path / "store").exists()  # refused before any I/O


@pytest.mark.parametrize(("option", "value", "shape"), [
    ("journal_progress_secs", float("nan"), ">= 0, got nan"), ("exit_timeout_secs", float("inf"), ">= 0, got inf"),
    ("exit_timeout_secs", -1, ">= 0, got -1")])
def test_a_duration_that_is_not_finite_and_non_negative_is_refused_at_construction(tmp_path, option, value, shape):
    """Before, NaN passed the ``< 0`` check (every comparison with NaN is false); one rule for every
    ``*_secs`` option (``opd_store.runtime.check_secs``)."""
    with pytest.raises(ValueError) as raised:
        StoreCallback(str(tmp_path / "store"), **{option: value})
    assert str(raised.value) == f"{option} must be a finite number of seconds {shape}"
    assert not (tmp_path / "store").exists()


def test_deepspeed_is_refused_when_training_begins(tmp_path):
    """DeepSpeed's ZeRO files are per-rank shards (``global_step*/zero_pp_rank_*``) the callback
    cannot attribute to their ranks: refused at ``on_train_begin``, before the first step."""
    store_url = str(tmp_path / "store")
    trainer = tiny_trainer(str(tmp_path / "out"))
    args = copy.copy(trainer.args)
    args.deepspeed = json.dumps({"zero_optimization": {"stage": 2}})  # what --deepspeed sets (needs deepspeed)
    callback = StoreCallback(store_url)
    with pytest.raises(ValueError) as raised:
        callback.on_train_begin(args, TrainerState(), TrainerControl(), model=trainer.model)
    assert str(raised.value).startswith(f"StoreCallback({store_url}) does not support DeepSpeed: its ZeRO checkpoint "
                                        "files are per-rank shards")
    assert "\n" not in str(raised.value) and CheckpointStore(store_url).steps() == []
