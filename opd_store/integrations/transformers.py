"""Hugging Face ``Trainer`` (and TRL's trainers) checkpointing into an opd_store store.

Two additions to a training script (docs/integrations.md, "Hugging Face Trainer and TRL")::

    callback = StoreCallback("s3://bucket/run", retention=RetentionPolicy(keep_last=3))
    trainer = GKDTrainer(..., callbacks=[callback])              # or any transformers.Trainer
    trainer.train(resume_from_checkpoint=store_checkpoint("s3://bucket/run", trainer=trainer))

:class:`StoreCallback` commits every ``checkpoint-N`` the Trainer writes as step ``N`` through the
save pipeline (ARCHITECTURE.md, "The save path"): each rank checks its share complete and uploads
its own files as a part of rank 0's attempt; with ``async_upload`` rank 0's files are hard-linked
first and uploaded by :class:`~opd_store.pipeline.BackgroundSaves`. :func:`store_checkpoint` and
:func:`resume_from_store` (:mod:`opd_store.integrations._hf_resume`) fetch the newest intact step.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..errors import BackgroundSaveError, CommitConflictError, IncompleteCheckpointError
from ..opd import current_group, decide_on_rank0, preserve_global_rng
from ..pipeline import AfterCommit, BackgroundSaves, FinishCommit, SaveRequest, run_save, run_save_collective
from ..retention import RetentionPolicy, RunLineage, check_retention
from ..runtime import check_secs
from ..store import COMPLETE, BaseStore, as_store, refuse_damaged_step_ahead
from ._files import FileSnapshot, directory_files, snapshot_files, upload_files
from ._hf_layout import (
    CHECKPOINT_PREFIX,
    JIT_SENTINEL_NAME,
    best_step_of,
    checkpoint_dirname,
    files_of_rank,
    missing_files,
)
from ._hf_resume import resume_from_store, store_checkpoint
from ._run_config import RunConfig, check_resume, check_trainer_resume_mode, trainer_run_config
from ._trainer_journal import DEFAULT_PROGRESS_EVERY_SECS, TrainerJournal

logger = logging.getLogger("opd_store.integrations.transformers")

FRAMEWORK = "transformers"
STAGING_DIRNAME = ".opd-store-staging"
DEFAULT_EXIT_TIMEOUT_SECS = 60.0


class StoreCallback(TrainerCallback):
    """Commit every checkpoint the Trainer saves to a store (docs/integrations.md).

    Args:
        url (str | os.PathLike | BaseStore): a URL (``s3://``, ``gs://``, local path, any fsspec URL)
            or a store, plain or tiered (the end of training waits for a tiered store's uploads).
        storage_options (dict | None): fsspec options of a URL (endpoint, credentials).
        retention (RetentionPolicy | None): applied in the store after each commit (pins and the
            resume parent kept), independent of ``save_total_limit``; ``None`` keeps every checkpoint.
        async_upload (bool): upload and commit on the background worker.
        preemption (PreemptionWatcher | None): started at ``on_train_begin``; on a notice the update
            finishes, the Trainer saves, the callback commits (waiting) and training stops.
        resume_mode (str): ``exact`` (default), ``execution_change`` or ``rollout_limit_change``
            (docs/resume.md); ``elastic`` is refused: the Trainer restores each rank's RNG file and
            data position itself.
        exit_timeout_secs (float): with ``async_upload``, seconds an upload in flight at interpreter
            exit gets before it is abandoned.
        journal_progress_secs (float): seconds between the run journal's ``progress`` events (0: every
            update); rank 0 journals the run (docs/ledger.md, "From other trainers").

    Raises:
        StoreUnreachableError: the store cannot be used; raised here, before training, naming the URL.
        TypeError: ``retention`` is not a ``RetentionPolicy`` or ``None`` (``retention=3``).
        ValueError: an unknown resume mode, ``elastic``, or an ``exit_timeout_secs`` or
            ``journal_progress_secs`` that is negative, NaN or infinite (``opd_store.runtime.check_secs``).

    Rank obligations: every rank constructs the callback and runs the same ``Trainer``; a save's
    collectives run inside ``on_save`` on every rank.
    """

    def __init__(
        self,
        url: str | os.PathLike | BaseStore,
        *,
        storage_options: dict[str, Any] | None = None,
        retention: RetentionPolicy | None = None,
        async_upload: bool = False,
        preemption: Any = None,
        resume_mode: str = "exact",
        exit_timeout_secs: float = DEFAULT_EXIT_TIMEOUT_SECS,
        journal_progress_secs: float = DEFAULT_PROGRESS_EVERY_SECS,
    ) -> None:
        self.retention = check_retention(retention)
        exit_timeout_secs = check_secs(exit_timeout_secs, "exit_timeout_secs")
        journal_progress_secs = check_secs(journal_progress_secs, "journal_progress_secs")
        check_trainer_resume_mode(resume_mode)  # now, not at the first step
        self.store = as_store(url, storage_options)
        self.store.check_reachable()
        self.async_upload = async_upload
        self.preemption = preemption
        self.resume_mode = resume_mode
        self.exit_timeout_secs = float(exit_timeout_secs)
        self.journal_progress_secs = float(journal_progress_secs)
        self.journal: TrainerJournal | None = None  # this training's, from on_train_begin
        self.committed_steps: list[int] = []
        self.preempted_at: int | None = None
        self._notice_step: int | None = None  # the step a preemption notice (ours, or the JIT save's SIGTERM) saves
        self._saved_steps: set[int] = set()  # steps commit() ran for, the same on every rank
        self._saves: BackgroundSaves | None = None
        self._lineage: RunLineage | None = None
        self._run_config: RunConfig | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Check that this run may write the store, record its lineage, clear what a killed process
        left in the output directory (staging links, an unfinished just-in-time save) and, on a tiered
        store, queue the upload of local steps the bucket lacks (``upload_pending``, rank 0). Nothing
        has been trained when it raises.

        Raises:
            ValueError: a DeepSpeed run: its ZeRO files are per-rank shards this callback cannot
                attribute to ranks, so a commit could miss other machines' shards.
            CommitConflictError: the store holds complete checkpoints newer than this run's start step
                (its saves would collide with them).
            IntegrityError: a committed step newer than that is damaged (names it, the file and
                ``opd-store delete``).
            ResumeMismatchError: the resumed step belongs to another run (names every field).

        Rank obligations: every rank runs it; rank 0 decides and every rank raises its error.
        """
        if args.deepspeed or getattr(args, "deepspeed_plugin", None) is not None:
            raise ValueError(
                f"StoreCallback({self.store.url}) does not support DeepSpeed: its ZeRO checkpoint files are per-rank "
                "shards the callback cannot attribute to their ranks, so a commit could miss other machines' shards; "
                "train without DeepSpeed (DDP or FSDP) or checkpoint DeepSpeed runs another way (docs/integrations.md)")
        self._run_config = trainer_run_config(args, model, resume_mode=self.resume_mode)
        resumed = state.global_step

        def parent_step() -> int | None:  # a damaged newer step first: its save would collide too
            refuse_damaged_step_ahead(self.store, resumed, None, f"resuming step {resumed}" if resumed else "from step 0")
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
        group = current_group()
        parent = parent_step() if group is None else decide_on_rank0(group, parent_step)
        self._lineage = RunLineage.new(parent_step=parent)
        if args.process_index == 0:
            # hard links a killed process left (a background upload that never finished): they
            # would keep deleted checkpoints' bytes on disk; nothing of this process is in flight
            shutil.rmtree(Path(args.output_dir) / STAGING_DIRNAME, ignore_errors=True)
            # a tiered store: steps an earlier process committed locally and never uploaded (as the
            # main job at start, docs/tiered.md), else a restart's bucket lags for good
            queued = self.store.upload_pending()
            if queued:
                logger.info("%s: queued the upload of local steps %s", self.store.url, queued)
        _remove_unfinished_jit_saves(Path(args.output_dir), after_step=resumed)
        self.journal = TrainerJournal(self.store, rank=args.process_index, world_size=args.world_size,
                                      progress_every_secs=self.journal_progress_secs)
        self.journal.started(resumed or None, updates=state.max_steps or None, checkpoint_every=_save_steps(args, state),
                             async_save=self.async_upload)
        if self.preemption is not None:
            self.preemption.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.journal is not None:
            self.journal.update_done(state.global_step)
        if self.preemption is not None and self.preemption.should_checkpoint_now() and self.preempted_at is None:
            notice = self.preemption.notice
            logger.warning("preemption notice (%s); saving step %d and stopping", notice.detail if notice else "?",
                           state.global_step)
            self.preempted_at = self._notice_step = state.global_step
            control.should_save = True
            control.should_training_stop = True
            if self.journal is not None:
                self.journal.notice(source=notice.source if notice else "unknown", detail=notice.detail if notice else "",
                                    step=state.global_step, deadline_secs=notice.secs_left() if notice else None,
                                    decision="already_committed" if state.global_step in self._saved_steps else "save")
        self._commit_jit_checkpoint(args, state, control)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._commit_jit_checkpoint(args, state, control)
        if self.journal is not None:
            self.journal.update_began()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._commit_jit_checkpoint(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._commit_jit_checkpoint(args, state, control)

    def on_save(self, args, state, control, **kwargs):
        self.commit(args, state, wait=self.preempted_at is not None)

    def on_train_end(self, args, state, control, **kwargs):
        """Wait for the background upload and the store's own uploads (a tiered store's ``flush``), and
        journal ``exit``.

        Raises:
            BackgroundSaveError: a background upload failed and nobody saw it yet.
            UploadError: (a tiered store) an upload to its bucket failed.
        """
        try:
            saves, self._saves = self._saves, None
            if saves is not None:
                saves.close(at="the end of training")
            self.store.flush()
        except BaseException as exc:
            if self.journal is not None:
                self.journal.exit("failed", state.global_step, exc)
            raise
        else:
            if self.journal is not None:
                self.journal.exit("preempted" if self._notice_step is not None else "finished", state.global_step)
        finally:
            if self.preemption is not None:
                self.preemption.stop()
            staging = Path(args.output_dir) / STAGING_DIRNAME
            if staging.is_dir() and not any(staging.iterdir()):
                staging.rmdir()

    # -- commits ---------------------------------------------------------------------------------
    def _commit_jit_checkpoint(self, args, state, control) -> None:
        """Commit a checkpoint transformers' ``enable_jit_checkpoint`` wrote on SIGTERM: its
        ``CheckpointManager`` calls ``Trainer._save_checkpoint`` directly, so ``on_save`` never fires.
        """
        if not getattr(args, "enable_jit_checkpoint", False) or not control.should_training_stop:
            return
        step = state.global_step
        directory = Path(args.output_dir) / checkpoint_dirname(step)
        if step in self._saved_steps or not directory.is_dir() or (directory / JIT_SENTINEL_NAME).exists():
            return
        logger.warning("committing the just-in-time checkpoint of step %d", step)
        self._notice_step = step
        if self.journal is not None:
            self.journal.notice(source="SIGTERM", detail="transformers' just-in-time checkpoint (enable_jit_checkpoint)",
                                step=step, decision="save", deadline_secs=None)
        self.commit(args, state, wait=True)

    def commit(self, args, state, *, wait: bool = False) -> None:
        """Commit ``<output_dir>/checkpoint-<global_step>`` as step ``global_step``; a step this run
        already committed is left as it is.

        Args:
            args (TrainingArguments): the run's arguments.
            state (TrainerState): the Trainer's state (``global_step``).
            wait (bool): with ``async_upload``, commit before returning (preemption, JIT saves).

        Raises:
            IncompleteCheckpointError: (one process) a file the Trainer should have written is missing,
                empty, or changed while read (names the directory and file); nothing is committed.
            CommitConflictError: (one process) another run committed this step.
            BackgroundSaveError: the previous background upload failed (its error is the cause).
            RetentionError: (one process, synchronous) the step committed and retention failed.
            DistributedSaveError: (several ranks) any of these or a backend failure on any rank; raised
                on every rank naming each (``DistributedCommitConflictError`` for a committed step).
            OSError: (one process) a backend failure (with ``async_upload``: raised later as
                ``BackgroundSaveError``).

        Rank obligations: every rank calls it for the same step (``on_save`` does).
        """
        step = state.global_step
        self._saved_steps.add(step)
        directory = Path(args.output_dir) / checkpoint_dirname(step)
        background = self.async_upload and not wait
        group = current_group()
        journaled = self._journal_save(step)
        with preserve_global_rng():
            if group is None:
                self._sync("the next save")  # the previous upload's failure, before anything new starts
                self._journal_mark(journaled)
                request = self._snapshot(directory, state, 0, 1, args, stage_links=background, journaled=journaled)
                if background:
                    saves = self._background()
                    saves.submit(self._label(step), step, lambda: self._save_once(request, saves.cancelled))
                elif self._save_once(request, None) is None:
                    return
                self._journal_blocking(journaled, None)
                return

            def prepare() -> SaveRequest:
                if group.rank == 0:
                    self._sync("the next save")
                self._journal_mark(journaled)
                return self._snapshot(directory, state, group.rank, group.world_size, args,
                                      stage_links=background and group.rank == 0, journaled=journaled)

            def defer(finish: FinishCommit) -> None:  # rank 0's write, commit and after-commit stage
                saves = self._background()
                saves.submit(self._label(step), step, lambda: finish(cancelled=saves.cancelled))

            try:
                run_save_collective(group, prepare, defer=defer if background else None)
            except CommitConflictError:
                if decide_on_rank0(group, lambda: self._committed_by_this_run(step)):
                    logger.info("step %d is already committed by this run; kept", step)
                    return
                raise
            self._journal_blocking(journaled, group)

    # -- the run journal of saves (opd_store.integrations._trainer_journal) ------------------------
    _SAVE_PARTS = ("commit", "blocking")
    """A save's journal event waits for its commit (rank 0's after-commit stage, on whichever
    thread commits) and for the training thread's return from the save (the seconds it was
    blocked, and the other ranks' bytes and requests)."""

    def _journal_save(self, step: int) -> dict[str, Any] | None:
        """What this save's journal parts share (``None`` before training began): when it began and why."""
        if self.journal is None:
            return None
        return {"step": step, "began": time.monotonic(), "mark": None, "size_bytes": None,
                "reason": "notice" if self._notice_step == step else "periodic"}

    def _journal_mark(self, journaled: dict[str, Any] | None) -> None:
        """Where the request count stands, once the previous background upload ended (so its
        requests are not this save's; the wait for it still counts as blocking)."""
        if journaled is not None:
            journaled["mark"] = self.journal.mark()

    def _journal_commit(self, journaled: dict[str, Any]) -> None:
        """The commit part (rank 0, after its commit): bytes, seconds to commit, this rank's requests."""
        mark = journaled["mark"]
        self.journal.save_part(journaled["step"], "commit", self._SAVE_PARTS, step=journaled["step"],
                               reason=journaled["reason"], size_bytes=journaled["size_bytes"],
                               commit_secs=time.monotonic() - mark.began_monotonic,
                               requests=self.journal.requests_since(mark))

    def _journal_blocking(self, journaled: dict[str, Any] | None, group) -> None:
        """The blocking part, once the save returned; with several ranks every rank's bytes and requests
        are gathered for rank 0 (a collective).
        """
        if journaled is None:
            return
        others, others_bytes = {}, None
        if group is not None:
            mine = ({}, 0) if group.rank == 0 else (self.journal.requests_since(journaled["mark"]),
                                                   journaled["size_bytes"] or 0)
            gathered = group.all_gather(mine)[1:]
            others = {kind: sum(requests.get(kind, 0) for requests, _ in gathered)
                      for kind in {kind for requests, _ in gathered for kind in requests}}
            others_bytes = sum(size for _, size in gathered)
        if self.journal.rank == 0:
            self.journal.save_part(journaled["step"], "blocking", self._SAVE_PARTS, other_ranks_requests=others,
                                   size_bytes=others_bytes,
                                   blocking_secs=time.monotonic() - journaled["began"])

    def _snapshot(self, directory: Path, state, rank: int, world_size: int, args, *,
                  stage_links: bool, journaled: dict[str, Any] | None = None) -> SaveRequest:
        """The snapshot stage of this rank: its share, checked complete (``stage_links``: hard-linked), as
        the pipeline's :class:`SaveRequest`.
        """
        step = state.global_step
        files = self._share(directory, step, rank, world_size, args)
        staging = None
        if stage_links:
            staging = Path(args.output_dir) / STAGING_DIRNAME / f"{directory.name}-{uuid.uuid4().hex[:8]}"
            try:
                snaps = list(snapshot_files(files, staging).values())
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        else:
            snaps = [FileSnapshot.of(name, path) for name, path in files.items()]
        on_commit = [self._record_commit]
        if journaled is not None:
            journaled["size_bytes"] = sum(snap.size_bytes for snap in snaps)
            if rank == 0:
                on_commit.append(lambda after, url: self._journal_commit(journaled))
        return SaveRequest(
            AfterCommit(self.store, step, retention=self.retention, lineage=self._lineage, on_commit=on_commit),
            world_size=world_size, metadata=self._metadata(state, world_size) if rank == 0 else {},
            write=lambda txn, shared: upload_files(txn, snaps),
            release=None if staging is None else (lambda: shutil.rmtree(staging, ignore_errors=True)),
        )

    def _share(self, directory: Path, step: int, rank: int, world_size: int, args) -> dict[str, Path]:
        """This rank's files of the directory (a rank that wrote nothing, as ``save_only_model``
        ranks > 0, has no directory: an empty share), checked to be complete.

        Raises:
            IncompleteCheckpointError: a file this rank must have written is missing or empty.
            ValueError: a file of a rank outside the run (see :func:`owner_rank`).
        """
        files = files_of_rank(directory_files(directory), rank, world_size) if directory.is_dir() else {}
        missing = missing_files(files, rank=rank, world_size=world_size, save_only_model=args.save_only_model,
                                optimizer_in_files=not (args.deepspeed or args.fsdp))
        if missing:
            where = f" on rank {rank}" if world_size > 1 else ""
            raise IncompleteCheckpointError(
                f"{directory}: the Trainer's checkpoint of step {step} is incomplete{where} ({'; '.join(missing)}); "
                f"not committed to {self.store.url}")
        return files

    def _save_once(self, request: SaveRequest, cancelled: threading.Event | None) -> str | None:
        """Write, commit and after-commit with one writer; ``None`` when this run already committed the
        step (the create-only commit refuses another attempt).
        """
        try:
            return run_save(request, cancelled=cancelled)
        except CommitConflictError:
            if not self._committed_by_this_run(request.step):
                raise
            logger.info("step %d is already committed by this run; kept", request.step)
            return None

    def _committed_by_this_run(self, step: int) -> bool:
        if self._lineage is None or self.store.status(step) != COMPLETE:
            return False
        return self.store.manifest(step).metadata.get("run_id") == self._lineage.run_id

    def _record_commit(self, after: AfterCommit, url: str) -> None:
        self.committed_steps.append(after.step)

    def _metadata(self, state, world_size: int) -> dict[str, Any]:
        """The manifest metadata: framework, directory name, lineage, config and ``best_step`` (the
        Trainer's best checkpoint, kept by retention while a kept step names it).
        """
        step = state.global_step
        metadata: dict[str, Any] = {"framework": FRAMEWORK, "checkpoint_name": checkpoint_dirname(step)}
        best = best_step_of(state)
        if best is not None:
            metadata["best_step"] = best
        if self._lineage is not None:
            metadata.update(self._lineage.as_metadata())
        if self._run_config is not None:
            metadata["run_config"] = self._run_config.to_metadata(world_size)
        return metadata

    # -- background uploads ------------------------------------------------------------------
    def _label(self, step: int) -> str:
        return f"upload of step {step} to {self.store.url}"

    def _background(self) -> BackgroundSaves:
        """The owner of this callback's background uploads (made at the first one)."""
        if self._saves is None:
            self._saves = BackgroundSaves(f"opd-hf-upload-{id(self):x}", exit_timeout_secs=self.exit_timeout_secs)
        return self._saves

    def _sync(self, at: str) -> None:
        if self._saves is not None:
            self._saves.sync(at)

    def wait(self) -> None:
        """Block until the background upload in flight (if any) has committed.

        Raises:
            BackgroundSaveError: (an ``OSError``) it failed, or an earlier one did and nobody saw it
                yet (the failure is the ``__cause__``); raised once.
        """
        self._sync("wait()")


def _save_steps(args, state) -> int | None:
    """The Trainer's save interval in updates (``state.save_steps``: a ratio of ``save_steps``
    already made absolute), ``None`` unless it saves every N steps."""
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    return int(state.save_steps) if strategy == "steps" and state.save_steps and state.save_steps >= 1 else None


def _remove_unfinished_jit_saves(output_dir: Path, *, after_step: int) -> None:
    """Remove every ``checkpoint-N`` (``N > after_step``) holding ``checkpoint-is-incomplete.txt``: a
    killed just-in-time save, never committed. The Trainer's next save of ``N`` would not remove the
    sentinel, so every save of ``N`` would be refused on every restart.
    """
    if not output_dir.is_dir():
        return
    for sentinel in output_dir.glob(f"{CHECKPOINT_PREFIX}*/{JIT_SENTINEL_NAME}"):
        step = sentinel.parent.name[len(CHECKPOINT_PREFIX):]
        if step.isdigit() and int(step) > after_step:
            logger.warning("%s: removing the unfinished just-in-time save of step %s (it holds %s); this run saves "
                           "that step again", sentinel.parent, step, JIT_SENTINEL_NAME)
            shutil.rmtree(sentinel.parent, ignore_errors=True)


__all__ = ["BackgroundSaveError", "StoreCallback", "resume_from_store", "store_checkpoint"]
