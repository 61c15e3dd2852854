"""Every resume mode through ``load_opd_checkpoint``, accepted and refused."""

from __future__ import annotations

import pytest
import torch

from opd_store.errors import ResumeMismatchError
from opd_store.opd import OPDConfig, load_opd_checkpoint, save_opd_checkpoint
from opd_store.store import CheckpointStore

VALIDATION_KEYS = ("validation_baseline", "last_validation_artifact", "validation_baseline_step")


def _config(mode: str = "exact", **sections) -> OPDConfig:
    data = {name: dict(values) for name, values in sections.items()}
    data.setdefault("checkpoint", {})["resume_mode"] = mode
    return OPDConfig.model_validate(data)


@pytest.fixture
def saved(opd):
    """A checkpoint saved under the default ``OPDConfig`` (resume_mode exact), on memory://."""
    store = CheckpointStore("memory://opd-test/resume")
    kwargs = opd.save_kwargs(store, config=OPDConfig())
    save_opd_checkpoint(**kwargs)
    return store, kwargs["optimizer"].state_dict()


def _load(store, opd, config, *, provenance=None, world_size=1):
    kwargs = opd.load_kwargs(config=config, world_size=world_size, loaded=[])
    if provenance is not None:
        kwargs["provenance_fingerprints"] = provenance
    optimizer = kwargs["optimizer"]
    teacher_calls = []
    kwargs["teacher_state_loader"] = teacher_calls.append
    if world_size > 1:
        kwargs["rank"] = 1
    return load_opd_checkpoint((store, 2), **kwargs), optimizer, teacher_calls


def _kept_baseline(state) -> None:
    assert state["validation_baseline"] == 0.5
    assert state["last_validation_artifact"] == "val-2.json"
    assert state["validation_baseline_step"] == 2
    assert "rollout_limit_changed_at_update" not in state


def test_exact_accepts_same_math_even_with_execution_only_changes(saved, opd):
    store, saved_optimizer = saved
    state, optimizer, _ = _load(store, opd, _config("exact", logging={"log_every": 99}))
    _kept_baseline(state)
    opd.assert_same(optimizer.state_dict(), saved_optimizer, "optimizer")


def test_exact_refuses_a_changed_field_naming_it(saved, opd):
    store, _ = saved
    with pytest.raises(ResumeMismatchError, match=r"training\.learning_rate"):
        _load(store, opd, _config("exact", training={"learning_rate": 3e-5}))


def test_exact_refuses_changed_provenance_and_names_the_mode_that_would_accept(saved, opd):
    store, _ = saved
    provenance = dict(opd.PROVENANCE, code_revision="def456")
    with pytest.raises(ResumeMismatchError, match=r"provenance\.code_revision") as info:
        _load(store, opd, _config("exact"), provenance=provenance)
    assert "execution_change" in str(info.value)


def test_execution_change_accepts_execution_only_fields_and_provenance(saved, opd):
    store, saved_optimizer = saved
    config = _config("execution_change", execution={"rollout_workers": 4}, logging={"log_dir": "elsewhere"})
    state, optimizer, teacher_calls = _load(
        store, opd, config, provenance=dict(opd.PROVENANCE, code_revision="def456")
    )
    _kept_baseline(state)
    assert state["successful_updates"] == 2
    opd.assert_same(optimizer.state_dict(), saved_optimizer, "optimizer")
    assert len(teacher_calls) == 1 and torch.equal(teacher_calls[0]["ema"], torch.arange(3.0))


def test_execution_change_refuses_math_changes_naming_every_field(saved, opd):
    store, _ = saved
    config = _config("execution_change", training={"learning_rate": 3e-5, "loss": "jsd"}, execution={"num_workers": 8})
    with pytest.raises(ResumeMismatchError) as info:
        _load(store, opd, config, provenance=dict(opd.PROVENANCE, teacher_weights="sha256:new"))
    message = str(info.value)
    for field in ("training.learning_rate", "training.loss", "provenance.teacher_weights"):
        assert field in message
    assert "2 refused" not in message  # three refused differences, all listed
    assert "3 refused" in message


def test_execution_change_refuses_a_rollout_limit_change(saved, opd):
    store, _ = saved
    with pytest.raises(ResumeMismatchError, match="rollout_limit_change"):
        _load(store, opd, _config("execution_change", rollout={"rollout_limit": 12}))


def test_rollout_limit_change_drops_the_validation_baseline(saved, opd):
    store, saved_optimizer = saved
    state, optimizer, teacher_calls = _load(store, opd, _config("rollout_limit_change", rollout={"rollout_limit": 12}))
    for key in VALIDATION_KEYS:
        assert key not in state
    assert state["rollout_limit_changed_at_update"] == 2
    assert state["successful_updates"] == 2 and state["query_update"] == 2 and state["attempted_updates"] == 3
    opd.assert_same(optimizer.state_dict(), saved_optimizer, "optimizer")
    assert len(teacher_calls) == 1


def test_rollout_limit_change_without_a_limit_change_keeps_the_baseline(saved, opd):
    store, _ = saved
    state, _, _ = _load(
        store, opd, _config("rollout_limit_change", execution={"inference_batch_size": 64}),
        provenance=dict(opd.PROVENANCE, code_revision="def456"),
    )
    _kept_baseline(state)


def test_cap_flag_survives_other_differences(saved, opd):
    """The seed re-validated per key, so a later key (provenance) could reset the flag set by the
    config's rollout-limit change. The whole set is decided at once now."""
    store, _ = saved
    config = _config("rollout_limit_change", rollout={"rollout_limit": 3}, execution={"rollout_workers": 2})
    state, _, _ = _load(store, opd, config, provenance=dict(opd.PROVENANCE, code_revision="def456"))
    for key in VALIDATION_KEYS:
        assert key not in state
    assert state["rollout_limit_changed_at_update"] == 2


@pytest.mark.parametrize("mode", ["exact", "execution_change", "rollout_limit_change"])
def test_world_size_change_is_refused_under_every_mode_naming_both(saved, opd, mode):
    store, _ = saved
    with pytest.raises(ResumeMismatchError) as info:
        _load(store, opd, _config(mode), world_size=2)
    assert "world_size 1" in str(info.value) and "world_size 2" in str(info.value)


@pytest.mark.parametrize("mode", ["exact", "execution_change", "rollout_limit_change"])
def test_config_without_markings_refuses_any_change_saying_why(opd, mode):
    store = CheckpointStore("memory://opd-test/unmarked")
    save_opd_checkpoint(**opd.save_kwargs(store, config=opd.TinyConfig()))
    changed = opd.TinyConfig({"lr": 0.001, "rollout_limit": 9}, resume_mode=mode)
    kwargs = opd.load_kwargs(config=changed)
    before = kwargs["optimizer"].state_dict()
    opd.seed_all(3)
    rng_before = opd.rng_fingerprint()
    with pytest.raises(ResumeMismatchError, match="no execution-only markings") as info:
        load_opd_checkpoint((store, 2), **kwargs)
    assert "rollout_limit" in str(info.value)
    # A refused resume restores nothing.
    assert kwargs["optimizer"].state_dict() == before
    assert opd.rng_fingerprint() == rng_before
