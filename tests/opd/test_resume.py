"""Resume modes: exact, execution_change, rollout_limit_change."""

from __future__ import annotations

import dataclasses
import types

import pytest
import yaml

from opd_store.errors import OpdStoreError, ResumeMismatchError
from opd_store.opd import RESUME_MODES, OPDConfig, validate_resume
from opd_store.opd._resume import ResumeDecision, resume_mode_of, validate_execution_change

URL = "s3://runs/opd-demo/checkpoints/step-000040"
PROVENANCE = {
    "code_revision": "3f2a9c1",
    "teacher_weights": "sha256:teacher",
    "dataset": "sha256:data",
}


def make_config(mode: str = "exact", **dotted) -> OPDConfig:
    """A default config in ``mode`` with dotted-path overrides."""
    data = OPDConfig().as_dict()
    data["checkpoint"]["resume_mode"] = mode
    for path, value in dotted.items():
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    return OPDConfig.model_validate(data)


def check(
    parent,
    current,
    *,
    saved_provenance=PROVENANCE,
    provenance=PROVENANCE,
    saved_world_size: int = 1,
    world_size: int = 1,
    with_config_yaml: bool = True,
    saved_fingerprint: str | None = None,
) -> ResumeDecision:
    """Resume ``current`` from a checkpoint saved under ``parent``, as the loader will call it."""
    return validate_resume(
        checkpoint_url=URL,
        saved_config_fingerprint=(
            parent.fingerprint() if saved_fingerprint is None else saved_fingerprint
        ),
        saved_provenance=dict(saved_provenance),
        saved_world_size=saved_world_size,
        saved_config_dict=yaml.safe_load(yaml.safe_dump(parent.as_dict(), sort_keys=False))
        if with_config_yaml
        else None,
        config=current,
        provenance_fingerprints=dict(provenance),
        world_size=world_size,
    )


def refusal(**kwargs) -> str:
    with pytest.raises(ResumeMismatchError) as info:
        check(**kwargs)
    message = str(info.value)
    assert URL in message
    return message


# --- errors and helpers -------------------------------------------------------------------------


def test_error_type_and_decision_shape():
    assert issubclass(ResumeMismatchError, ValueError)
    assert issubclass(ResumeMismatchError, OpdStoreError)
    decision = ResumeDecision("exact", False, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.mode = "execution_change"


def test_resume_mode_of():
    assert resume_mode_of(OPDConfig()) == "exact"
    assert resume_mode_of(make_config("rollout_limit_change")) == "rollout_limit_change"
    assert resume_mode_of(object()) == "exact"
    assert resume_mode_of(types.SimpleNamespace(checkpoint=types.SimpleNamespace())) == "exact"
    as_mapping = types.SimpleNamespace(checkpoint={"resume_mode": "execution_change"})
    assert resume_mode_of(as_mapping) == "execution_change"
    with pytest.raises(ValueError, match="unknown resume_mode 'fast'"):
        resume_mode_of(types.SimpleNamespace(checkpoint=types.SimpleNamespace(resume_mode="fast")))


# --- world size ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [mode for mode in RESUME_MODES if mode != "elastic"])
def test_world_size_change_refused_under_every_mode_but_elastic(mode):
    parent = make_config("exact")
    message = refusal(parent=parent, current=make_config(mode), saved_world_size=2, world_size=4)
    assert "saved with world_size 2" in message
    assert "this run has world_size 4" in message
    assert "every resume mode except 'elastic'" in message


def test_elastic_accepts_a_world_size_change_and_judges_the_rest_as_execution_change():
    decision = check(make_config("exact"), make_config("elastic"), saved_world_size=4, world_size=2)
    assert decision.mode == "elastic"
    assert (decision.saved_world_size, decision.world_size) == (4, 2)
    same = check(make_config("exact"), make_config("elastic"), saved_world_size=2, world_size=2)
    assert (same.saved_world_size, same.world_size) == (2, 2)
    accepted = check(make_config("exact"), make_config("elastic", **{"execution.inference_batch_size": 64}),
                     provenance=dict(PROVENANCE, code_revision="def456"), saved_world_size=4, world_size=8)
    assert accepted.accepted_changes == ("provenance.code_revision",)
    assert (accepted.saved_world_size, accepted.world_size) == (4, 8)
    message = refusal(parent=make_config("exact"), current=make_config("elastic", **{"training.learning_rate": 2e-5}),
                      saved_world_size=4, world_size=2)
    assert "training.learning_rate" in message
    assert "resume_mode 'elastic'" in message and "execution_change" not in message  # the mode the user asked for
    provenance_only = refusal(parent=make_config("exact"), current=make_config("elastic"),
                              provenance=dict(PROVENANCE, dataset="sha256:other"), saved_world_size=4, world_size=2)
    assert "resume_mode 'elastic'" in provenance_only and "execution_change" not in provenance_only


def test_world_size_checked_before_anything_else():
    # Even with an unknown mode and everything else different, the world size is reported first.
    odd = types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(resume_mode="fast"),
        fingerprint=lambda: "other",
        as_dict=lambda: {},
    )
    message = refusal(parent=OPDConfig(), current=odd, saved_world_size=4, world_size=1)
    assert "world_size 4" in message and "world_size 1" in message


# --- exact --------------------------------------------------------------------------------------


def test_exact_accepts_identical_run():
    decision = check(OPDConfig(), OPDConfig(), saved_world_size=2, world_size=2)
    assert decision == ResumeDecision(
        mode="exact", rollout_limit_changed=False, accepted_changes=()
    )


def test_exact_accepts_execution_only_change_since_fingerprint_ignores_it():
    current = make_config("exact", **{"execution.num_workers": 8, "checkpoint.dir": "gs://b/run"})
    assert check(OPDConfig(), current) == ResumeDecision("exact", False, ())


def test_exact_refuses_math_change_naming_fields_and_fingerprints():
    parent = OPDConfig()
    current = make_config(
        "exact",
        **{"model.lora_rank": 32, "training.learning_rate": 2e-5, "execution.num_workers": 0},
    )
    message = refusal(parent=parent, current=current)
    assert "resume_mode 'exact': 3 refused difference(s)" in message
    fingerprints = f"saved '{parent.fingerprint()}', current '{current.fingerprint()}'"
    assert f"config_fingerprint: {fingerprints}" in message
    assert "model.lora_rank: saved 16, current 32" in message
    assert "training.learning_rate: saved 1e-05, current 2e-05" in message
    # Execution-only differences are reported, but not as a cause: they are outside the fingerprint.
    note = "also differing, execution-only and outside the fingerprint: execution.num_workers"
    assert note in message
    assert "execution.num_workers: saved" not in message
    assert "would accept" not in message


def test_exact_refuses_provenance_change_and_names_the_mode_that_would_accept():
    message = refusal(
        parent=OPDConfig(),
        current=OPDConfig(),
        provenance={**PROVENANCE, "code_revision": "9d0e4b7"},
    )
    assert "provenance.code_revision: saved '3f2a9c1', current '9d0e4b7'" in message
    assert "resume_mode 'execution_change' would accept these changes" in message


def test_exact_refuses_rollout_limit_change_and_names_rollout_limit_change():
    current = make_config("exact", **{"rollout.rollout_limit": 12})
    message = refusal(parent=OPDConfig(), current=current)
    assert "rollout.rollout_limit: saved 8, current 12" in message
    assert "resume_mode 'rollout_limit_change' would accept these changes" in message


def test_exact_refuses_without_config_yaml():
    message = refusal(
        parent=OPDConfig(),
        current=make_config("exact", **{"model.lora_rank": 4}),
        with_config_yaml=False,
    )
    assert "config_fingerprint" in message
    assert "changed fields unknown" in message


# --- execution_change ---------------------------------------------------------------------------


def test_execution_change_accepts_execution_only_fields_and_provenance():
    parent = make_config("exact")
    current = make_config(
        "execution_change",
        **{
            "execution.inference_batch_size": 64,
            "execution.rollout_workers": 4,
            "logging.log_dir": "/scratch/logs",
            "checkpoint.every_updates": 10,
        },
    )
    # Execution-only fields are not in the fingerprint, so force the diff through a stale one.
    decision = check(
        parent,
        current,
        provenance={**PROVENANCE, "code_revision": "9d0e4b7"},
        saved_fingerprint="0" * 64,
    )
    assert decision == ResumeDecision(
        mode="execution_change",
        rollout_limit_changed=False,
        accepted_changes=(
            "checkpoint.every_updates",
            "checkpoint.resume_mode",
            "execution.inference_batch_size",
            "execution.rollout_workers",
            "logging.log_dir",
            "provenance.code_revision",
        ),
    )


def test_execution_change_accepts_provenance_only_change_without_diffing_config():
    decision = check(
        make_config("exact"),
        make_config("execution_change", **{"logging.log_every": 1}),
        provenance={**PROVENANCE, "code_revision": "9d0e4b7"},
    )
    assert decision == ResumeDecision("execution_change", False, ("provenance.code_revision",))


def test_execution_change_accepts_added_execution_only_provenance_key():
    saved = {key: value for key, value in PROVENANCE.items() if key != "code_revision"}
    decision = check(OPDConfig(), make_config("execution_change"), saved_provenance=saved)
    assert decision.accepted_changes == ("provenance.code_revision",)


@pytest.mark.parametrize(
    ("dotted", "expected"),
    [
        (
            {"model.lora_rank": 8},
            "model.lora_rank: saved 16, current 8 (not marked execution-only)",
        ),
        (
            {"training.betas": [0.9, 0.95]},
            "training.betas: saved [0.9, 0.999], current [0.9, 0.95] (not marked execution-only)",
        ),
        (
            {"rollout.rollout_limit": 4},
            "rollout.rollout_limit: saved 8, current 4 (the rollout limit may change only under "
            "resume_mode 'rollout_limit_change')",
        ),
    ],
)
def test_execution_change_refuses_math_and_rollout_limit(dotted, expected):
    message = refusal(parent=OPDConfig(), current=make_config("execution_change", **dotted))
    assert "resume_mode 'execution_change'" in message
    assert expected in message


@pytest.mark.parametrize(
    ("provenance", "expected"),
    [
        (
            {**PROVENANCE, "teacher_weights": "sha256:other"},
            "provenance.teacher_weights: saved 'sha256:teacher', current 'sha256:other'",
        ),
        (
            {**PROVENANCE, "tokenizer": "sha256:tok"},
            "provenance.tokenizer: saved <absent>, current 'sha256:tok'",
        ),
        (
            {key: value for key, value in PROVENANCE.items() if key != "dataset"},
            "provenance.dataset: saved 'sha256:data', current <absent>",
        ),
    ],
)
def test_execution_change_refuses_provenance_change_added_or_removed(provenance, expected):
    current = make_config("execution_change")
    message = refusal(parent=OPDConfig(), current=current, provenance=provenance)
    assert f"{expected} (provenance key not marked execution-only)" in message


def test_every_refused_difference_is_named_in_one_error():
    current = make_config(
        "execution_change",
        **{
            "model.lora_rank": 64,
            "training.learning_rate": 5e-6,
            "rollout.rollout_limit": 2,
            "execution.num_workers": 0,
        },
    )
    message = refusal(
        parent=OPDConfig(),
        current=current,
        provenance={**PROVENANCE, "teacher_weights": "sha256:other", "code_revision": "9d0e4b7"},
    )
    assert "4 refused difference(s)" in message
    assert "model.lora_rank: saved 16, current 64" in message
    assert "training.learning_rate: saved 1e-05, current 5e-06" in message
    assert "rollout.rollout_limit: saved 8, current 2" in message
    assert "provenance.teacher_weights: saved 'sha256:teacher', current 'sha256:other'" in message
    assert (
        "accepted (execution-only): checkpoint.resume_mode, execution.num_workers, "
        "provenance.code_revision"
    ) in message


def test_execution_change_without_config_yaml_refuses_config_change():
    message = refusal(
        parent=OPDConfig(),
        current=make_config("execution_change", **{"model.lora_rank": 4}),
        with_config_yaml=False,
    )
    assert "has no config.yaml" in message
    assert "config_fingerprint" in message


def test_execution_change_without_config_yaml_still_judges_provenance():
    decision = check(
        OPDConfig(),
        make_config("execution_change"),
        provenance={**PROVENANCE, "code_revision": "9d0e4b7"},
        with_config_yaml=False,
    )
    assert decision == ResumeDecision("execution_change", False, ("provenance.code_revision",))


def test_fingerprint_mismatch_with_identical_dicts():
    # The config class changed how it fingerprints; every field is equal.
    current_exact = OPDConfig()
    message = refusal(parent=OPDConfig(), current=current_exact, saved_fingerprint="f" * 64)
    assert "fingerprint definition may have changed" in message
    assert "resume_mode 'execution_change' would accept these changes" in message
    same = make_config("execution_change")
    decision = check(same, make_config("execution_change"), saved_fingerprint="f" * 64)
    assert decision == ResumeDecision("execution_change", False, ())


def test_keys_present_on_one_side_only():
    saved = OPDConfig().as_dict()
    saved["logging"]["wandb_project"] = "opd"  # removed from the schema since: execution-only
    accepted, changed = validate_execution_change(
        saved, make_config("execution_change"), PROVENANCE, PROVENANCE,
        allow_rollout_limit_change=False, checkpoint_url=URL,
    )
    assert accepted == ("checkpoint.resume_mode", "logging.wandb_project")
    assert changed is False

    saved["training"]["kl_coef"] = 0.1  # a math key the current schema lacks
    del saved["execution"]  # a whole section missing is compared leaf by leaf
    with pytest.raises(ResumeMismatchError) as info:
        validate_execution_change(
            saved, make_config("execution_change"), PROVENANCE, PROVENANCE,
            allow_rollout_limit_change=False, checkpoint_url=URL,
        )
    message = str(info.value)
    assert "1 refused difference(s)" in message
    assert "training.kl_coef: saved 0.1, current <absent> (not marked execution-only)" in message
    assert "execution.num_workers" in message.split("accepted (execution-only):")[1]


def test_saved_config_that_is_not_a_mapping_is_refused():
    with pytest.raises(ResumeMismatchError, match="config.yaml is a list, not a mapping"):
        validate_execution_change(
            ["model"], OPDConfig(), PROVENANCE, PROVENANCE,
            allow_rollout_limit_change=True, checkpoint_url=URL,
        )


# --- rollout_limit_change -----------------------------------------------------------------------


def test_rollout_limit_change_accepts_new_limit():
    current = make_config("rollout_limit_change", **{"rollout.rollout_limit": 16})
    decision = check(OPDConfig(), current)
    assert decision == ResumeDecision(
        mode="rollout_limit_change",
        rollout_limit_changed=True,
        accepted_changes=("checkpoint.resume_mode", "rollout.rollout_limit"),
    )


def test_rollout_limit_change_with_same_limit_reports_no_change():
    decision = check(
        OPDConfig(),
        make_config("rollout_limit_change", **{"execution.num_workers": 1}),
        provenance={**PROVENANCE, "code_revision": "9d0e4b7"},
    )
    assert decision == ResumeDecision("rollout_limit_change", False, ("provenance.code_revision",))


def test_cap_flag_survives_a_later_provenance_change():
    """The seed re-validated per key, so the provenance key (checked after the fingerprint) could
    reset the cap-change flag. All differences are decided at once here."""
    decision = check(
        OPDConfig(),
        make_config("rollout_limit_change", **{"rollout.rollout_limit": 3}),
        provenance={**PROVENANCE, "code_revision": "9d0e4b7"},
    )
    assert decision.rollout_limit_changed is True
    assert decision.accepted_changes == (
        "checkpoint.resume_mode",
        "rollout.rollout_limit",
        "provenance.code_revision",
    )
    # Same through the lower-level function.
    accepted, changed = validate_execution_change(
        OPDConfig().as_dict(),
        make_config("rollout_limit_change", **{"rollout.rollout_limit": 3}),
        PROVENANCE,
        {**PROVENANCE, "code_revision": "9d0e4b7"},
        allow_rollout_limit_change=True,
    )
    assert changed is True
    assert accepted[-1] == "provenance.code_revision"


def test_rollout_limit_change_refuses_other_math_changes():
    message = refusal(
        parent=OPDConfig(),
        current=make_config(
            "rollout_limit_change", **{"rollout.rollout_limit": 16, "rollout.temperature": 0.6}
        ),
    )
    assert "resume_mode 'rollout_limit_change'" in message
    assert "1 refused difference(s)" in message
    assert "rollout.temperature: saved 1.0, current 0.6 (not marked execution-only)" in message
    assert "rollout.rollout_limit" in message.split("accepted (execution-only):")[1]


# --- configs that offer only fingerprint() and as_dict() ----------------------------------------


class BareConfig:
    """The seed's config contract: fingerprint() and as_dict(), no markings."""

    def __init__(self, values: dict, mode: str | None = None):
        self.values = values
        if mode is not None:
            self.checkpoint = types.SimpleNamespace(resume_mode=mode)

    def as_dict(self) -> dict:
        return self.values

    def fingerprint(self) -> str:
        return "fp-" + repr(sorted(self.values.items()))


@pytest.mark.parametrize("mode", RESUME_MODES)
def test_bare_config_accepts_only_an_unchanged_run(mode):
    values = {"lr": 1e-5, "workers": 2}
    decision = check(BareConfig(dict(values)), BareConfig(dict(values), mode))
    assert decision == ResumeDecision(mode, False, ())


@pytest.mark.parametrize("mode", RESUME_MODES)
def test_bare_config_refuses_any_config_change(mode):
    message = refusal(
        parent=BareConfig({"lr": 1e-5, "workers": 2}),
        current=BareConfig({"lr": 1e-5, "workers": 4}, mode),
    )
    assert "config type BareConfig declares no execution-only markings" in message
    assert "workers: saved 2, current 4" in message


@pytest.mark.parametrize("mode", RESUME_MODES)
def test_bare_config_refuses_any_provenance_change(mode):
    message = refusal(
        parent=BareConfig({"lr": 1e-5}),
        current=BareConfig({"lr": 1e-5}, mode),
        provenance={**PROVENANCE, "code_revision": "9d0e4b7"},
    )
    assert "declares no execution-only markings" in message
    assert "provenance.code_revision: saved '3f2a9c1', current '9d0e4b7'" in message


def test_bare_config_refused_by_validate_execution_change():
    with pytest.raises(ResumeMismatchError, match="declares no execution-only markings"):
        validate_execution_change(
            {"workers": 2}, BareConfig({"workers": 3}), {}, {}, allow_rollout_limit_change=True
        )
    assert validate_execution_change(
        {"workers": 2}, BareConfig({"workers": 2}), {}, {}, allow_rollout_limit_change=True
    ) == ((), False)


class DuckConfig:
    """A non-pydantic config with markings through the duck-typed hooks; as_dict returns tuples."""

    execution_only_provenance = "code_revision"

    def __init__(self, values: dict, mode: str = "rollout_limit_change"):
        self.values = values
        self.checkpoint = types.SimpleNamespace(resume_mode=mode)

    def as_dict(self) -> dict:
        return self.values

    def fingerprint(self) -> str:
        return repr(sorted((k, v) for k, v in self.values.items() if k != "run"))

    def execution_only_paths(self):
        return ["run"]

    def rollout_limit_path(self):
        return "limits.max_turns"


def test_duck_typed_config_with_markings():
    parent = {"modules": ("q", "v"), "limits": {"max_turns": 4}, "run": {"workers": 1}}
    current = DuckConfig({"modules": ("q", "v"), "limits": {"max_turns": 6}, "run": {"workers": 3}})
    decision = validate_resume(
        checkpoint_url=URL,
        saved_config_fingerprint=DuckConfig(parent).fingerprint(),
        saved_provenance={"code_revision": "a"},
        saved_world_size=1,
        saved_config_dict=yaml.safe_load(yaml.safe_dump({**parent, "modules": ["q", "v"]})),
        config=current,
        provenance_fingerprints={"code_revision": "b"},
        world_size=1,
    )
    # The tuple in as_dict() equals the list read back from config.yaml.
    assert decision == ResumeDecision(
        "rollout_limit_change",
        True,
        ("limits.max_turns", "run.workers", "provenance.code_revision"),
    )
