"""Hugging Face ``Trainer`` (and TRL's trainers) checkpointing into an opd_store store.

Two additions to a training script (docs/integrations.md)::

    callback = StoreCallback("s3://bucket/run", retention=RetentionPolicy(keep_last=3))
    trainer = GKDTrainer(..., callbacks=[callback])              # or any transformers.Trainer
    trainer.train(resume_from_checkpoint=store_checkpoint("s3://bucket/run", trainer=trainer))

:class:`StoreCallback` commits every ``checkpoint-N`` directory the Trainer writes as step ``N``
of the store: every rank checks its share of the directory and rank 0 begins an attempt (one
collective, :mod:`opd_store.integrations.collective`), every other rank uploads its own files (its
``rng_state_{rank}.pth``) as its part of that attempt, rank 0 uploads the shared files (model or
adapter, optimizer, scheduler, scaler, ``trainer_state.json``, tokenizer, ``training_args.bin``)
and creates the manifest only if absent, naming every file with its size and CRC32C. A directory
the Trainer left incomplete is never committed, and a rank that fails makes every rank raise. With ``async_upload=True`` rank 0's files are
hard-linked into a staging directory (:func:`opd_store.integrations.files.snapshot_files`) and
uploaded by a background thread, so ``save_total_limit`` deleting the directory meanwhile cannot
take bytes from the upload.

:func:`store_checkpoint` finds the newest *complete* step (newer uncommitted, incomplete or
unreadable steps are skipped with a warning; a committed payload whose bytes differ from its
manifest stops the fetch), checks that the current run may resume it (the OPD layer's resume rules
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

from ..errors import CommitConflictError, IncompleteCheckpointError, UploadError
from ..gc import retention_after_commit
from ..manifest import PayloadEntry
from ..opd.distributed import decide_on_rank0
from ..retention import RetentionPolicy, RunLineage
from ..store import COMPLETE, CheckpointStore
from ..thread_random import route_background_random
from .background import Uploader
from .collective import Ranks
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
        """Check that this run may write the store, record its lineage, clear stale staging.

        Raises:
            CommitConflictError: the store holds complete checkpoints newer than the step this run
                starts from (0, or the resumed step): its saves would collide with them, or
                interleave two runs' steps. Nothing has been trained yet.
            ResumeMismatchError: the resumed step belongs to another run (names every field).

        Rank obligations: every rank runs it (the Trainer calls callbacks on every rank); rank 0
        decides and every rank raises its error.
        """
        self._world_size = args.world_size
        self._run_config = trainer_run_config(args, model, resume_mode=self.resume_mode)
        resumed = state.global_step

        def parent_step() -> int | None:
            complete = {info.step: info for info in self.store.checkpoints() if info.status == COMPLETE}
            newer = sorted(step for step in complete if step > resumed)
            if newer:
                start = f"resumes step {resumed}" if resumed else "starts from step 0"
                raise CommitConflictError(
                    f"{self.store.url} already holds complete checkpoints newer than this run's start (steps "
                    f"{', '.join(map(str, newer))}) but this run {start}, so its saves would collide with them; "
                    "resume the newest with trainer.train(resume_from_checkpoint=store_checkpoint(url, "
                    "trainer=trainer)) or give the run a new store URL")
            if resumed not in complete:
                return None
            check_resume(complete[resumed].metadata.get("run_config"), self._run_config,
                         checkpoint_url=self.store.step_url(resumed), world_size=args.world_size)
            return resumed

        # decided on rank 0 for every rank: ranks listing the store themselves could disagree
        group = Ranks.current().group
        parent = parent_step() if group is None else decide_on_rank0(group, parent_step)
        self._lineage = RunLineage.new(parent_step=parent)
        if args.process_index == 0:
            # hard links a killed process left (a background upload that never finished): they
            # would keep deleted checkpoints' bytes on disk; nothing of this process is in flight
            shutil.rmtree(Path(args.output_dir) / STAGING_DIRNAME, ignore_errors=True)
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

        Three rounds, each ending in one collective (:meth:`Ranks.agree`): every rank checks its
        share of the directory and rank 0 begins the attempt; every other rank uploads its share as
        its part; rank 0 uploads the shared files and creates the manifest (with
        ``async_upload``: hard-links them and hands upload and commit to the background thread).

        Args:
            args (TrainingArguments): the run's arguments.
            state (TrainerState): the Trainer's state (``global_step``).
            wait (bool): with ``async_upload``, wait for the commit (preemption, JIT saves).

        Raises:
            IncompleteCheckpointError: (one process) a file the Trainer should have written is
                missing or empty (the message names the directory and the file); nothing is
                committed.
            CommitConflictError: (one process) another run committed this step.
            UploadError: the previous background upload failed.
            DistributedSaveError: (several ranks) any of the above, or a backend failure, on any
                rank; raised on every rank, naming each failing rank and its error. Nothing is
                committed.
            OSError: (one process) a backend failure (with ``async_upload``: raised at the next
                save or the end of training, as ``UploadError``).

        Rank obligations: every rank calls it for the same step (``on_save`` does).
        """
        step = state.global_step
        ranks = Ranks.current()
        directory = Path(args.output_dir) / checkpoint_dirname(step)
        txn, committing = None, False
        try:
            files, attempt, error = {}, None, None
            try:
                files = self._share(directory, step, ranks, args)
                if ranks.rank == 0:
                    self._uploader.wait()
                    txn = self._begin(step)
                    attempt = "skip" if txn is None else txn.attempt_id
            except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
                error = exc
            attempt = ranks.agree(attempt, error, url=self.store.url, step=step)[0]
            if attempt == "skip":
                return
            entries, error = [], None
            if ranks.rank != 0:
                try:
                    entries = self._upload_part(step, attempt, ranks, files)
                except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
                    error = exc
            parts = ranks.agree(entries, error, url=self.store.url, step=step)
            error = None
            if ranks.rank == 0:
                for part in parts[1:]:
                    for entry in part:
                        txn.add_entry(PayloadEntry(**entry))
                committing = True
                try:
                    self._commit_shared(txn, directory, files, args, wait=wait)
                except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
                    error = exc
            ranks.agree(None, error, url=self.store.url, step=step)
        except BaseException:
            # Before the manifest create nothing names the attempt: rank 0 deletes its payloads
            # and every part. After a failed create they stay (a delayed create may still land).
            if txn is not None and not committing:
                txn.abort()
            raise

    def _share(self, directory: Path, step: int, ranks: Ranks, args) -> dict[str, Path]:
        """This rank's files of the directory (a rank that wrote nothing, as ``save_only_model``
        ranks > 0, has no directory: an empty share), checked to be complete.

        Raises:
            IncompleteCheckpointError: a file this rank must have written is missing or empty.
            ValueError: a file of a rank outside the run (see :func:`owner_rank`).
        """
        files = files_of_rank(directory_files(directory), ranks.rank, ranks.world_size) if directory.is_dir() else {}
        missing = missing_files(files, rank=ranks.rank, world_size=ranks.world_size,
                                save_only_model=args.save_only_model,
                                optimizer_in_files=not (args.deepspeed or args.fsdp))
        if missing:
            where = f" on rank {ranks.rank}" if ranks.world_size > 1 else ""
            raise IncompleteCheckpointError(
                f"{directory}: the Trainer's checkpoint of step {step} is incomplete{where} ({'; '.join(missing)}); "
                f"not committed to {self.store.url}")
        return files

    def _begin(self, step: int):
        """A new attempt of ``step``, or ``None`` when this run already committed it."""
        try:
            return self.store.begin(step, world_size=self._world_size, metadata=self._metadata(step))
        except CommitConflictError:
            existing = self.store.manifest(step).metadata.get("run_id") if self.store.status(step) == COMPLETE else None
            if self._lineage is not None and existing == self._lineage.run_id:
                logger.info("step %d is already committed by this run; kept", step)
                return None
            raise

    def _upload_part(self, step: int, attempt: str, ranks: Ranks, files: dict[str, Path]) -> list[dict]:
        with route_background_random(), self.store.begin_part(step, attempt_id=attempt, rank=ranks.rank,
                                                               world_size=ranks.world_size) as part:
            upload_files(part, [FileSnapshot.of(name, path) for name, path in files.items()])
        return [entry.model_dump() for entry in part.entries]

    def _commit_shared(self, txn, directory: Path, files: dict[str, Path], args, *, wait: bool) -> None:
        """Rank 0: upload the shared files and commit, now or (``async_upload``) in the background."""
        if not self.async_upload:
            with route_background_random():
                self._upload_and_commit(txn, [FileSnapshot.of(n, p) for n, p in files.items()], None)
            return
        staging = Path(args.output_dir) / STAGING_DIRNAME / f"{directory.name}-{uuid.uuid4().hex[:8]}"
        try:
            snaps = list(snapshot_files(files, staging).values())
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            txn.abort()
            raise
        self._uploader.submit(lambda: self._upload_and_commit(txn, snaps, staging), label=self.store.step_url(txn.step))
        if wait:
            self._uploader.wait()

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
