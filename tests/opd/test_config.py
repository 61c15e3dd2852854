"""OPDConfig: schema, markings, fingerprint, and the config.yaml a checkpoint writes."""

from __future__ import annotations

import hashlib
import json
import typing

import pytest
import yaml
from pydantic import BaseModel, Field

from opd_store.opd import RESUME_MODES, OPDConfig
from opd_store.opd._config import EXECUTION_ONLY_KEY, ROLLOUT_LIMIT_KEY, ResumeMode, execution_only
from opd_store.opd._snapshot import config_record


def with_values(**dotted) -> OPDConfig:
    """A default config with dotted-path overrides, e.g. with_values(**{"model.lora_rank": 8})."""
    data = OPDConfig().as_dict()
    for path, value in dotted.items():
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    return OPDConfig.model_validate(data)


def from_yaml_text(text: str) -> OPDConfig:
    """A config from YAML text, as a user loads one (missing sections and fields take defaults)."""
    return OPDConfig.model_validate(yaml.safe_load(text))


def get_path(data: dict, path: str):
    for part in path.split("."):
        data = data[part]
    return data


def test_markings_of_the_schema():
    assert OPDConfig.execution_only_paths() == ("execution", "logging", "checkpoint")
    assert OPDConfig.rollout_limit_path() == "rollout.rollout_limit"
    assert OPDConfig.execution_only_provenance == ("code_revision",)
    assert OPDConfig.model_fields["execution"].json_schema_extra == {EXECUTION_ONLY_KEY: True}
    rollout_fields = OPDConfig.model_fields["rollout"].annotation.model_fields
    assert rollout_fields["rollout_limit"].json_schema_extra == {ROLLOUT_LIMIT_KEY: True}
    # The markings are visible in the JSON schema too.
    schema = OPDConfig.model_json_schema()
    assert schema["properties"]["logging"][EXECUTION_ONLY_KEY] is True
    # Every marked path exists in the dict the checkpoint writes.
    data = OPDConfig().as_dict()
    for path in OPDConfig.execution_only_paths() + (OPDConfig.rollout_limit_path(),):
        get_path(data, path)
    # Instances answer the same hooks (resume.py reads them from the instance).
    assert OPDConfig().execution_only_paths() == OPDConfig.execution_only_paths()


def test_resume_mode_literal_matches_resume_module():
    assert typing.get_args(ResumeMode) == RESUME_MODES
    assert OPDConfig().checkpoint.resume_mode == "exact"


def test_as_dict_is_plain_json_with_every_field():
    config = with_values(**{"model.target_modules": ["q_proj", "v_proj"], "logging.run_name": "r1"})
    data = config.as_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["model"]["target_modules"] == ["q_proj", "v_proj"]
    assert data["training"]["betas"] == [0.9, 0.999]
    assert data["logging"]["run_name"] == "r1"
    assert data["checkpoint"] == {
        "dir": "checkpoints",
        "every_updates": 50,
        "keep_last": 3,
        "keep_every": None,
        "resume_mode": "exact",
    }
    assert list(data) == ["model", "training", "rollout", "execution", "logging", "checkpoint"]


def test_fingerprint_is_sha256_of_canonical_json_of_math_fields():
    config = with_values(**{"model.lora_rank": 8, "execution.num_workers": 7})
    math_fields = {
        key: value
        for key, value in config.as_dict().items()
        if key not in ("execution", "logging", "checkpoint")
    }
    canonical = json.dumps(math_fields, sort_keys=True, separators=(",", ":"))
    assert config.fingerprint() == hashlib.sha256(canonical.encode()).hexdigest()
    assert len(config.fingerprint()) == 64


def test_fingerprint_stable_under_key_order():
    forward = (
        "model:\n  lora_rank: 8\n  lora_alpha: 16\n"
        "training:\n  seed: 3\n  learning_rate: 2.0e-5\n"
    )
    backward = (
        "training:\n  learning_rate: 2.0e-5\n  seed: 3\n"
        "model:\n  lora_alpha: 16\n  lora_rank: 8\n"
    )
    first, second = from_yaml_text(forward), from_yaml_text(backward)
    assert first.fingerprint() == second.fingerprint()
    assert first.fingerprint() != OPDConfig().fingerprint()
    assert first.training.learning_rate == 2e-5 and first.model.lora_alpha == 16.0


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("model.lora_rank", 32),
        ("model.teacher", "Qwen/Qwen2.5-14B-Instruct"),
        ("model.target_modules", ["q_proj"]),
        ("training.learning_rate", 3e-5),
        ("training.seed", 1),
        ("training.betas", [0.8, 0.99]),
        ("rollout.temperature", 0.7),
        ("rollout.rollout_limit", 16),
    ],
)
def test_fingerprint_changed_by_math_field(path, value):
    assert with_values(**{path: value}).fingerprint() != OPDConfig().fingerprint()


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("execution.rollout_workers", 4),
        ("execution.num_workers", 0),
        ("execution.inference_batch_size", 128),
        ("execution.teacher_inference_batch_size", 4),
        ("logging.log_every", 1),
        ("logging.log_dir", "/mnt/logs"),
        ("checkpoint.dir", "s3://bucket/run"),
        ("checkpoint.every_updates", 5),
        ("checkpoint.keep_last", None),
        ("checkpoint.keep_every", 100),
        ("checkpoint.resume_mode", "rollout_limit_change"),
    ],
)
def test_fingerprint_unchanged_by_execution_only_field(path, value):
    changed = with_values(**{path: value})
    assert get_path(changed.as_dict(), path) == value
    assert changed.fingerprint() == OPDConfig().fingerprint()


def test_config_yaml_round_trip():
    config = with_values(
        **{
            "model.lora_rank": 4,
            "model.target_modules": ["q_proj", "o_proj"],
            "training.betas": [0.85, 0.95],
            "training.grad_clip": None,
            "rollout.rollout_limit": 3,
            "checkpoint.resume_mode": "execution_change",
            "checkpoint.keep_every": 10,
        }
    )
    fingerprint, data = config_record(config)  # what a save writes as config.yaml
    text = data.decode("utf-8")
    assert text == yaml.safe_dump(config.as_dict(), sort_keys=False)
    assert yaml.safe_load(text) == config.as_dict()
    loaded = from_yaml_text(text)
    assert loaded == config
    assert loaded.training.betas == (0.85, 0.95)
    assert loaded.fingerprint() == config.fingerprint() == fingerprint


def test_partial_yaml_takes_defaults():
    config = from_yaml_text("checkpoint:\n  resume_mode: execution_change\n")
    assert config.checkpoint.resume_mode == "execution_change"
    assert config.model.lora_rank == 16
    assert config.fingerprint() == OPDConfig().fingerprint()


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("trainig:\n  seed: 1\n", "trainig"),
        ("training:\n  learnin_rate: 1.0e-4\n", "learnin_rate"),
        ("checkpoint:\n  keep_lats: 2\n", "keep_lats"),
    ],
)
def test_unknown_keys_refused(text, named):
    with pytest.raises(ValueError, match="Extra inputs are not permitted") as info:
        from_yaml_text(text)
    assert named in str(info.value)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("checkpoint:\n  resume_mode: fast\n", "resume_mode"),
        ("training:\n  warmup_updates: 20\n  total_updates: 10\n", "warmup_updates (20)"),
        ("training:\n  betas: [0.9, 1.5]\n", "betas must lie in [0, 1)"),
        ("model:\n  lora_rank: 0\n", "lora_rank"),
        ("checkpoint:\n  every_updates: 0\n", "every_updates"),
    ],
)
def test_bad_values_refused(text, named):
    with pytest.raises(ValueError) as info:
        from_yaml_text(text)
    assert named in str(info.value)


def test_assignment_is_validated():
    config = OPDConfig()
    config.checkpoint.resume_mode = "execution_change"
    assert config.checkpoint.resume_mode == "execution_change"
    with pytest.raises(ValueError):
        config.checkpoint.resume_mode = "bogus"
    with pytest.raises(ValueError):
        config.training.learning_rate = -1.0


class _ProfilingSection(BaseModel):
    compile_model: bool = True
    profile_every: int = execution_only(0)


class _ExtendedConfig(OPDConfig):
    execution_only_provenance = ("code_revision", "host")
    profiling: _ProfilingSection = Field(default_factory=_ProfilingSection)


def test_leaf_marking_in_a_subclass():
    assert _ExtendedConfig.execution_only_paths() == (
        "execution",
        "logging",
        "checkpoint",
        "profiling.profile_every",
    )
    assert _ExtendedConfig.execution_only_provenance == ("code_revision", "host")
    base = _ExtendedConfig()
    assert _ExtendedConfig(profiling={"profile_every": 10}).fingerprint() == base.fingerprint()
    assert _ExtendedConfig(profiling={"compile_model": False}).fingerprint() != base.fingerprint()


def test_several_rollout_limits_are_a_schema_error():
    class _TwoLimits(BaseModel):
        a: int = Field(1, json_schema_extra={ROLLOUT_LIMIT_KEY: True})

    class _Broken(OPDConfig):
        extra_limits: _TwoLimits = Field(default_factory=_TwoLimits)

    with pytest.raises(TypeError, match="several rollout-limit fields"):
        _Broken.rollout_limit_path()
