"""Resume a Hugging Face ``Trainer`` run from the newest complete checkpoint of a store.

``trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer))`` on a fresh machine:
find the newest *intact* step (newer uncommitted or damaged steps are skipped with a warning),
check that this run may resume it (the OPD layer's resume rules over ``TrainingArguments`` and the
model config, :mod:`opd_store.integrations._run_config`), fetch every file verified against the
manifest into ``<output_dir>/checkpoint-N``. ``Trainer.train`` resolves ``resume_from_checkpoint``
before any callback runs, so the fetch happens before the call. Re-exported by
:mod:`opd_store.integrations.transformers`.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError
from ..opd import current_group, decide_on_rank0, load_collective
from ..store import COMPLETE, BaseStore, as_store, newest_intact_step
from ._files import fetch_step
from ._hf_layout import checkpoint_dirname
from ._run_config import check_resume, trainer_run_config

logger = logging.getLogger("opd_store.integrations.transformers")


def store_checkpoint(
    url: str | os.PathLike | BaseStore,
    local_dir: str | os.PathLike | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    trainer: Any = None,
    step: int | None = None,
    resume_mode: str = "exact",
) -> str | None:
    """Fetch the newest complete checkpoint of ``url`` into a local directory for ``Trainer.train``.

    ``trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer))`` resumes a run
    on a fresh machine, and starts it from scratch when the store holds no complete checkpoint
    (the function returns ``None``, which ``train`` reads as "no resume").

    Args:
        url (str | os.PathLike | BaseStore): the store (a URL, or a store: plain or tiered).
        local_dir (str | os.PathLike | None): where ``checkpoint-N`` is created; default
            ``trainer.args.output_dir``.
        storage_options (dict | None): fsspec options.
        trainer (transformers.Trainer | None): when given, the checkpoint's recorded run config is
            checked against ``trainer.args`` and ``trainer.model`` before anything is fetched.
        step (int | None): a given complete step instead of the newest.
        resume_mode (str): see :class:`StoreCallback`.

    Returns:
        str | None: the local checkpoint directory, or ``None`` when the store is empty.

    Raises:
        StoreUnreachableError: the store cannot be used.
        ResumeMismatchError: the checkpoint belongs to another run (names every differing field).
        CheckpointNotFoundError: ``step`` is not complete.
        IntegrityError, IncompleteCheckpointError: a payload differs from its manifest (nothing
            is published locally).
        DistributedLoadError: (several ranks) the fetch failed on some ranks but not all; raised
            on every rank, naming each failing rank and its error.
        ValueError: neither ``local_dir`` nor ``trainer`` given.

    Rank obligations: with a process group of several ranks, every rank calls it (a collective):
    rank 0 chooses and checks the step, every distinct local directory is fetched once.
    """
    store = as_store(url, storage_options)
    store.check_reachable()
    if local_dir is None:
        if trainer is None:
            raise ValueError("store_checkpoint needs local_dir or trainer (whose args.output_dir is used)")
        local_dir = trainer.args.output_dir
    if trainer is not None:
        _align_special_tokens(trainer)

    def decide() -> int | None:
        chosen = _newest_complete(store) if step is None else step
        if chosen is not None and step is not None and store.status(step) != COMPLETE:
            raise CheckpointNotFoundError(f"step {step} of {store.url} is {store.status(step)}, not complete")
        if chosen is not None and trainer is not None:
            current = trainer_run_config(trainer.args, trainer.model, resume_mode=resume_mode)
            check_resume(store.manifest(chosen).metadata.get("run_config"), current,
                         checkpoint_url=store.step_url(chosen), world_size=trainer.args.world_size)
        return chosen

    # Rank 0 decides and broadcasts, so every rank resumes the same step even while another
    # writer (a previous machine's late background upload) commits a newer one.
    group = current_group()
    chosen = decide() if group is None else decide_on_rank0(group, decide)
    if chosen is None:
        return None
    target = Path(local_dir) / checkpoint_dirname(chosen)
    # One fetch per distinct (host, directory): ranks sharing a filesystem share the copy, ranks on
    # machines of their own (or with directories of their own) each fetch theirs. Every rank learns
    # whether every fetch succeeded (a rank failing alone must not leave the others waiting).
    key = (socket.gethostname(), str(target.resolve()))
    if group is None:
        fetch_step(store, chosen, target)
    else:
        keys = group.all_gather(key)
        load_collective(group, lambda: fetch_step(store, chosen, target) if keys.index(key) == group.rank else None)
    return str(target)


def _newest_complete(store: BaseStore) -> int | None:
    """The newest step that verifies deeply, each newer damaged step skipped with a warning naming
    it and the file (:func:`~opd_store.store._resume_guard.newest_intact_step`: a short payload and a
    checksum mismatch alike); ``None`` with a warning when the store holds no intact step."""
    step = newest_intact_step(store)
    if step is None:
        logger.warning("%s holds no complete checkpoint; training starts from scratch", store.url)
    return step


def _align_special_tokens(trainer: Any) -> None:
    """What ``Trainer.train`` does to the model config before training (transformers 5: copy the
    tokenizer's bos/eos/pad ids into ``model.config``), done now so the config compared with the
    checkpoint's is the one the run will train with. Idempotent; absent before transformers 5."""
    try:
        from transformers.trainer_utils import align_special_tokens
    except ImportError:
        return
    if getattr(trainer, "processing_class", None) is not None:
        align_special_tokens(trainer.model, trainer.processing_class)


def resume_from_store(trainer: Any, url: str | os.PathLike | BaseStore, **kwargs: Any):
    """``trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer, **kwargs))``.

    Returns:
        transformers.trainer_utils.TrainOutput: what ``train`` returns.
    """
    return trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer, **kwargs))


__all__ = ["resume_from_store", "store_checkpoint"]
