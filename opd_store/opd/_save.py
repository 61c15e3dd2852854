"""Saving OPD checkpoints: the seed's save contract on any store, through the one save pipeline.

:func:`save_opd_checkpoint` runs the pipeline's stages (:mod:`opd_store.pipeline._save`) on the
caller's thread: the snapshot (:mod:`opd_store.opd._snapshot`), the payload writes of this module,
the commit and the after-commit hooks; in multi-rank mode every rank writes its part
(:mod:`opd_store.pipeline._collective`). :class:`~opd_store.opd._async_save.AsyncCheckpointer` runs
the same stages with the write, commit and hooks on the background worker.

Every payload is written with ``torch.save`` straight into the transaction's writer (no whole
serialised copy in memory), without torch's own zip CRC-32 (:mod:`opd_store.format._torch_io`: the
payload's CRC32C in the manifest covers the bytes and is checked on every read, and skipping the
zip CRC saves about 2.5 s of CPU per GiB, docs/performance.md) and read back with
``torch.load(weights_only=True)`` through :mod:`opd_store.opd._safe_load`; state is sanitised
before saving, so nothing unloadable is ever written. The whole synchronous save runs inside
:func:`~opd_store.opd._rng.preserve_global_rng`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..format import torch_save
from ..pipeline import SaveRequest, after_commit, run_save, write_and_commit_collective
from ..retention import RetentionPolicy, RunLineage
from ..store import BaseStore
from ._distributed import check_group_args, current_group
from ._names import ADAPTER_DIR, CONFIG_YAML, PROCESSOR_DIR, TRAINING_STATE, rng_payload_name
from ._rng import capture_rng_state, preserve_global_rng
from ._snapshot import OpdSnapshot, snapshot_opd_checkpoint

logger = logging.getLogger("opd_store.opd")

_COPY_CHUNK_BYTES = 8 * 1024 * 1024


def stream_pretrained(txn, obj: Any, directory: Path, prefix: str, state_dict: dict | None = None) -> None:
    """``obj.save_pretrained(directory)``, then every file into the transaction as ``prefix/...``."""
    if state_dict is None:
        obj.save_pretrained(str(directory))
    else:
        obj.save_pretrained(str(directory), state_dict=state_dict)
    stream_directory(txn, directory, prefix, f"{type(obj).__name__}.save_pretrained")


def stream_directory(txn, directory: Path, prefix: str, writer_name: str) -> None:
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
    checkpoints_dir: str | os.PathLike | BaseStore,
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
    * the step is ``successful_updates``; an existing committed step (or a legacy step
      directory) raises ``FileExistsError``;
    * trainer, teacher, optimizer, scheduler and RNG state are sanitised so weights-only loading
      restores them (a checkpoint from a bucket never runs code on load): numpy values converted,
      anything else refused;
    * ``config.as_dict()`` is plain YAML data (numpy scalars converted, anything else refused
      naming its key: a ``Path`` or an enum would make ``config.yaml`` unloadable with
      ``yaml.safe_load``), checked before anything is written.

    Rank obligations, two modes:

    * Multi-rank mode: a ``torch.distributed`` process group of more than one rank is
      initialised and ``rank_rng_states`` is ``None``. Every rank calls this with the same
      arguments except its own RNG state (captured here); rank 0 writes the shared payloads,
      every rank its own ``rng-rank-XX.pt``, and rank 0 commits once every part is durable
      (:mod:`opd_store.pipeline._collective`). Every rank returns the same URL or raises the same error.
    * Single-writer mode (seed): only rank 0 calls this, after a barrier that ends the update on
      every rank, passing every rank's :func:`~opd_store.opd._rng.capture_rng_state` in rank order
      (``rank_rng_states[r]`` is rank ``r``'s). Other ranks must not call it.

    Every global RNG (Python, numpy, torch, CUDA) is left exactly as it was found, even when the
    storage retries (botocore's back-off draws from ``random``; a save must never change the
    training's random streams, or a resumed run would diverge). The RNG state saved for this
    process is captured first, before anything else runs.

    Args:
        checkpoints_dir (str | os.PathLike | BaseStore): local path, fsspec URL or store (a
            :class:`~opd_store.store._checkpoint_store.CheckpointStore` or a :class:`~opd_store.tiered._store.TieredStore`).
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
        retention (RetentionPolicy | None): applied once this commit succeeded and the step is
            durable (``config.checkpoint.retention_policy()`` gives the config's): at once on a
            plain store, after the upload on a tiered store (to the bucket). Never deletes this
            step, the newest complete step, pinned steps, steps not durable yet, or
            ``lineage.parent_step`` until this run has a second checkpoint. ``None``: keep all.
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
            the message names its key path and how to convert it; or ``retention`` for a tiered
            store that has its own ``bucket_retention`` (nothing is written).
        FileExistsError: the step is already committed, or holds a legacy checkpoint
            (:class:`~opd_store.errors.CommitConflictError`), including when another writer
            commits it first.
        opd_store.errors.CommitError: the commit failed (an ``OSError``); nothing is committed.
        opd_store.errors.DistributedSaveError: (multi-rank mode, a ``CommitError``) any rank's
            check or write failed, on every rank, naming each failing rank and its error;
            :class:`~opd_store.errors.DistributedCommitConflictError` (also a ``FileExistsError``)
            when the step is already committed. Nothing is committed.
        opd_store.errors.RetentionError: (an ``OSError``) the retention pass after the commit of a
            plain store could not run or failed part-way; the step is committed (its URL is the
            error's ``url``). On a tiered store such a failure is raised by the store at its next
            save, ``flush`` or ``close``.
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
        # Multi-rank mode: every rank snapshots and writes its part; rank 0 commits and runs the
        # after-commit hooks.
        own_rng = capture_rng_state()

        def snapshot_this_rank() -> SaveRequest:
            check_group_args(group, rank=rank, world_size=world_size)
            snapshot = snapshot_opd_checkpoint(**snapshot_kwargs, world_size=group.world_size,
                                               rank_rng_parts={group.rank: own_rng})
            return save_request(snapshot)

        url, request = write_and_commit_collective(group, snapshot_this_rank)
        logger.info("committed OPD checkpoint %s (world size %d, rank %d)", url, group.world_size, group.rank)
        if group.rank == 0:
            after_commit(request, url)
        return url


def _write_payloads(txn, snapshot: OpdSnapshot, shared: bool) -> None:
    """Stream ``snapshot`` into ``txn`` (a transaction, or a multi-rank part): the shared payloads
    (adapter, processor, training state, config) when ``shared``, and the snapshot's RNG parts."""
    with tempfile.TemporaryDirectory(prefix="opd-save-") as tmp:
        if shared:
            if snapshot.adapter_dir is not None:
                stream_directory(txn, Path(snapshot.adapter_dir), ADAPTER_DIR, "save_pretrained")
            else:
                stream_pretrained(txn, snapshot.model, Path(tmp) / ADAPTER_DIR, ADAPTER_DIR,
                                   state_dict=snapshot.adapter_state_dict)
            if snapshot.processor is not None:
                stream_pretrained(txn, snapshot.processor, Path(tmp) / PROCESSOR_DIR, PROCESSOR_DIR)
        for rank, state in snapshot.rng_payloads.items():
            _save_torch(txn, rng_payload_name(rank, snapshot.world_size), state)
        if shared:
            _save_torch(txn, TRAINING_STATE, snapshot.training_state)
            txn.write_bytes(CONFIG_YAML, snapshot.config_yaml)


def save_request(snapshot: OpdSnapshot) -> SaveRequest:
    """The pipeline's :class:`~opd_store.pipeline._save.SaveRequest` of an OPD snapshot: its
    payload writer, retention and lineage; releasing it removes a staged adapter directory."""
    adapter_dir = snapshot.adapter_dir

    def release() -> None:
        if adapter_dir is not None:
            shutil.rmtree(adapter_dir, ignore_errors=True)

    return SaveRequest(
        store=snapshot.store, step=snapshot.step, world_size=snapshot.world_size, metadata=snapshot.metadata,
        write=lambda txn, shared: _write_payloads(txn, snapshot, shared),
        retention=snapshot.retention, lineage=snapshot.lineage, release=release,
    )


def write_opd_checkpoint(snapshot: OpdSnapshot, *, before_commit: Callable[[], None] | None = None,
                         cancelled: threading.Event | None = None) -> str:
    """The write, commit and after-commit stages of :func:`save_opd_checkpoint` for one writer.

    Args:
        snapshot (OpdSnapshot): from :func:`~opd_store.opd._snapshot.snapshot_opd_checkpoint`.
        before_commit (Callable[[], None] | None): called after the last payload, before the
            manifest create; an exception it raises aborts the save uncommitted.
        cancelled (threading.Event | None): the background worker's exit-deadline event.

    Returns:
        str: the committed checkpoint's URL (see :func:`save_opd_checkpoint`).

    Raises:
        FileExistsError: the step is already committed (:class:`~opd_store.errors.CommitConflictError`).
        opd_store.errors.CommitError: the commit failed (an ``OSError``); nothing is committed.
        opd_store.errors.RetentionError: the retention pass after the commit failed (committed).
        OSError: a payload could not be written; nothing is committed.
    """
    url = run_save(save_request(snapshot), cancelled=cancelled, before_commit=before_commit)
    logger.info("committed OPD checkpoint %s (step %d, world size %d)", url, snapshot.step, snapshot.world_size)
    return url


__all__ = ["save_opd_checkpoint", "save_request", "stream_directory", "stream_pretrained", "write_opd_checkpoint"]
