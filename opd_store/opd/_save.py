"""Saving OPD checkpoints: the seed's save contract on any store, through the save pipeline
(ARCHITECTURE.md, "The save path"); :func:`save_request` is the snapshot's payload writer.

Payloads are ``torch.save``-d straight into the transaction without torch's zip CRC-32 (the
manifest's CRC32C covers them: :mod:`opd_store.format._torch_io`, docs/performance.md).
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
from ..pipeline import AfterCommit, SaveRequest, run_save, run_save_collective
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
    """Every file under ``directory`` into the transaction as ``prefix/...``.

    Raises:
        ValueError: ``directory`` holds no file (``writer_name`` wrote nothing).
    """
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
    """Commit one OPD checkpoint at step ``successful_updates``, after a complete update.

    The seed's rules are checked before anything is written (docs/resume.md, "What is saved", "What
    trainer state may hold"); every global RNG is left as found, even when the storage retries.

    Args:
        checkpoints_dir (str | os.PathLike | BaseStore): local path, fsspec URL or store.
        model, processor: ``save_pretrained(dir)`` writes the adapter, the processor (or ``None``).
        optimizer, scheduler: their ``state_dict()`` is saved.
        trainer_state, teacher_state (dict), config (``fingerprint()``, ``as_dict()``),
            provenance_fingerprints (dict[str, str]): the run's state.
        world_size (int | None): schema v1 for 1, v2 above; default the group's, or 1.
        rank_rng_states (list[dict] | None): per-rank RNG states, index = rank (single-writer mode).
        storage_options (dict | None): fsspec options for a URL.
        retention (RetentionPolicy | None): applied once the step is durable; ``None`` keeps all.
        lineage (RunLineage | None): run id and resume parent, recorded in the manifest metadata.
        rank (int | None): this process's rank; must equal the process group's.

    Returns:
        str: the committed checkpoint's URL, as ``load_opd_checkpoint`` and ``load_adapter`` take it.

    Rank obligations (docs/resume.md, "Several ranks"): multi-rank (a group, no ``rank_rng_states``):
    every rank calls this with the same arguments and gets the same URL or error; single-writer:
    rank 0 alone, after a barrier, with every rank's ``capture_rng_state()`` in rank order.

    Raises:
        ValueError: a rule is broken (``UnsafeCheckpointError`` names the key path), a ``rank`` other
            than 0 in single-writer mode, or a ``retention`` the store refuses. Nothing is written.
        TypeError: ``retention`` is not a ``RetentionPolicy`` or ``None``. Nothing is written.
        CommitConflictError: (a ``FileExistsError``) the step is committed or holds a legacy checkpoint.
        CommitError: (an ``OSError``) the commit failed; nothing is committed.
        DistributedSaveError: (multi-rank) any rank failed, raised on every rank naming each
            (``DistributedCommitConflictError`` for a committed step); nothing is committed.
        RetentionError: the retention pass failed; the step is committed (a tiered store raises it
            at its next save, ``flush`` or ``close``).
        RuntimeError: (multi-rank) a rank died or the process group timed out mid-save.
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
        own_rng = capture_rng_state()

        def snapshot_this_rank() -> SaveRequest:
            check_group_args(group, rank=rank, world_size=world_size)
            snapshot = snapshot_opd_checkpoint(**snapshot_kwargs, world_size=group.world_size,
                                               rank_rng_parts={group.rank: own_rng})
            return save_request(snapshot)

        url = run_save_collective(group, snapshot_this_rank)
        logger.info("committed OPD checkpoint %s (world size %d, rank %d)", url, group.world_size, group.rank)
        return url


def _write_payloads(txn, snapshot: OpdSnapshot, shared: bool) -> None:
    """Stream ``snapshot`` into ``txn`` (transaction or part): the shared payloads when ``shared``,
    and the snapshot's RNG parts.
    """
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
    """The pipeline's ``SaveRequest`` for an OPD snapshot; its release removes a staged adapter dir."""
    adapter_dir = snapshot.adapter_dir

    def release() -> None:
        if adapter_dir is not None:
            shutil.rmtree(adapter_dir, ignore_errors=True)

    return SaveRequest(
        AfterCommit(snapshot.store, snapshot.step, retention=snapshot.retention, lineage=snapshot.lineage),
        world_size=snapshot.world_size, metadata=snapshot.metadata,
        write=lambda txn, shared: _write_payloads(txn, snapshot, shared), release=release,
    )


def write_opd_checkpoint(snapshot: OpdSnapshot, *, before_commit: Callable[[], None] | None = None,
                         cancelled: threading.Event | None = None) -> str:
    """The write, commit and after-commit stages of :func:`save_opd_checkpoint` for one writer.

    Args:
        snapshot (OpdSnapshot): from :func:`~opd_store.opd._snapshot.snapshot_opd_checkpoint`.
        before_commit (Callable[[], None] | None): runs before the manifest create; raising aborts.
        cancelled (threading.Event | None): the background worker's exit-deadline event.

    Returns:
        str: the committed checkpoint's URL.

    Raises:
        CommitConflictError: (a ``FileExistsError``) the step is already committed.
        CommitError: (an ``OSError``) the commit failed; nothing is committed.
        RetentionError: the retention pass after the commit failed (committed).
        OSError: a payload could not be written; nothing is committed.
    """
    url = run_save(save_request(snapshot), cancelled=cancelled, before_commit=before_commit)
    logger.info("committed OPD checkpoint %s (step %d, world size %d)", url, snapshot.step, snapshot.world_size)
    return url


__all__ = ["save_opd_checkpoint", "save_request", "stream_directory", "stream_pretrained", "write_opd_checkpoint"]
