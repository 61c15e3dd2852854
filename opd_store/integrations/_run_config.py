"""A trainer run's config in the shape the OPD layer's resume rules judge.

:func:`opd_store.opd._resume.validate_resume` decides whether a run may resume a checkpoint from a
config object offering ``fingerprint()``, ``as_dict()`` and the execution-only markings
(``execution_only_paths()``, ``rollout_limit_path()``, ``execution_only_provenance``) plus
``checkpoint.resume_mode``. :class:`RunConfig` gives a framework run that shape, so a Hugging Face
``Trainer`` or a Lightning run is refused or accepted by the same rules, with the same messages
(each differing field by dotted path, saved and current value), as an OPD checkpoint
(docs/resume.md). No second comparison is written here.

``as_dict()`` holds two sections: ``training_args`` (for the Hugging Face Trainer, every field of
``TrainingArguments``, TRL's configs included) and ``model`` (the model's config, and the PEFT
adapter's configs under ``model.peft``). Which of them are execution-only (do not change the math,
so a resume may change them under ``execution_change``) is listed in
:data:`TRAINING_ARGS_EXECUTION_ONLY`; everything else, unknown future fields included, counts as
changing the math, so a new field can only make the check stricter.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ..opd import RESUME_MODES

TRAINING_ARGS_EXECUTION_ONLY: tuple[str, ...] = (
    # where and how often things are written or shown
    "output_dir", "overwrite_output_dir", "logging_dir", "logging_strategy", "logging_steps",
    "logging_first_step", "logging_nan_inf_filter", "log_level", "log_level_replica", "log_on_each_node",
    "disable_tqdm", "report_to", "run_name", "project", "trackio_space_id", "trackio_bucket_id",
    "trackio_static_space_id", "skip_memory_metrics", "include_num_input_tokens_seen",
    "include_tokens_per_second",
    # checkpoint cadence, location and retention (opd_store's retention is separate)
    "save_strategy", "save_steps", "save_total_limit", "save_safetensors", "save_on_each_node",
    "save_only_model", "resume_from_checkpoint", "enable_jit_checkpoint", "restore_callback_states_from_checkpoint",
    "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push",
    "hub_revision",
    # how work is spread over processes (the world size is compared separately)
    "local_rank", "ddp_backend", "ddp_timeout", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
)
"""``TrainingArguments`` fields a resume may change under ``execution_change`` (logging, checkpoint
cadence and location, process layout and loader workers, as ``OPDConfig`` marks its ``execution``,
``logging`` and ``checkpoint`` sections). Worker counts are here because ``torch.utils.data`` draws
the sample order in the main process whatever the count; a dataset that draws random numbers inside
its workers makes them change the math, and such a run should resume under ``exact``."""

MODEL_EXECUTION_ONLY: tuple[str, ...] = ("transformers_version", "_name_or_path", "_commit_hash")
"""Model config keys that name where a model came from, not what it computes."""

FILLED_BY_SAVE_PRETRAINED: tuple[str, ...] = ("architectures", "dtype", "torch_dtype")
"""Model config keys ``PreTrainedModel.save_pretrained`` overwrites on the live config at every save
(the model's class name, its parameters' dtype; ``torch_dtype`` before transformers 5). They are
recorded as that save writes them, so a run records the same config before and after its first
save: a new ``Trainer`` in the same process (a retry after a crash, ``auto_find_batch_size``)
otherwise differed from its own checkpoints in these two fields. A recorded ``None`` (a manifest
written before this rule, taken before the first save) reads as "not filled yet"."""

TRAINER_RESUME_MODES: tuple[str, ...] = tuple(mode for mode in RESUME_MODES if mode != "elastic")
"""The resume modes a Hugging Face ``Trainer`` run accepts: not ``elastic``. The Trainer restores
each rank's ``rng_state_{rank}.pth`` and its data position itself, so the OPD layer's elastic
policy (derived RNG for new ranks, a global sample position; docs/resume.md, "Elastic resume")
cannot hold there; a world-size change is refused instead of accepted half-done."""


def plain_json(value: Any) -> Any:
    """``value`` as deterministic JSON types: mappings with str keys, lists (sets sorted), enums as
    their value, numbers, strings, bools, ``None``; anything else as ``str(value)`` (dtypes,
    devices, paths). The same input gives the same output in every process."""
    if isinstance(value, enum.Enum):
        return plain_json(value.value)
    if isinstance(value, Mapping):
        return {str(key): plain_json(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((plain_json(item) for item in value), key=lambda item: json.dumps(item, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [plain_json(item) for item in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_json(dataclasses.asdict(value))
    return str(value)


def _redact(section: dict[str, Any]) -> dict[str, Any]:
    # Never let a credential reach a manifest (transformers already masks hub_token as "<HUB_TOKEN>").
    return {key: ("<redacted>" if key.endswith("_token") and value not in (None, "") else value)
            for key, value in section.items()}


@dataclasses.dataclass
class RunConfig:
    """A framework run's config for :func:`opd_store.opd._resume.validate_resume`.

    Attributes:
        sections (dict): ``{"training_args": {...}, "model": {...}}`` as plain JSON.
        execution_only (tuple[str, ...]): dotted paths a resume may change under ``execution_change``.
        provenance (dict[str, str]): library versions (``torch``, ``transformers``, ...); marked
            execution-only, so ``exact`` refuses a change and ``execution_change`` accepts it.
        resume_mode (str): one of ``exact``, ``execution_change``, ``rollout_limit_change``.

    Raises:
        ValueError: an unknown resume mode.
    """

    sections: dict[str, Any]
    execution_only: tuple[str, ...] = ()
    provenance: dict[str, str] = dataclasses.field(default_factory=dict)
    resume_mode: str = "exact"

    def __post_init__(self) -> None:
        if self.resume_mode not in RESUME_MODES:
            raise ValueError(f"unknown resume_mode {self.resume_mode!r}; expected one of {list(RESUME_MODES)}")
        self.sections = plain_json(self.sections)

    # -- the duck-typed config interface of opd_store.opd._resume -------------------------------
    @property
    def checkpoint(self) -> dict[str, str]:
        return {"resume_mode": self.resume_mode}

    @property
    def execution_only_provenance(self) -> tuple[str, ...]:
        return tuple(self.provenance)

    def execution_only_paths(self) -> tuple[str, ...]:
        return self.execution_only

    def rollout_limit_path(self) -> None:
        return None

    def as_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.sections))

    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON (sorted keys, no spaces, ASCII) of every field that is not
        execution-only (the definition of ``OPDConfig.fingerprint``)."""
        pruned = self.as_dict()
        for path in self.execution_only:
            *parents, leaf = path.split(".")
            node = pruned
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(leaf, None)
        canonical = json.dumps(pruned, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()

    # -- what a manifest records ------------------------------------------------------------
    def to_metadata(self, world_size: int) -> dict[str, Any]:
        """The manifest metadata entry ``run_config`` (read back by :func:`saved_run_config`)."""
        return {"fingerprint": self.fingerprint(), "config": self.as_dict(), "provenance": dict(self.provenance),
                "world_size": world_size}


def library_versions(*names: str) -> dict[str, str]:
    """``{name + "_version": version}`` of the installed distributions among ``names``."""
    from importlib import metadata

    versions = {}
    for name in names:
        try:
            versions[f"{name}_version"] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def check_trainer_resume_mode(resume_mode: str) -> str:
    """``resume_mode`` when a Hugging Face ``Trainer`` run may use it (:data:`TRAINER_RESUME_MODES`).

    Raises:
        ValueError: ``elastic`` (one line saying why and what to use), or an unknown mode.
    """
    if resume_mode == "elastic":
        raise ValueError(
            "resume_mode 'elastic' is not supported with the Hugging Face Trainer: the Trainer restores each rank's "
            "rng_state_{rank}.pth and data position itself, so no elastic RNG or data policy can apply; resume at "
            "the saved world size under 'exact' or 'execution_change' (docs/integrations.md)")
    if resume_mode not in TRAINER_RESUME_MODES:
        raise ValueError(f"unknown resume_mode {resume_mode!r}; expected one of {list(TRAINER_RESUME_MODES)}")
    return resume_mode


def _as_saved(model: Any, section: dict[str, Any]) -> dict[str, Any]:
    """``section`` (a model config as a dict) with :data:`FILLED_BY_SAVE_PRETRAINED` as
    ``save_pretrained`` writes them: the unwrapped model's class name (a PEFT model's base model)
    and its parameters' dtype."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    section["architectures"] = [type(base).__name__.removeprefix("FSDP")]
    dtype = getattr(base, "dtype", None)
    if dtype is not None:
        for key in ("dtype", "torch_dtype"):
            if key in section or (key == "dtype" and "torch_dtype" not in section):
                section[key] = str(dtype).split(".")[-1]
    return section


def trainer_run_config(args: Any, model: Any, *, resume_mode: str = "exact") -> RunConfig:
    """The :class:`RunConfig` of a Hugging Face ``Trainer`` run.

    Args:
        args (transformers.TrainingArguments): the run's arguments (TRL's configs are subclasses).
        model (torch.nn.Module | None): the trained model; its ``config`` (a ``PretrainedConfig``)
            and, for a PEFT model, its ``peft_config`` are recorded.
        resume_mode (str): see :class:`RunConfig`.
    """
    training_args = _redact(json.loads(args.to_json_string()))
    model_section: dict[str, Any] = {}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        model_section = _as_saved(model, dict(config.to_dict()))
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, Mapping):
        model_section["peft"] = {name: (cfg.to_dict() if hasattr(cfg, "to_dict") else cfg) for name, cfg in peft.items()}
    execution_only = tuple(f"training_args.{name}" for name in TRAINING_ARGS_EXECUTION_ONLY) + tuple(
        f"model.{name}" for name in MODEL_EXECUTION_ONLY
    ) + tuple(f"model.peft.{name}.{key}" for name in (peft or {}) for key in ("base_model_name_or_path", "revision"))
    return RunConfig(
        sections={"training_args": training_args, "model": model_section},
        execution_only=execution_only,
        provenance=library_versions("torch", "transformers", "peft", "trl", "accelerate"),
        resume_mode=resume_mode,
    )


def check_resume(saved: Mapping[str, Any] | None, current: RunConfig, *, checkpoint_url: str, world_size: int):
    """Refuse or accept resuming a checkpoint whose manifest recorded ``saved`` (see
    :meth:`RunConfig.to_metadata`), by the OPD layer's rules.

    Returns:
        opd_store.opd._resume.ResumeDecision: the accepted decision.

    Raises:
        ResumeMismatchError: another run's checkpoint (names every differing field), a checkpoint
            with no recorded config under ``exact`` when the config cannot be compared, or another
            world size.
    """
    from ..opd import validate_resume

    saved = saved if isinstance(saved, Mapping) else {}
    fingerprint = str(saved.get("fingerprint", "<not recorded>"))
    config = saved.get("config") if isinstance(saved.get("config"), Mapping) else None
    model = config.get("model") if config is not None else None
    current_model = current.sections.get("model", {})
    unfilled = [key for key in FILLED_BY_SAVE_PRETRAINED
                if isinstance(model, Mapping) and key in model and model[key] is None and key in current_model]
    if unfilled:  # recorded before the first save filled them: read as this run's (see FILLED_BY_SAVE_PRETRAINED)
        config = {**config, "model": {**model, **{key: current_model[key] for key in unfilled}}}
        fingerprint = RunConfig(dict(config), current.execution_only, resume_mode=current.resume_mode).fingerprint()
    return validate_resume(
        checkpoint_url=checkpoint_url,
        saved_config_fingerprint=fingerprint,
        saved_provenance=dict(saved.get("provenance") or {}),
        saved_world_size=int(saved.get("world_size", world_size)),
        saved_config_dict=config,
        config=current,
        provenance_fingerprints=dict(current.provenance),
        world_size=world_size,
    )


__all__ = ["FILLED_BY_SAVE_PRETRAINED", "MODEL_EXECUTION_ONLY", "TRAINER_RESUME_MODES", "TRAINING_ARGS_EXECUTION_ONLY",
           "RunConfig", "check_resume", "check_trainer_resume_mode", "library_versions", "plain_json",
           "trainer_run_config"]
