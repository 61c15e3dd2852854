"""The OPD training config: a pydantic schema that knows which of its fields change the math.

``fingerprint()`` and ``as_dict()`` are the seed's config contract. Markings live in pydantic
field metadata (``json_schema_extra``), next to the field: :data:`EXECUTION_ONLY_KEY` (changes how
or where, not what is computed; left out of the fingerprint; a marked section covers its fields)
and :data:`ROLLOUT_LIMIT_KEY` (the stopping rule: in the fingerprint, changeable under
``rollout_limit_change``). Execution-only provenance keys are a class variable so YAML cannot
widen them. :mod:`opd_store.opd._resume` reads the markings through duck-typed hooks.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticUndefined

EXECUTION_ONLY_KEY = "execution_only"
"""``json_schema_extra`` key marking a field (or a whole section) execution-only."""

ROLLOUT_LIMIT_KEY = "rollout_limit"
"""``json_schema_extra`` key marking the rollout limit (stopping rule) field."""

ResumeMode = Literal["exact", "execution_change", "rollout_limit_change", "elastic"]
"""Resume modes; must equal ``opd_store.opd._resume.RESUME_MODES`` (a test checks it)."""


def execution_only(default: Any = PydanticUndefined, **kwargs: Any) -> Any:
    """A pydantic ``Field`` marked execution-only (left out of the fingerprint).

    Args:
        default (Any): as for ``pydantic.Field`` (omit it for ``default_factory`` or a required field).
        **kwargs: passed to ``pydantic.Field``.

    Returns:
        pydantic.fields.FieldInfo: with ``json_schema_extra={"execution_only": True}``.
    """
    return Field(default, json_schema_extra={EXECUTION_ONLY_KEY: True}, **kwargs)


def _marks(field: Any) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _marked_paths(model: type[BaseModel], key: str, prefix: str = "") -> list[str]:
    """Dotted paths of fields whose metadata sets ``key``; a marked section is not descended."""
    found: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if _marks(field).get(key):
            found.append(path)
            continue
        section = _section_type(field.annotation)
        if section is not None:
            found.extend(_marked_paths(section, key, f"{path}."))
    return found


def _without_paths(data: dict[str, Any], paths: tuple[str, ...]) -> dict[str, Any]:
    """A deep copy of ``data`` without the dotted ``paths`` (and what is under them)."""
    pruned = json.loads(json.dumps(data))
    for path in paths:
        *parents, leaf = path.split(".")
        node = pruned
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return pruned


class _Section(BaseModel):
    """Base of every config section: unknown keys are refused, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    """Student and teacher models and the student's LoRA adapter (all change the math)."""

    student: str = Field("Qwen/Qwen2.5-1.5B-Instruct", min_length=1, description="student model id")
    teacher: str = Field("Qwen/Qwen2.5-7B-Instruct", min_length=1, description="teacher model id")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0)
    lora_dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: tuple[str, ...] = Field(("q_proj", "k_proj", "v_proj", "o_proj"), min_length=1)


class TrainingSection(_Section):
    """Optimiser, schedule and loss of the distillation updates (all change the math)."""

    seed: int = 0
    learning_rate: float = Field(1e-5, gt=0)
    warmup_updates: int = Field(10, ge=0)
    total_updates: int = Field(1000, ge=1)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max gradient norm; None disables")
    loss: Literal["reverse_kl", "forward_kl", "jsd"] = "reverse_kl"
    queries_per_update: int = Field(8, ge=1)
    rollouts_per_query: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _check(self) -> TrainingSection:
        if self.warmup_updates > self.total_updates:
            raise ValueError(
                f"warmup_updates ({self.warmup_updates}) exceeds "
                f"total_updates ({self.total_updates})"
            )
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        return self


class RolloutSection(_Section):
    """How the student samples rollouts; ``rollout_limit`` is the stopping rule."""

    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(1024, ge=1, description="tokens generated per turn")
    rollout_limit: int = Field(
        8,
        ge=1,
        description=(
            "stopping rule: the most turns a rollout runs before it is stopped; validation scores "
            "depend on it, so changing it on resume resets the validation baseline"
        ),
        json_schema_extra={ROLLOUT_LIMIT_KEY: True},
    )


class ExecutionSection(_Section):
    """Worker counts and inference batch sizes: how the work is spread, not what is computed (none
    depends on the world size, which the checkpoint records separately).
    """

    rollout_workers: int = Field(1, ge=1, description="student generation workers per rank")
    teacher_workers: int = Field(1, ge=1, description="teacher scoring workers per rank")
    num_workers: int = Field(2, ge=0, description="data-loader worker processes")
    inference_batch_size: int = Field(32, ge=1, description="student generation batch size")
    teacher_inference_batch_size: int = Field(16, ge=1, description="teacher scoring batch size")


class LoggingSection(_Section):
    """Where and how often metrics are written."""

    log_every: int = Field(10, ge=1, description="updates between metric logs")
    log_dir: str = "logs"
    run_name: str | None = None


class CheckpointSection(_Section):
    """Checkpoint cadence, location, retention and the resume mode."""

    dir: str = Field("checkpoints", min_length=1, description="local path or fsspec URL")
    every_updates: int = Field(50, ge=1, description="successful updates between checkpoints")
    keep_last: int | None = Field(3, ge=1, description="newest checkpoints kept; None keeps all")
    keep_every: int | None = Field(
        None, ge=1, description="also keep every checkpoint whose step is a multiple of this"
    )
    resume_mode: ResumeMode = "exact"

    def retention_policy(self) -> "RetentionPolicy":
        """The retention policy of this section, for ``save_opd_checkpoint(retention=...)``."""
        from ..retention import RetentionPolicy

        return RetentionPolicy(keep_last=self.keep_last, keep_every=self.keep_every)


class OPDConfig(_Section):
    """The whole OPD training config; ``OPDConfig()`` is valid (every field has a default).

    ``execution``, ``logging`` and ``checkpoint`` are execution-only; ``rollout.rollout_limit`` is the
    rollout limit; everything else changes the math.

    Attributes:
        execution_only_provenance (ClassVar[tuple[str, ...]]): provenance keys that may differ under
            ``execution_change`` and ``rollout_limit_change`` (the code revision); subclass to change.
    """

    execution_only_provenance: ClassVar[tuple[str, ...]] = ("code_revision",)

    model: ModelSection = Field(default_factory=ModelSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    execution: ExecutionSection = execution_only(default_factory=ExecutionSection)
    logging: LoggingSection = execution_only(default_factory=LoggingSection)
    checkpoint: CheckpointSection = execution_only(default_factory=CheckpointSection)

    @classmethod
    def execution_only_paths(cls) -> tuple[str, ...]:
        """Dotted paths of the execution-only fields and sections, in declaration order; a path covers
        everything beneath it (``("execution", "logging", "checkpoint")`` for ``OPDConfig``).
        """
        return tuple(_marked_paths(cls, EXECUTION_ONLY_KEY))

    @classmethod
    def rollout_limit_path(cls) -> str | None:
        """Dotted path of the field marked as the rollout limit, or ``None`` if none is marked.

        Raises:
            TypeError: more than one field is marked (a schema bug: the resume rule needs one).
        """
        paths = _marked_paths(cls, ROLLOUT_LIMIT_KEY)
        if len(paths) > 1:
            raise TypeError(f"{cls.__name__} marks several rollout-limit fields: {paths}")
        return paths[0] if paths else None

    def as_dict(self) -> dict[str, Any]:
        """All fields as plain JSON types (tuples become lists), in declaration order: what the
        checkpoint writes to ``config.yaml`` (the seed's contract).
        """
        return self.model_dump(mode="json")

    def fingerprint(self) -> str:
        """SHA-256 (64 lowercase hex digits) of the canonical JSON (sorted keys, no whitespace, ASCII) of
        the fields that change the math, the rollout limit included (the seed's contract).
        """
        math_fields = _without_paths(self.as_dict(), self.execution_only_paths())
        canonical = json.dumps(
            math_fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()


__all__ = [
    "EXECUTION_ONLY_KEY",
    "ROLLOUT_LIMIT_KEY",
    "CheckpointSection",
    "ExecutionSection",
    "LoggingSection",
    "ModelSection",
    "OPDConfig",
    "ResumeMode",
    "RolloutSection",
    "TrainingSection",
    "execution_only",
]
