"""The snapshot stage of an OPD save: check the seed's rules, capture the RNG first, then the state.

Nothing is written here; the synchronous, asynchronous and multi-rank saves all start with
:func:`snapshot_opd_checkpoint` (the asynchronous one with a ``stage`` copy function).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from ..format import step_dirname
from ..retention import RetentionPolicy, RunLineage, check_retention
from ..store import BaseStore, as_store
from ._names import FORBIDDEN_TRAINER_KEYS, REQUIRED_TRAINER_KEYS, SCHEMA_V1, SCHEMA_V2, check_world_size
from ._rng import capture_rng_state
from ._safe_load import plain_config_dict, sanitize_state


def check_trainer_state(trainer_state: Any, teacher_state: Any) -> int:
    """The seed's rules on what may be checkpointed; returns the step.

    Raises:
        ValueError: a state is not a mapping, lacks a counter, holds ``rollouts``/``failure_queue``,
            or the teacher's ``update_count`` differs from ``successful_updates``.
    """
    if not isinstance(trainer_state, Mapping):
        raise ValueError(f"OPD trainer state must be a mapping, got {type(trainer_state).__name__}")
    if not isinstance(teacher_state, Mapping):
        raise ValueError(f"OPD teacher state must be a mapping, got {type(teacher_state).__name__}")
    missing = sorted(set(REQUIRED_TRAINER_KEYS) - set(trainer_state))
    if missing:
        raise ValueError(f"OPD trainer state is missing {missing}")
    present = [key for key in FORBIDDEN_TRAINER_KEYS if key in trainer_state]
    if present:
        raise ValueError(
            "sampled rollouts and update-local failure queue are not checkpoint state "
            f"(trainer state has {present})"
        )
    successful = trainer_state["successful_updates"]
    if teacher_state.get("update_count") not in (None, successful):
        raise ValueError(
            f"teacher update count differs from successful OPD updates "
            f"({teacher_state.get('update_count')!r} != {successful!r})"
        )
    step = int(successful)
    step_dirname(step)  # ValueError for a negative step
    return step


def check_provenance(provenance: Any) -> dict[str, str]:
    """The provenance fingerprints as a plain ``dict[str, str]``.

    Raises:
        ValueError: anything else.
    """
    if not isinstance(provenance, Mapping) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in provenance.items()
    ):
        raise ValueError(f"provenance_fingerprints must be a dict[str, str], got {provenance!r:.200}")
    return dict(provenance)


def json_value(value: Any) -> Any:
    """``value`` if it survives JSON unchanged, else ``None`` (manifest metadata is JSON)."""
    try:
        return value if json.loads(json.dumps(value, allow_nan=False)) == value else None
    except (TypeError, ValueError):
        return None


def class_name(obj: Any) -> str | None:
    """The class name of ``obj`` (the manifest records the processor class), ``None`` for ``None``."""
    return None if obj is None else type(obj).__name__


@dataclasses.dataclass
class OpdSnapshot:
    """Everything one OPD checkpoint writes, captured at one instant.

    With a ``stage`` function (asynchronous save) every tensor is a private copy, so training may go
    on during the write; without one the tensors are the live ones.

    Attributes:
        store (BaseStore): where the checkpoint goes (plain or tiered).
        step (int): ``successful_updates``.
        world_size (int): ranks of the run.
        metadata (dict): the manifest metadata (JSON).
        training_state (dict): the ``training_state.pt`` payload.
        rng_payloads (dict[int, dict]): rank -> RNG state (every rank's, or this rank's in multi-rank).
        config_yaml (bytes): the ``config.yaml`` payload.
        model (Any): the student, or ``None`` when ``adapter_dir`` holds the adapter's files.
        adapter_state_dict (dict[str, torch.Tensor] | None): staged ``state_dict=`` for
            ``save_pretrained``; ``None``: the live model.
        adapter_dir (str | None): a staged adapter directory, removed by the write.
        processor (Any | None): tokenizer/processor with ``save_pretrained``.
        retention (RetentionPolicy | None): applied once the step is durable.
        lineage (RunLineage | None): run id and resume parent, for the retention pass.
    """

    store: BaseStore
    step: int
    world_size: int
    metadata: dict[str, Any]
    training_state: dict[str, Any]
    rng_payloads: dict[int, Any]
    config_yaml: bytes
    model: Any
    adapter_state_dict: dict[str, Any] | None
    adapter_dir: str | None
    processor: Any
    retention: RetentionPolicy | None = None
    lineage: RunLineage | None = None


def config_record(config: Any) -> tuple[str, bytes]:
    """``(fingerprint, config.yaml bytes)`` of a run's config, checked before anything is written.

    Raises:
        ValueError: ``fingerprint()`` is not a ``str``, or ``as_dict()`` is not plain YAML data (naming
            the key: a ``Path`` or enum would make ``config.yaml`` unloadable by ``yaml.safe_load``).
    """
    fingerprint = config.fingerprint()
    if not isinstance(fingerprint, str):
        raise ValueError(f"config.fingerprint() must return a str, got {type(fingerprint).__name__}")
    return fingerprint, yaml.safe_dump(plain_config_dict(config.as_dict()), sort_keys=False).encode("utf-8")


def manifest_metadata(*, schema: str, trainer_state: Mapping[str, Any], step: int, fingerprint: str,
                      provenance: dict[str, str], world_size: int, processor: Any,
                      lineage: RunLineage | None) -> dict[str, Any]:
    """The manifest metadata of an OPD checkpoint (readable without torch): schema, the trainer's
    counters, fingerprints, ``world_size``, the processor's class and the run's lineage."""
    metadata = {
        "opd_schema": schema,
        "attempted_updates": json_value(trainer_state["attempted_updates"]),
        "successful_updates": step,
        "query_update": json_value(trainer_state["query_update"]),
        "config_fingerprint": fingerprint,
        "provenance_fingerprints": provenance,
        "world_size": world_size,
        "processor_class": class_name(processor),
    }
    if lineage is not None:
        metadata.update(lineage.as_metadata())
    return metadata


def _accepts_state_dict(model: Any) -> bool:
    """Whether ``model.save_pretrained`` honours ``state_dict=`` (PEFT and transformers models)."""
    if isinstance(getattr(model, "peft_config", None), Mapping):
        return True  # PeftModel.save_pretrained(**kwargs) hands kwargs["state_dict"] to get_peft_model_state_dict
    try:
        return "state_dict" in inspect.signature(model.save_pretrained).parameters
    except (TypeError, ValueError):
        return False


def _stage_adapter(model: Any, stage: Callable[[Any], Any]) -> tuple[dict[str, Any] | None, str | None]:
    """Capture the adapter now: staged copies of trainable parameters and buffers (frozen ones are
    referenced), or ``save_pretrained``'s files in a temporary directory when it takes no
    ``state_dict``.
    """
    if _accepts_state_dict(model):
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        buffers = {name for name, _ in model.named_buffers()}
        live = model.state_dict()
        return {key: stage(value) if key in trainable or key in buffers else value for key, value in live.items()}, None
    directory = tempfile.mkdtemp(prefix="opd-adapter-")
    try:
        model.save_pretrained(directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return None, directory


def snapshot_opd_checkpoint(
    *,
    checkpoints_dir: str | os.PathLike | BaseStore,
    model: Any,
    processor: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict,
    config: Any,
    provenance_fingerprints: dict[str, str],
    teacher_state: dict,
    world_size: int = 1,
    rank_rng_states: list[dict] | None = None,
    storage_options: dict[str, Any] | None = None,
    retention: RetentionPolicy | None = None,
    lineage: RunLineage | None = None,
    stage: Callable[[Any], Any] | None = None,
    rank_rng_parts: dict[int, dict] | None = None,
) -> OpdSnapshot:
    """The snapshot phase of ``save_opd_checkpoint``: its arguments, rules and errors; nothing written.

    The caller wraps it in :func:`~opd_store.opd._rng.preserve_global_rng`.

    Args:
        stage (Callable | None): a ``Tensor -> Tensor`` copy applied to every state and the adapter's
            trainable tensors; ``None`` keeps the live tensors.
        rank_rng_parts (dict[int, dict] | None): multi-rank mode: this rank's RNG state by rank;
            ``rank_rng_states`` is then ignored and ``world_size`` is the group's.

    Returns:
        OpdSnapshot: what ``write_opd_checkpoint`` or the multi-rank stages write.

    Raises:
        ValueError: as ``save_opd_checkpoint``, and ``retention`` given for a store that applies its own.
    """
    if rank_rng_parts is None:
        own_rng = capture_rng_state() if rank_rng_states is None else None
        step = check_trainer_state(trainer_state, teacher_state)
        world_size = check_world_size(world_size)
        rng_states = [own_rng] if rank_rng_states is None else list(rank_rng_states)
        if len(rng_states) != world_size:
            raise ValueError(
                f"rank RNG states must match OPD world size: {len(rng_states)} state(s) for "
                f"world_size {world_size}"
            )
        rng_parts = dict(enumerate(rng_states))
    else:
        step = check_trainer_state(trainer_state, teacher_state)
        world_size = check_world_size(world_size)
        rng_parts = dict(rank_rng_parts)
    provenance = check_provenance(provenance_fingerprints)
    fingerprint, config_yaml = config_record(config)
    schema = SCHEMA_V1 if world_size == 1 else SCHEMA_V2
    training_state = {
        "schema": schema,
        "trainer": sanitize_state(trainer_state, path="trainer_state"),
        "optimizer": sanitize_state(optimizer.state_dict(), path="optimizer.state_dict()"),
        "scheduler": sanitize_state(scheduler.state_dict(), path="scheduler.state_dict()"),
        "config_fingerprint": fingerprint,
        "provenance_fingerprints": provenance,
        "world_size": world_size,
        "teacher": sanitize_state(teacher_state, path="teacher_state"),
    }
    rng_payloads = {
        rank: sanitize_state(state, path=f"rank_rng_states[{rank}]") for rank, state in rng_parts.items()
    }
    metadata = manifest_metadata(schema=schema, trainer_state=training_state["trainer"], step=step,
                                 fingerprint=fingerprint, provenance=provenance, world_size=world_size,
                                 processor=processor, lineage=lineage)
    store = as_store(checkpoints_dir, storage_options)
    if check_retention(retention) is not None and not retention.keeps_all:
        store.check_save_retention(retention)  # before anything is written
    adapter_state_dict, adapter_dir = None, None
    if stage is not None:
        training_state = stage(training_state)
        rng_payloads = stage(rng_payloads)
        adapter_state_dict, adapter_dir = _stage_adapter(model, stage)
    return OpdSnapshot(
        store=store,
        step=step,
        world_size=world_size,
        metadata=metadata,
        training_state=training_state,
        rng_payloads=rng_payloads,
        config_yaml=config_yaml,
        model=None if adapter_dir is not None else model,
        adapter_state_dict=adapter_state_dict,
        adapter_dir=adapter_dir,
        processor=processor,
        retention=retention,
        lineage=lineage,
    )


__all__ = ["OpdSnapshot", "check_provenance", "check_trainer_state", "class_name", "config_record", "json_value",
           "manifest_metadata", "snapshot_opd_checkpoint"]
