"""Hugging Face ``Trainer`` (and TRL's trainers) checkpointing into an opd_store store.

Two additions to a training script (docs/integrations.md)::

    callback = StoreCallback("s3://bucket/run", retention=RetentionPolicy(keep_last=3))
    trainer = GKDTrainer(..., callbacks=[callback])              # or any transformers.Trainer
    trainer.train(resume_from_checkpoint=store_checkpoint("s3://bucket/run", trainer=trainer))

:class:`StoreCallback` commits every ``checkpoint-N`` directory the Trainer writes as step ``N``
of the store: after a barrier, rank 0 begins an attempt, every rank uploads its own files (its
``rng_state_{rank}.pth``) as its part of that attempt, rank 0 uploads the shared files (model or
adapter, optimizer, scheduler, scaler, ``trainer_state.json``, tokenizer, ``training_args.bin``)
and creates the manifest only if absent, naming every file with its size and CRC32C. A directory
the Trainer left incomplete is never committed. With ``async_upload=True`` rank 0's files are
hard-linked into a staging directory (:func:`opd_store.integrations.files.snapshot_files`) and
uploaded by a background thread, so ``save_total_limit`` deleting the directory meanwhile cannot
take bytes from the upload.

:func:`store_checkpoint` finds the newest *complete* step (newer uncommitted or damaged steps are
skipped with a warning), checks that the current run may resume it (the OPD layer's resume rules
over the ``TrainingArguments`` and model config, :mod:`opd_store.integrations.run_config`) and
fetches it, every file verified, into ``<output_dir>/checkpoint-N``; the Trainer resumes from
there. Resume is resolved by ``Trainer.train`` before any callback runs, so the fetch has to happen
before the call.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..errors import CommitConflictError, IncompleteCheckpointError, OpdStoreError, UploadError
from ..retention import RetentionPolicy, RunLineage
from ..store import COMPLETE, CheckpointStore
from ..thread_random import route_background_random
from . import collective
from .background import Uploader
from .files import FileSnapshot, directory_files, snapshot_files, upload_files
from .hf_layout import JIT_SENTINEL_NAME, checkpoint_dirname, files_of_rank, missing_files
from .hf_resume import resume_from_store, store_checkpoint
from .run_config import RunConfig, check_resume, trainer_run_config

logger = logging.getLogger("opd_store.integrations.transformers")

FRAMEWORK = "transformers"
STAGING_DIRNAME = ".opd-store-staging"


class StoreCallback(TrainerCallback):
    """Commit every checkpoint the Trainer saves to a store (see module docs).

    Args:
        url (str | os.PathLike): the store (``s3://bucket/run``, ``gs://...``, a local path, any
            fsspec URL).
        storage_options (dict | None): fsspec options for every request (endpoint, credentials).
        retention (RetentionPolicy | None): applied in the store after each commit by the rules of
            :mod:`opd_store.retention` (pins and the resume parent are kept), independent of the
            Trainer's ``save_total_limit`` on local disk. ``None`` keeps every checkpoint.
        async_upload (bool): upload rank 0's files in a background thread (at most one checkpoint
            in flight; a failure is raised at the next save or at the end of training).
        preemption (PreemptionWatcher | None): started at ``on_train_begin`` and stopped at
            ``on_train_end``; on a notice the update in progress finishes, the Trainer saves, the
            callback commits (waiting for the upload) and training stops.
        resume_mode (str): ``exact`` (default), ``execution_change`` or ``rollout_limit_change``:
            which differences between this run and the checkpoint it resumes are accepted
            (docs/resume.md, "Resume modes").

    Raises:
        StoreUnreachableError: the store cannot be used (no bucket, credentials or connection);
            raised here, before training, naming the URL and the cause.
        ValueError: an unknown resume mode.

    Rank obligations: every rank constructs the callback and runs the same ``Trainer``; the
    collectives of a save run inside ``on_save`` on every rank.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        retention: RetentionPolicy | None = None,
        async_upload: bool = False,
        preemption: Any = None,
        resume_mode: str = "exact",
    ) -> None:
        self.store = CheckpointStore(url, storage_options=storage_options)
        self.store.check_reachable()
        RunConfig({}, resume_mode=resume_mode)  # validates the mode now, not at the first step
        self.retention = retention
        self.async_upload = async_upload
        self.preemption = preemption
        self.resume_mode = resume_mode
        self.committed_steps: list[int] = []
        self.preempted_at: int | None = None
        self._uploader = Uploader()
        self._lineage: RunLineage | None = None
        self._run_config: RunConfig | None = None
        self._world_size = 1

    # -- lifecycle -------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._world_size = args.world_size
        self._run_config = trainer_run_config(args, model, resume_mode=self.resume_mode)
        resumed = state.global_step or None
        if resumed is not None and self.store.status(resumed) == COMPLETE:
            manifest = self.store.manifest(resumed)
            check_resume(manifest.metadata.get("run_config"), self._run_config,
                         checkpoint_url=self.store.step_url(resumed), world_size=args.world_size)
        elif resumed is None:
            steps = [info.step for info in self.store.checkpoints() if info.status == COMPLETE]
            if steps:
                raise CommitConflictError(
                    f"{self.store.url} already holds complete checkpoints (latest step {steps[-1]}) but this run "
                    "starts from step 0; resume with trainer.train(resume_from_checkpoint=store_checkpoint(url, "
                    "trainer=trainer)) or give the run a new store URL"
                )
        parent = resumed if resumed is not None and self.store.status(resumed) == COMPLETE else None
        self._lineage = RunLineage.new(parent_step=parent)
        if self.preemption is not None:
            self.preemption.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.preemption is not None and self.preemption.should_checkpoint_now() and self.preempted_at is None:
            notice = self.preemption.notice
            logger.warning("preemption notice (%s); saving step %d and stopping", notice.detail if notice else "?",
                           state.global_step)
            self.preempted_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        self._commit_jit_checkpoint(args, state, control)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._commit_jit_checkpoint(args, state, control)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._commit_jit_checkpoint(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._commit_jit_checkpoint(args, state, control)

    def on_save(self, args, state, control, **kwargs):
        self.commit(args, state, wait=self.preempted_at is not None)

    def on_train_end(self, args, state, control, **kwargs):
        try:
            self._uploader.close()
        finally:
            if self.preemption is not None:
                self.preemption.stop()
            staging = Path(args.output_dir) / STAGING_DIRNAME
            if staging.is_dir() and not any(staging.iterdir()):
                staging.rmdir()

    # -- commits ---------------------------------------------------------------------------------
    def _commit_jit_checkpoint(self, args, state, control) -> None:
        """Commit a checkpoint transformers' ``enable_jit_checkpoint`` wrote on SIGTERM.

        Its ``CheckpointManager`` calls ``Trainer._save_checkpoint`` directly, so ``on_save`` never
        fires; it sets ``control.should_training_stop`` first and removes its sentinel file when
        the save finished. Callbacks run after the Trainer's own, so the directory is complete when
        this runs in the same event.
        """
        if not getattr(args, "enable_jit_checkpoint", False) or not control.should_training_stop:
            return
        step = state.global_step
        directory = Path(args.output_dir) / checkpoint_dirname(step)
        if step in self.committed_steps or not directory.is_dir() or (directory / JIT_SENTINEL_NAME).exists():
            return
        logger.warning("committing the just-in-time checkpoint of step %d", step)
        self.commit(args, state, wait=True)

    def commit(self, args, state, *, wait: bool = False) -> None:
        """Commit ``<output_dir>/checkpoint-<global_step>`` as step ``global_step`` (every rank).

        Args:
            args (TrainingArguments): the run's arguments.
            state (TrainerState): the Trainer's state (``global_step``).
            wait (bool): with ``async_upload``, wait for the commit (preemption, JIT saves).

        Raises:
            IncompleteCheckpointError: a file the Trainer should have written is missing or empty
                (the message names it), on this rank or another; nothing is committed.
            CommitConflictError: another run committed this step.
            UploadError: the previous background upload failed.
            OSError: a backend failure (with ``async_upload``: raised at the next save or the end).
        """
        step = state.global_step
        rank, world = args.process_index, args.world_size
        directory = Path(args.output_dir) / checkpoint_dirname(step)
        # a rank that wrote nothing (save_only_model on rank > 0) has no directory: an empty share
        files = files_of_rank(directory_files(directory), rank, world) if directory.is_dir() else {}
        missing = missing_files(files, rank=rank, world_size=world, save_only_model=args.save_only_model,
                                optimizer_in_files=not (args.deepspeed or args.fsdp))
        collective.barrier()
        txn, decision = None, ("skip", None)
        if rank == 0:
            try:
                self._uploader.wait()
                txn = self._begin(step, directory, missing)
                decision = ("skip", None) if txn is None else ("go", txn.attempt_id)
            except (OpdStoreError, OSError, ValueError) as exc:
                if world <= 1:
                    raise
                decision = ("error", f"{type(exc).__name__}: {exc}")
                error = exc
        kind, value = collective.broadcast_from_zero(decision)
        if kind == "error":
            if rank == 0:
                raise error
            raise IncompleteCheckpointError(f"rank 0 did not commit step {step}: {value}")
        if kind == "skip":
            return
        entries: Any = []
        if rank != 0:
            entries = self._upload_part(step, value, rank, world, directory, files, missing)
        gathered = collective.gather_to_zero(entries)
        if rank == 0:
            self._finish(txn, step, directory, files, gathered, args, wait)
        elif not self.async_upload:
            outcome = collective.broadcast_from_zero(None)
            if outcome is not None:
                raise IncompleteCheckpointError(f"step {step} was not committed by rank 0: {outcome}")

    def _begin(self, step: int, directory: Path, missing: list[str]):
        if missing:
            raise IncompleteCheckpointError(
                f"{directory}: the Trainer's checkpoint of step {step} is incomplete ({'; '.join(missing)}); "
                f"not committed to {self.store.url}")
        try:
            return self.store.begin(step, world_size=self._world_size, metadata=self._metadata(step))
        except CommitConflictError:
            existing = self.store.manifest(step).metadata.get("run_id") if self.store.status(step) == COMPLETE else None
            if self._lineage is not None and existing == self._lineage.run_id:
                logger.info("step %d is already committed by this run; kept", step)
                return None
            raise

    def _upload_part(self, step, attempt, rank, world, directory, files, missing):
        if missing:
            return f"rank {rank}: {directory} is incomplete ({'; '.join(missing)})"
        try:
            with route_background_random(), self.store.begin_part(step, attempt_id=attempt, rank=rank,
                                                                   world_size=world) as part:
                upload_files(part, [FileSnapshot.of(name, path) for name, path in files.items()])
            return [entry.model_dump() for entry in part.entries]
        except (OpdStoreError, OSError, ValueError) as exc:
            return f"rank {rank}: {type(exc).__name__}: {exc}"

    def _finish(self, txn, step, directory, files, gathered, args, wait) -> None:
        from ..manifest import PayloadEntry

        failures = [item for item in gathered[1:] if isinstance(item, str)]
        if failures:
            txn.abort()
            self._broadcast_outcome("; ".join(failures))
            raise IncompleteCheckpointError(f"step {step} not committed to {self.store.url}: " + "; ".join(failures))
        for part in gathered[1:]:
            for entry in part:
                txn.add_entry(PayloadEntry(**entry))
        if self.async_upload:
            staging = Path(args.output_dir) / STAGING_DIRNAME / f"{directory.name}-{uuid.uuid4().hex[:8]}"
            try:
                snaps = list(snapshot_files(files, staging).values())
            except BaseException:
                txn.abort()
                raise
            self._uploader.submit(lambda: self._upload_and_commit(txn, snaps, staging), label=self.store.step_url(step))
            self._broadcast_outcome(None)
            if wait:
                self._uploader.wait()
            return
        try:
            with route_background_random():
                self._upload_and_commit(txn, [FileSnapshot.of(n, p) for n, p in files.items()], None)
        except BaseException as exc:
            self._broadcast_outcome(f"{type(exc).__name__}: {exc}")
            raise
        self._broadcast_outcome(None)

    def _broadcast_outcome(self, outcome: str | None) -> None:
        if self._world_size > 1 and not self.async_upload:
            collective.broadcast_from_zero(outcome)

    def _upload_and_commit(self, txn, snaps: list[FileSnapshot], staging: Path | None) -> str:
        try:
            with txn:
                upload_files(txn, snaps)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        self.committed_steps.append(txn.step)
        logger.info("committed %s (%d files)", txn.url, len(txn.entries))
        if self.retention is not None and not self.retention.keeps_all:
            from ..gc import retention_after_commit

            retention_after_commit(self.store, self.retention, txn.step, self._lineage)
        return txn.url

    def _metadata(self, step: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {"framework": FRAMEWORK, "checkpoint_name": checkpoint_dirname(step)}
        if self._lineage is not None:
            metadata.update(self._lineage.as_metadata())
        if self._run_config is not None:
            metadata["run_config"] = self._run_config.to_metadata(self._world_size)
        return metadata

    def wait(self) -> None:
        """Block until the background upload in flight (if any) has committed.

        Raises:
            UploadError: it failed.
        """
        self._uploader.wait()


__all__ = ["StoreCallback", "UploadError", "resume_from_store", "store_checkpoint"]
