"""OPD checkpoints on the store: the seed's save/load contract on any store URL (issue 3, items 1-3).

One checkpoint per successful update count, ``step-NNNNNN`` under the checkpoints directory, with
the seed's payload names inside the committed attempt:

==========================  ====================================================================
``adapter/...``             ``model.save_pretrained`` output (the LoRA adapter), file by file
``processor/...``           ``processor.save_pretrained`` output, when a processor is given
``rng.pt``                  this process's RNG state (world size 1), or
``rng-rank-XX.pt``          one per rank (world size > 1, single-writer mode)
``training_state.pt``       schema ``opd_checkpoint_v1`` (one rank) or ``..._v2`` (several):
                            ``trainer``, ``optimizer``, ``scheduler``, ``config_fingerprint``,
                            ``provenance_fingerprints``, ``world_size``, ``teacher``
``config.yaml``             ``yaml.safe_dump(config.as_dict(), sort_keys=False)``
==========================  ====================================================================

The manifest's metadata repeats the trainer counters and fingerprints (readable without torch) and
names the processor class. The checkpoint exists exactly when its manifest does (the store's
commit), which replaces the seed's ``COMPLETE`` marker plus directory rename; seed-layout
directories (``COMPLETE`` marker, no manifest) still load with the same calls.

Every payload is written with ``torch.save`` straight into the transaction's writer (no whole
serialised copy in memory), without torch's own zip CRC-32 (:mod:`opd_store.torch_io`: the
payload's CRC32C in the manifest covers the bytes and is checked on every read; issue 2, about
2.5 s of CPU per GiB saved) and read back with ``torch.load(weights_only=True)`` through
:mod:`opd_store.opd.safe_load`; state is sanitised before saving, so nothing unloadable is ever
written. The whole save runs inside :func:`~opd_store.opd.rng.preserve_global_rng`.

Where a checkpoint is named, these are accepted: a local path or fsspec URL of the step prefix
(``/runs/a/step-000042``, ``s3://bucket/run/step-000042``), or a ``(CheckpointStore, step)`` pair.
A checkpoints directory is a local path, an fsspec URL or a :class:`CheckpointStore`.
"""

from __future__ import annotations

import dataclasses
import inspect
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union

import torch
import yaml

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, UnsafeCheckpointError
from ..layout import parse_step_dirname, step_dirname
from ..retention import RetentionPolicy, RunLineage
from ..store import COMPLETE, LEGACY, CheckpointStore, VerifyReport, as_store, split_checkpoint_url
from ..torch_io import torch_save
from .distributed import check_group_args, current_group, decide_on_rank0, load_collective, save_collective
from .resume import validate_resume
from .rng import capture_rng_state, preserve_global_rng, restore_rng_state
from .safe_load import load_payload, plain_config_dict, sanitize_state

logger = logging.getLogger("opd_store.opd.checkpoint")

SCHEMA_V1 = "opd_checkpoint_v1"
SCHEMA_V2 = "opd_checkpoint_v2"
SCHEMAS = (SCHEMA_V1, SCHEMA_V2)
TRAINING_STATE = "training_state.pt"
CONFIG_YAML = "config.yaml"
RNG_SINGLE = "rng.pt"
ADAPTER_DIR = "adapter"
PROCESSOR_DIR = "processor"
REQUIRED_TRAINER_KEYS = ("attempted_updates", "successful_updates", "query_update")
FORBIDDEN_TRAINER_KEYS = ("rollouts", "failure_queue")
VALIDATION_KEYS = ("validation_baseline", "last_validation_artifact", "validation_baseline_step")
_PAYLOAD_KEYS = (
    "trainer", "optimizer", "scheduler", "config_fingerprint", "provenance_fingerprints", "world_size", "teacher",
)
_PROCESSOR_MARKERS = ("tokenizer_config.json", "preprocessor_config.json", "processor_config.json")
_COPY_CHUNK_BYTES = 8 * 1024 * 1024

CheckpointRef = Union[str, os.PathLike, "tuple[CheckpointStore, int]"]


def rng_payload_name(rank: int, world_size: int) -> str:
    """Payload name of ``rank``'s RNG state: ``rng.pt`` for one rank, else ``rng-rank-XX.pt`` (seed)."""
    return RNG_SINGLE if world_size == 1 else f"rng-rank-{rank:02d}.pt"


def resolve_checkpoint(
    checkpoint: CheckpointRef, storage_options: dict[str, Any] | None = None
) -> tuple[CheckpointStore, int]:
    """Turn a checkpoint reference into ``(store, step)``.

    Args:
        checkpoint (str | os.PathLike | tuple[CheckpointStore, int]): the step prefix's local path
            or URL (as returned by :func:`save_opd_checkpoint` and
            :func:`latest_complete_checkpoint`), or a store and a step.
        storage_options (dict | None): fsspec options for a URL (ignored for a store).

    Raises:
        ValueError: the path does not end in a canonical ``step-NNNNNN`` name, or the step is
            not a non-negative int.
        TypeError: a bare :class:`CheckpointStore` (it names no step).
    """
    if isinstance(checkpoint, tuple) and len(checkpoint) == 2 and isinstance(checkpoint[0], CheckpointStore):
        store, step = checkpoint
        step_dirname(step)  # validates
        return store, step
    if isinstance(checkpoint, CheckpointStore):
        raise TypeError("a CheckpointStore names no checkpoint: pass (store, step) or the step's URL")
    text = os.fspath(checkpoint)
    if "://" not in text:
        # A local path: made absolute first, so a bare "step-000042" (in the working directory)
        # names its parent too (split_checkpoint_url refuses a path without a parent).
        path = Path(os.path.abspath(text))
        step = parse_step_dirname(path.name)
        if step is None:
            raise ValueError(f"not a checkpoint path (expected .../step-NNNNNN): {text}")
        return CheckpointStore(str(path.parent), storage_options=storage_options), step
    return split_checkpoint_url(checkpoint, storage_options)


def _require_complete(store: CheckpointStore, step: int) -> VerifyReport:
    """The step's report, or raise when it is not complete (manifest-committed or seed marker)."""
    report = store.verify(step)
    if report.status not in (COMPLETE, LEGACY):
        reasons = "; ".join(problem.detail for problem in report.problems) or report.status
        raise IncompleteCheckpointError(f"OPD checkpoint is incomplete: {report.url} ({report.status}: {reasons})")
    return report


def _check_pickle_opt_in(store: CheckpointStore, allow_pickle: bool, url: str) -> None:
    if allow_pickle and "://" in store.url:
        raise UnsafeCheckpointError(
            f"{url}: allow_pickle applies only to checkpoints in a local directory; payloads from "
            f"{store.url} are only ever loaded weights-only (a bucket checkpoint never runs code). "
            "Load the old checkpoint from its local directory, or migrate it after re-saving."
        )


# -- save ----------------------------------------------------------------------------------------


def _check_trainer_state(trainer_state: Any, teacher_state: Any) -> int:
    """The seed's rules on what may be checkpointed; returns the step."""
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


def _check_provenance(provenance: Any) -> dict[str, str]:
    if not isinstance(provenance, Mapping) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in provenance.items()
    ):
        raise ValueError(f"provenance_fingerprints must be a dict[str, str], got {provenance!r:.200}")
    return dict(provenance)


def _check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def _json_value(value: Any) -> Any:
    """``value`` if it survives JSON unchanged, else ``None`` (manifest metadata is JSON)."""
    try:
        return value if json.loads(json.dumps(value, allow_nan=False)) == value else None
    except (TypeError, ValueError):
        return None


def _class_name(obj: Any) -> str | None:
    return None if obj is None else type(obj).__name__


def _stream_pretrained(txn, obj: Any, directory: Path, prefix: str, state_dict: dict | None = None) -> None:
    """``obj.save_pretrained(directory)``, then every file into the transaction as ``prefix/...``."""
    if state_dict is None:
        obj.save_pretrained(str(directory))
    else:
        obj.save_pretrained(str(directory), state_dict=state_dict)
    _stream_directory(txn, directory, prefix, f"{type(obj).__name__}.save_pretrained")


def _stream_directory(txn, directory: Path, prefix: str, writer_name: str) -> None:
    """Every file under ``directory`` into the transaction as ``prefix/...``."""
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    if not files:
        raise ValueError(f"{writer_name} wrote no files")
    for path in files:
        name = f"{prefix}/{path.relative_to(directory).as_posix()}"
        with open(path, "rb") as source, txn.open(name) as writer:
            shutil.copyfileobj(source, writer, _COPY_CHUNK_BYTES)


def _save_torch(txn, name: str, obj: Any) -> None:
    with txn.open(name) as writer:
        torch_save(obj, writer)


def save_opd_checkpoint(
    *,
    checkpoints_dir: str | os.PathLike | CheckpointStore,
    model: Any,
    processor: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict,
    config: Any,
    provenance_fingerprints: dict[str, str],
    teacher_state: dict,
    world_size: int | None = None,
    rank_rng_states: list[dict] | None = None,
    storage_options: dict[str, Any] | None = None,
    retention: RetentionPolicy | None = None,
    lineage: RunLineage | None = None,
    rank: int | None = None,
) -> str:
    """Commit one OPD checkpoint after a complete update with a cleared failure queue.

    Rules (all from the seed unless noted; checked before anything is written):

    * ``trainer_state`` has ``attempted_updates``, ``successful_updates`` and ``query_update``;
    * it holds neither ``rollouts`` nor ``failure_queue`` (sampled rollouts and the update-local
      failure queue are not checkpoint state);
    * ``teacher_state["update_count"]``, when present (not ``None``), equals
      ``successful_updates``;
    * ``len(rank_rng_states) == world_size`` (when ``None``, this process's state is captured: one
      rank);
    * the step is ``successful_updates``; an existing committed step (or a seed-layout step
      directory) raises ``FileExistsError``;
    * trainer, teacher, optimizer, scheduler and RNG state are sanitised so weights-only loading
      restores them (issue 3, item 6): numpy values converted, anything else refused;
    * ``config.as_dict()`` is plain YAML data (numpy scalars converted, anything else refused
      naming its key; issue 5, scenario 36), checked before anything is written.

    Rank obligations, two modes:

    * Multi-rank mode (issue 7): a ``torch.distributed`` process group of more than one rank is
      initialised and ``rank_rng_states`` is ``None``. Every rank calls this with the same
      arguments except its own RNG state (captured here); rank 0 writes the shared payloads,
      every rank its own ``rng-rank-XX.pt``, and rank 0 commits once every part is durable
      (:mod:`opd_store.opd.distributed`). Every rank returns the same URL or raises the same error.
    * Single-writer mode (seed): only rank 0 calls this, after a barrier that ends the update on
      every rank, passing every rank's :func:`~opd_store.opd.rng.capture_rng_state` in rank order
      (``rank_rng_states[r]`` is rank ``r``'s). Other ranks must not call it.

    Every global RNG (Python, numpy, torch, CUDA) is left exactly as it was found, even when the
    storage retries (botocore's back-off draws from ``random``; issue 3, item 1). The RNG state
    saved for this process is captured first, before anything else runs.

    Args:
        checkpoints_dir (str | os.PathLike | CheckpointStore): local path, fsspec URL or store.
        model (Any): the student; ``model.save_pretrained(dir)`` writes the adapter (a PEFT model
            writes ``adapter_config.json`` and ``adapter_model.safetensors``).
        processor (Any | None): tokenizer/processor with ``save_pretrained``, or ``None``.
        optimizer (torch.optim.Optimizer): its ``state_dict()`` is saved (tensors on any device;
            they are restored onto the parameters' devices).
        scheduler (Any): LR scheduler with ``state_dict()``.
        trainer_state (dict): trainer counters and state (see the rules above).
        config (Any): offers ``fingerprint() -> str`` and ``as_dict() -> dict``.
        provenance_fingerprints (dict[str, str]): provenance name to fingerprint.
        teacher_state (dict): the teacher's state (``update_count`` optional).
        world_size (int | None): ranks of the run; schema v1 for 1, v2 above. Default: the process
            group's world size, or 1 without one; must equal the group's in multi-rank mode.
        rank_rng_states (list[dict] | None): per-rank RNG states, index = rank (single-writer mode).
        storage_options (dict | None): fsspec options when ``checkpoints_dir`` is a URL.
        retention (RetentionPolicy | None): applied only after this commit succeeded (issue 6;
            ``config.checkpoint.retention_policy()`` gives the config's); never deletes this step,
            the newest complete step, pinned steps or ``lineage.parent_step`` until this run has a
            second checkpoint. A failing retention pass is logged, not raised. ``None``: keep all.
        lineage (RunLineage | None): run id and resume parent, recorded in the manifest metadata
            (``run_id``, ``parent_step``).
        rank (int | None): this process's rank; default the process group's (must equal it).

    Returns:
        str: the committed checkpoint's URL (its step prefix; a plain absolute path for a local
        store), as accepted by :func:`load_opd_checkpoint` and :func:`load_adapter`.

    Raises:
        ValueError: a seed rule above is broken (missing keys, rollouts or failure queue in the
            state, teacher update count, RNG state count, bad world size or provenance).
        UnsafeCheckpointError: (a ``ValueError``) state that weights-only loading cannot restore,
            or a ``config.as_dict()`` value that is not plain YAML data (a path, an enum, ...);
            the message names its key path and how to convert it (issue 5, scenario 36).
        FileExistsError: the step is already committed, or holds a seed-layout checkpoint
            (:class:`~opd_store.errors.CommitConflictError`), including when another writer
            commits it first.
        opd_store.errors.CommitError: the commit failed (an ``OSError``); nothing is committed.
        opd_store.errors.DistributedSaveError: (multi-rank mode, a ``CommitError``) any rank's
            check or write failed, on every rank, naming each failing rank and its error;
            :class:`~opd_store.errors.DistributedCommitConflictError` (also a ``FileExistsError``)
            when the step is already committed. Nothing is committed.
        RuntimeError: (multi-rank mode) a rank died or the process group timed out mid-save.
    """
    group = None
    if rank_rng_states is None:
        group = current_group()  # the arguments are checked inside the first collective (no rank waits alone)
        if group is None:
            current_group(rank=rank, world_size=world_size)
    elif rank not in (None, 0):
        raise ValueError(f"single-writer mode (rank_rng_states given) runs on rank 0 only, not rank {rank}")
    snapshot_kwargs = dict(
        checkpoints_dir=checkpoints_dir, model=model, processor=processor, optimizer=optimizer,
        scheduler=scheduler, trainer_state=trainer_state, config=config,
        provenance_fingerprints=provenance_fingerprints, teacher_state=teacher_state,
        storage_options=storage_options, retention=retention, lineage=lineage,
    )
    with preserve_global_rng():
        if group is None:
            snapshot = snapshot_opd_checkpoint(
                **snapshot_kwargs, world_size=1 if world_size is None else world_size, rank_rng_states=rank_rng_states
            )
            return write_opd_checkpoint(snapshot)
        # Multi-rank mode (issue 7): every rank checks and writes its part; rank 0 commits.
        own_rng = capture_rng_state()
        snapshots: list[OpdSnapshot] = []

        def snapshot_this_rank() -> OpdSnapshot:
            check_group_args(group, rank=rank, world_size=world_size)
            snapshots.append(
                snapshot_opd_checkpoint(**snapshot_kwargs, world_size=group.world_size,
                                        rank_rng_parts={group.rank: own_rng})
            )
            return snapshots[-1]

        url = save_collective(group, snapshot_this_rank, _write_payloads)
        logger.info("committed OPD checkpoint %s (world size %d, rank %d)", url, group.world_size, group.rank)
        if group.rank == 0:
            _apply_retention(snapshots[-1])
        return url


@dataclasses.dataclass
class OpdSnapshot:
    """Everything one OPD checkpoint writes, captured at one instant (the snapshot phase of a save).

    Built by :func:`snapshot_opd_checkpoint`, written by :func:`write_opd_checkpoint`. With a
    ``stage`` function (the asynchronous save, issue 8) every tensor in ``training_state``,
    ``rng_payloads`` and ``adapter_state_dict`` is a private copy, so training may go on while it
    is written; without one (the synchronous save) tensors are the live ones.

    Attributes:
        store (CheckpointStore): where the checkpoint goes.
        step (int): ``successful_updates``.
        world_size (int): ranks of the run.
        metadata (dict): the manifest metadata (JSON).
        training_state (dict): the ``training_state.pt`` payload.
        rng_payloads (dict[int, dict]): rank to its RNG state: every rank's in single-writer mode,
            this rank's only in multi-rank mode (issue 7).
        config_yaml (bytes): the ``config.yaml`` payload.
        model (Any): the student (its ``save_pretrained`` writes the adapter), or ``None`` when
            ``adapter_dir`` already holds the adapter's files.
        adapter_state_dict (dict[str, torch.Tensor] | None): passed as ``state_dict=`` to
            ``model.save_pretrained`` (staged copies), or ``None`` to let it read the live model.
        adapter_dir (str | None): a directory the adapter was already written to (a staged save of
            a model whose ``save_pretrained`` takes no ``state_dict``); removed by the write.
        processor (Any | None): tokenizer/processor with ``save_pretrained``.
        retention (RetentionPolicy | None): applied after the commit (issue 6), or ``None``.
        lineage (RunLineage | None): run id and resume parent (already in ``metadata``), used by
            the retention pass.
    """

    store: CheckpointStore
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


def _accepts_state_dict(model: Any) -> bool:
    """Whether ``model.save_pretrained`` honours ``state_dict=`` (PEFT and transformers models)."""
    if isinstance(getattr(model, "peft_config", None), Mapping):
        return True  # PeftModel.save_pretrained(**kwargs) hands kwargs["state_dict"] to get_peft_model_state_dict
    try:
        return "state_dict" in inspect.signature(model.save_pretrained).parameters
    except (TypeError, ValueError):
        return False


def _stage_adapter(model: Any, stage: Callable[[Any], Any]) -> tuple[dict[str, Any] | None, str | None]:
    """Capture the adapter now: staged copies of the trainable parameters and buffers (frozen
    parameters are referenced: training does not change them), or the files ``save_pretrained``
    writes into a new temporary directory when it takes no ``state_dict``."""
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
    checkpoints_dir: str | os.PathLike | CheckpointStore,
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
    """The snapshot phase of :func:`save_opd_checkpoint`: check the seed's rules and capture state.

    Arguments, rules and errors are those of :func:`save_opd_checkpoint` (nothing is written). The
    caller wraps it in :func:`~opd_store.opd.rng.preserve_global_rng`; this process's RNG state is
    captured first.

    Args:
        stage (Callable | None): applied to every tensor-bearing value after sanitising (the
            trainer, optimizer, scheduler, teacher and RNG states, a ``Tensor -> Tensor`` copy
            applied recursively by the caller's function) and to the adapter's trainable tensors;
            ``None`` keeps the live tensors (synchronous save, no copy).
        rank_rng_parts (dict[int, dict] | None): multi-rank mode (issue 7): this rank's RNG state
            keyed by its rank, captured by the caller; ``rank_rng_states`` is then ignored and
            ``world_size`` is the process group's.

    Returns:
        OpdSnapshot: what :func:`write_opd_checkpoint` (one writer) or the multi-rank collective
        writes.
    """
    if rank_rng_parts is None:
        own_rng = capture_rng_state() if rank_rng_states is None else None
        step = _check_trainer_state(trainer_state, teacher_state)
        world_size = _check_world_size(world_size)
        rng_states = [own_rng] if rank_rng_states is None else list(rank_rng_states)
        if len(rng_states) != world_size:
            raise ValueError(
                f"rank RNG states must match OPD world size: {len(rng_states)} state(s) for "
                f"world_size {world_size}"
            )
        rng_parts = dict(enumerate(rng_states))
    else:
        step = _check_trainer_state(trainer_state, teacher_state)
        world_size = _check_world_size(world_size)
        rng_parts = dict(rank_rng_parts)
    provenance = _check_provenance(provenance_fingerprints)
    fingerprint = config.fingerprint()
    if not isinstance(fingerprint, str):
        raise ValueError(f"config.fingerprint() must return a str, got {type(fingerprint).__name__}")
    config_yaml = yaml.safe_dump(plain_config_dict(config.as_dict()), sort_keys=False).encode("utf-8")
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
    metadata = {
        "opd_schema": schema,
        "attempted_updates": _json_value(training_state["trainer"]["attempted_updates"]),
        "successful_updates": step,
        "query_update": _json_value(training_state["trainer"]["query_update"]),
        "config_fingerprint": fingerprint,
        "provenance_fingerprints": provenance,
        "world_size": world_size,
        "processor_class": _class_name(processor),
    }
    if lineage is not None:
        metadata.update(lineage.as_metadata())
    store = as_store(checkpoints_dir, storage_options)
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


def write_opd_checkpoint(snapshot: OpdSnapshot, *, before_commit: Callable[[], None] | None = None) -> str:
    """The write phase of :func:`save_opd_checkpoint`: stream every payload, then commit.

    Args:
        snapshot (OpdSnapshot): from :func:`snapshot_opd_checkpoint`.
        before_commit (Callable[[], None] | None): called after the last payload, before the
            manifest create; an exception it raises aborts the save uncommitted (the asynchronous
            save's exit deadline, issue 8).

    Returns:
        str: the committed checkpoint's URL (see :func:`save_opd_checkpoint`).

    Raises:
        FileExistsError: the step is already committed (:class:`~opd_store.errors.CommitConflictError`).
        opd_store.errors.CommitError: the commit failed (an ``OSError``); nothing is committed.
        OSError: a payload could not be written; nothing is committed.
    """
    step, world_size = snapshot.step, snapshot.world_size
    try:
        with snapshot.store.begin(step, world_size=world_size, metadata=snapshot.metadata) as txn:
            _write_payloads(txn, snapshot, True)
            if before_commit is not None:
                before_commit()
    finally:
        if snapshot.adapter_dir is not None:  # also when begin() refused the step
            shutil.rmtree(snapshot.adapter_dir, ignore_errors=True)
    logger.info("committed OPD checkpoint %s (step %d, world size %d)", txn.committed_url, step, world_size)
    _apply_retention(snapshot)
    return txn.committed_url


def _write_payloads(txn, snapshot: OpdSnapshot, shared: bool) -> None:
    """Stream ``snapshot`` into ``txn`` (a transaction, or a multi-rank part): the shared payloads
    (adapter, processor, training state, config) when ``shared``, and the snapshot's RNG parts.
    Removes a staged adapter directory whatever happens."""
    try:
        with tempfile.TemporaryDirectory(prefix="opd-save-") as tmp:
            if shared:
                if snapshot.adapter_dir is not None:
                    _stream_directory(txn, Path(snapshot.adapter_dir), ADAPTER_DIR, "save_pretrained")
                else:
                    _stream_pretrained(txn, snapshot.model, Path(tmp) / ADAPTER_DIR, ADAPTER_DIR,
                                       state_dict=snapshot.adapter_state_dict)
                if snapshot.processor is not None:
                    _stream_pretrained(txn, snapshot.processor, Path(tmp) / PROCESSOR_DIR, PROCESSOR_DIR)
            for rank, state in snapshot.rng_payloads.items():
                _save_torch(txn, rng_payload_name(rank, snapshot.world_size), state)
            if shared:
                _save_torch(txn, TRAINING_STATE, snapshot.training_state)
                txn.write_bytes(CONFIG_YAML, snapshot.config_yaml)
    finally:
        if snapshot.adapter_dir is not None:
            shutil.rmtree(snapshot.adapter_dir, ignore_errors=True)


def _apply_retention(snapshot: OpdSnapshot) -> None:
    """The retention pass after a commit (issue 6): only when the save asked for one."""
    if snapshot.retention is not None:
        from ..gc import retention_after_commit

        retention_after_commit(snapshot.store, snapshot.retention, snapshot.step, snapshot.lineage)


# -- load ----------------------------------------------------------------------------------------


def _read_config_dict(store: CheckpointStore, step: int) -> dict | None:
    try:
        data = store.read(step, CONFIG_YAML)
    except CheckpointNotFoundError:
        return None
    parsed = yaml.safe_load(data.decode("utf-8"))
    return parsed if isinstance(parsed, dict) else None


def _check_rank(rank: Any, world_size: Any) -> None:
    _check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def load_opd_checkpoint(
    checkpoint: CheckpointRef,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    config: Any,
    provenance_fingerprints: dict[str, str],
    teacher_state_loader: Callable[[dict], None],
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> dict:
    """Restore the exact next-update state of one rank from an OPD checkpoint.

    Order (seed, with every check moved before the first restore so a refused resume changes
    nothing): completeness; schema; resume validation by
    :func:`opd_store.opd.resume.validate_resume` (config fingerprint, provenance and world size
    under ``config.checkpoint.resume_mode``; a world-size change is always refused); the seed's
    teacher ``update_count`` check; then optimizer, scheduler, teacher (through
    ``teacher_state_loader``), and this rank's RNG state last, so nothing that runs during the
    restore can move the generators afterwards (field notes: "RNG captured first, restored last").

    Under ``rollout_limit_change`` with a changed rollout limit, the returned state drops
    ``validation_baseline``, ``last_validation_artifact`` and ``validation_baseline_step`` and
    records ``rollout_limit_changed_at_update = successful_updates`` (seed); optimizer, teacher,
    query and counters stay the parent's.

    Optimizer state lands on the parameters' devices whatever device saved it: payloads load with
    ``map_location="cpu"`` (a GPU checkpoint loads on a CPU-only host) and
    ``Optimizer.load_state_dict`` moves each state tensor to its parameter's device and dtype
    (``step`` counters stay on the CPU unless the optimizer is ``capturable``/``fused``).

    Rank obligations: every rank calls this with its own ``rank`` and the same ``world_size``;
    each gets its own RNG state (``rng-rank-XX.pt``) back. With a ``torch.distributed`` process
    group of more than one rank initialised, both default to the group's and the load is a
    collective (issue 7): when any rank fails, every rank raises (see Raises); a world-size change
    raises the same ``ResumeMismatchError`` on every rank, naming both sizes.

    Args:
        checkpoint (str | os.PathLike | tuple[CheckpointStore, int]): the step prefix's path or
            URL, or ``(store, step)``; a seed-layout directory works too.
        optimizer (torch.optim.Optimizer): built over the same parameters as when saved.
        scheduler (Any): LR scheduler with ``load_state_dict``.
        config (Any): the current config (``fingerprint()``, ``as_dict()``, optional
            ``checkpoint.resume_mode`` and execution-only markings).
        provenance_fingerprints (dict[str, str]): this run's provenance.
        teacher_state_loader (Callable[[dict], None]): receives the saved teacher state.
        rank (int | None): this process's rank, ``0 <= rank < world_size``; default the process
            group's, or 0 without one.
        world_size (int | None): this run's world size; must equal the saved one; default the
            process group's, or 1 without one.
        storage_options (dict | None): fsspec options for a URL.
        allow_pickle (bool): opt-in to load old pickle-only payloads with plain pickle; honoured
            only for local directories (issue 3, item 6).

    Returns:
        dict: the trainer state (tensors on the CPU).

    Raises:
        ValueError: the checkpoint is incomplete (:class:`~opd_store.errors.IncompleteCheckpointError`,
            naming its URL), has an unknown schema, a malformed training state or a restored
            teacher update count that differs from ``successful_updates``, or ``rank`` is out of
            range.
        opd_store.errors.ResumeMismatchError: (a ``ValueError``) the resume is refused; the message
            names every differing field, or both world sizes.
        opd_store.errors.UnsafeCheckpointError: (a ``ValueError``) a payload needs plain pickle and
            ``allow_pickle`` is off, or ``allow_pickle`` was asked for a non-local store.
        opd_store.errors.IntegrityError: a payload's bytes differ from its manifest entry.
        FileNotFoundError: a payload (such as this rank's RNG file) is missing.
        opd_store.errors.DistributedLoadError: (process group only, an ``OSError``) some ranks
            failed and others did not, or they failed differently; raised on every rank, naming
            each failing rank and its error.
    """
    load = functools.partial(
        _load_one, checkpoint, optimizer=optimizer, scheduler=scheduler, config=config,
        provenance_fingerprints=provenance_fingerprints, teacher_state_loader=teacher_state_loader,
        storage_options=storage_options, allow_pickle=allow_pickle,
    )
    group = current_group() if _process_group_size() > 1 else None
    if group is not None:

        def load_this_rank() -> dict:
            check_group_args(group, rank=rank, world_size=world_size)  # inside the collective: no rank waits alone
            return load(rank=group.rank, world_size=group.world_size)

        return load_collective(group, load_this_rank)
    return load(rank=0 if rank is None else rank, world_size=1 if world_size is None else world_size)


def _process_group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _load_one(
    checkpoint: CheckpointRef, *, optimizer, scheduler, config, provenance_fingerprints, teacher_state_loader,
    rank: int, world_size: int, storage_options, allow_pickle: bool,
) -> dict:
    store, step = resolve_checkpoint(checkpoint, storage_options)
    _check_rank(rank, world_size)
    url = _require_complete(store, step).url
    _check_pickle_opt_in(store, allow_pickle, url)

    # store.open: a local payload is read once by torch.load from the verified file (no bytes copy
    # of the whole payload beside the loaded tensors); a remote one is one GET held in memory.
    with store.open(step, TRAINING_STATE) as handle:
        payload = load_payload(handle, source=f"{url}/{TRAINING_STATE}", allow_pickle=allow_pickle)
    schema = payload.get("schema") if isinstance(payload, dict) else None
    if schema not in SCHEMAS:
        raise ValueError(f"unsupported OPD checkpoint schema {schema!r} at {url} (expected one of {list(SCHEMAS)})")
    absent = [key for key in _PAYLOAD_KEYS if key not in payload]
    if absent or not isinstance(payload["trainer"], dict) or not isinstance(payload["teacher"], Mapping):
        raise ValueError(
            f"malformed OPD training state at {url}: missing {absent}, or trainer/teacher not mappings"
        )
    saved_world_size = payload.get("world_size")
    if (schema == SCHEMA_V1) != (saved_world_size == 1):
        raise ValueError(f"{url}: schema {schema} does not match its saved world size {saved_world_size!r}")

    saved_fingerprint = payload.get("config_fingerprint")
    # config.yaml is only consulted when the fingerprints differ (validate_resume, rules 2 and 5).
    saved_config = None if saved_fingerprint == config.fingerprint() else _read_config_dict(store, step)
    decision = validate_resume(
        checkpoint_url=url,
        saved_config_fingerprint=saved_fingerprint,
        saved_provenance=payload.get("provenance_fingerprints"),
        saved_world_size=saved_world_size,
        saved_config_dict=saved_config,
        config=config,
        provenance_fingerprints=provenance_fingerprints,
        world_size=world_size,
    )

    rng_name = RNG_SINGLE if schema == SCHEMA_V1 else rng_payload_name(rank, saved_world_size)
    try:
        rng_bytes = store.read(step, rng_name)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{url}: step {step} has no RNG state of rank {rank} ({rng_name}); it cannot resume that rank"
        ) from exc
    rng_state = load_payload(rng_bytes, source=f"{url}/{rng_name}", allow_pickle=allow_pickle)

    state = payload["trainer"]
    teacher = payload["teacher"]
    if teacher.get("update_count") not in (None, state["successful_updates"]):
        raise ValueError(
            f"restored teacher update count differs from OPD state at {url} "
            f"({teacher.get('update_count')!r} != {state['successful_updates']!r})"
        )

    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    teacher_state_loader(teacher)
    if decision.rollout_limit_changed:
        # A new stopping rule needs its own validation baseline (seed).
        for key in VALIDATION_KEYS:
            state.pop(key, None)
        state["rollout_limit_changed_at_update"] = state["successful_updates"]
    restore_rng_state(rng_state)
    return state


# -- adapter and processor ------------------------------------------------------------------------


def _adapter_weights(store: CheckpointStore, step: int, names: list[str], prefix: str, url: str) -> dict:
    safetensors_name = f"{prefix}adapter_model.safetensors"
    bin_name = f"{prefix}adapter_model.bin"
    if safetensors_name in names:
        from safetensors.torch import load as load_safetensors

        return load_safetensors(store.read(step, safetensors_name))
    if bin_name in names:
        return load_payload(store.read(step, bin_name), source=f"{url}/{bin_name}")
    raise CheckpointNotFoundError(f"{url} has no adapter weights ({safetensors_name} or {bin_name})")


def _restore_peft_adapter(store: CheckpointStore, step: int, names: list[str], model: Any, url: str) -> None:
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, Mapping) or not peft_config:
        raise TypeError(
            f"load_adapter restores PEFT adapters in place; {type(model).__name__} has no peft_config"
        )
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    for adapter_name in peft_config:
        prefix = f"{ADAPTER_DIR}/" if adapter_name == "default" else f"{ADAPTER_DIR}/{adapter_name}/"
        saved = _adapter_weights(store, step, names, prefix, url)
        expected = get_peft_model_state_dict(model, adapter_name=adapter_name)
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"adapter {adapter_name!r} at {url} does not fit the model: missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        mismatched = [
            f"{key}: saved {tuple(saved[key].shape)} {saved[key].dtype}, model "
            f"{tuple(expected[key].shape)} {expected[key].dtype}"
            for key in sorted(expected)
            if saved[key].shape != expected[key].shape or saved[key].dtype != expected[key].dtype
        ]
        if mismatched:
            raise ValueError(f"adapter {adapter_name!r} at {url} has mismatched tensors: {mismatched}")
        set_peft_model_state_dict(model, saved, adapter_name=adapter_name)
        restored = get_peft_model_state_dict(model, adapter_name=adapter_name)
        differing = sorted(key for key in saved if not torch.equal(restored[key].detach().cpu(), saved[key]))
        if differing:
            raise ValueError(f"adapter {adapter_name!r} from {url} did not restore exactly: {differing}")


def _processor_class(name: str | None) -> Any:
    """A processor class named in the manifest, looked up in ``transformers``'s namespace only."""
    if not name:
        return None
    import transformers

    try:
        cls = getattr(transformers, name, None)
    except Exception:  # noqa: BLE001 - transformers' lazy module raises ImportError for missing extras
        return None
    bases = tuple(
        base
        for base in (
            getattr(transformers, "PreTrainedTokenizerBase", None),
            getattr(transformers, "ProcessorMixin", None),
            getattr(transformers, "FeatureExtractionMixin", None),
            getattr(transformers, "ImageProcessingMixin", None),
        )
        if base is not None
    )
    if isinstance(cls, type) and bases and issubclass(cls, bases) and hasattr(cls, "from_pretrained"):
        return cls
    return None


def _load_processor(store: CheckpointStore, step: int, names: list[str], url: str, class_name: str | None) -> Any:
    prefix = f"{PROCESSOR_DIR}/"
    chosen = [name for name in names if name.startswith(prefix)]
    if not chosen:
        # Seed layout: the seed's save_adapter wrote the processor beside the adapter.
        adapter_prefix = f"{ADAPTER_DIR}/"
        if not any(f"{adapter_prefix}{marker}" in names for marker in _PROCESSOR_MARKERS):
            return None
        prefix = adapter_prefix
        chosen = [name for name in names if name.startswith(prefix) and "/" not in name[len(prefix):]]
    import transformers

    with tempfile.TemporaryDirectory(prefix="opd-processor-") as tmp:
        for name in chosen:
            target = Path(tmp, *name[len(prefix):].split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(store.read(step, name))
        cls = _processor_class(class_name)
        if cls is not None:
            return cls.from_pretrained(tmp, local_files_only=True)
        errors = []
        for auto in (transformers.AutoProcessor, transformers.AutoTokenizer):
            try:
                return auto.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
            except (ValueError, OSError, KeyError, TypeError) as exc:
                errors.append(f"{auto.__name__}: {exc}")
        raise ValueError(f"cannot load the processor saved at {url}: {'; '.join(errors)}")


def load_adapter(checkpoint: CheckpointRef, model: Any, *, storage_options: dict[str, Any] | None = None) -> Any:
    """Restore the student's LoRA adapter weights in place, exactly; return the saved processor.

    For each adapter of the PEFT model (``model.peft_config``), the saved
    ``adapter_model.safetensors`` (``adapter/`` for ``default``, ``adapter/<name>/`` otherwise, as
    PEFT's ``save_pretrained`` lays them out) is parsed from bytes with
    ``safetensors.torch.load`` (no pickle) and set into the existing adapter with
    ``peft.utils.set_peft_model_state_dict``; then the adapter's state is read back and compared
    bit for bit. Keys, shapes and dtypes must match the model's adapter exactly (issue 3, item 2).
    Tensors land on the device of the adapter's parameters.

    The processor is rebuilt from ``processor/`` (seed layout: from the processor files inside
    ``adapter/``) in a temporary directory, with the class recorded in the manifest when it is a
    ``transformers`` tokenizer/processor class, else ``AutoProcessor`` then ``AutoTokenizer``
    (``trust_remote_code=False``: no code from the checkpoint runs).

    Rank obligations: every rank that holds a replica of the student calls this.

    Args:
        checkpoint (str | os.PathLike | tuple[CheckpointStore, int]): the step prefix or
            ``(store, step)``.
        model (Any): a PEFT model whose adapters were created with the saved configuration.
        storage_options (dict | None): fsspec options for a URL.

    Returns:
        Any | None: the saved processor, or ``None`` when none was saved.

    Raises:
        IncompleteCheckpointError: (a ``ValueError``) the checkpoint is not complete.
        ValueError: missing or unexpected adapter keys (both named), mismatched shapes or dtypes,
            or a processor that cannot be loaded.
        TypeError: ``model`` is not a PEFT model.
        FileNotFoundError: no adapter weights for one of the model's adapters.
        opd_store.errors.IntegrityError: a payload's bytes differ from its manifest entry.
    """
    store, step = resolve_checkpoint(checkpoint, storage_options)
    report = _require_complete(store, step)
    url = report.url
    names = store.names(step)
    _restore_peft_adapter(store, step, names, model, url)
    class_name = None
    if report.status == COMPLETE:
        class_name = store.manifest(step).metadata.get("processor_class")
    return _load_processor(store, step, names, url, class_name)


# -- discovery -----------------------------------------------------------------------------------


def latest_complete_checkpoint(
    checkpoints_dir: str | os.PathLike | CheckpointStore, *, storage_options: dict[str, Any] | None = None
) -> str:
    """The newest complete checkpoint (manifest-committed or seed-layout) under a directory.

    Steps are ordered numerically. Uncommitted, incomplete and corrupt steps are skipped (and
    logged), never chosen (field notes: a half-written newest checkpoint must not win).

    Args:
        checkpoints_dir (str | os.PathLike | CheckpointStore): local path, fsspec URL or store.
        storage_options (dict | None): fsspec options for a URL.

    Rank obligations: with a ``torch.distributed`` process group of more than one rank
    initialised, every rank calls this (a collective): rank 0 decides and broadcasts, so every rank
    resumes from the same step even while another writer commits a newer one (issue 7).

    Returns:
        str: the checkpoint's URL (a plain absolute path for a local store).

    Raises:
        FileNotFoundError: no complete checkpoint
            (:class:`~opd_store.errors.CheckpointNotFoundError`; seed message).
    """
    store = as_store(checkpoints_dir, storage_options)

    def decide() -> str:
        try:
            step = store.latest_step(include_legacy=True)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"in-place OPD resume has no complete checkpoint: {exc}") from exc
        return store.step_url(step)

    group = current_group()
    return decide() if group is None else decide_on_rank0(group, decide)


__all__ = [
    "SCHEMAS",
    "SCHEMA_V1",
    "SCHEMA_V2",
    "OpdSnapshot",
    "latest_complete_checkpoint",
    "load_adapter",
    "load_opd_checkpoint",
    "resolve_checkpoint",
    "rng_payload_name",
    "save_opd_checkpoint",
    "snapshot_opd_checkpoint",
    "write_opd_checkpoint",
]
