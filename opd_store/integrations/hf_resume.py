"""Resume a Hugging Face ``Trainer`` run from the newest complete checkpoint of a store.

``trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer))`` on a fresh machine:
find the newest *complete* step (newer uncommitted or damaged steps are skipped with a warning),
check that this run may resume it (the OPD layer's resume rules over ``TrainingArguments`` and the
model config, :mod:`opd_store.integrations.run_config`), fetch every file verified against the
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
from ..store import COMPLETE, CheckpointStore
from . import collective
from .files import fetch_step
from .hf_layout import checkpoint_dirname
from .run_config import check_resume, trainer_run_config

logger = logging.getLogger("opd_store.integrations.transformers")


def store_checkpoint(
    url: str | os.PathLike,
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
        url (str | os.PathLike): the store.
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
        ValueError: neither ``local_dir`` nor ``trainer`` given.
    """
    store = CheckpointStore(url, storage_options=storage_options)
    store.check_reachable()
    if local_dir is None:
        if trainer is None:
            raise ValueError("store_checkpoint needs local_dir or trainer (whose args.output_dir is used)")
        local_dir = trainer.args.output_dir
    if step is None:
        complete = [info for info in store.checkpoints() if info.status == COMPLETE]
        for info in store.checkpoints():
            if info.status != COMPLETE and (not complete or info.step > complete[-1].step):
                logger.warning("%s: skipping step %d (%s: %s)", store.url, info.step, info.status,
                               "; ".join(p.detail for p in info.problems) or "no manifest")
        if not complete:
            logger.warning("%s holds no complete checkpoint; training starts from scratch", store.url)
            return None
        step = complete[-1].step
    elif store.status(step) != COMPLETE:
        raise CheckpointNotFoundError(f"step {step} of {store.url} is {store.status(step)}, not complete")
    if trainer is not None:
        _align_special_tokens(trainer)
        current = trainer_run_config(trainer.args, trainer.model, resume_mode=resume_mode)
        check_resume(store.manifest(step).metadata.get("run_config"), current,
                     checkpoint_url=store.step_url(step), world_size=trainer.args.world_size)
    target = Path(local_dir) / checkpoint_dirname(step)
    # One fetch per distinct (host, directory): ranks sharing a filesystem share the copy, ranks on
    # machines of their own (or with directories of their own) each fetch theirs.
    key = (socket.gethostname(), str(target.resolve()))
    keys = collective.broadcast_from_zero(collective.gather_to_zero(key))
    rank = trainer.args.process_index if trainer is not None else 0
    if keys.index(key) == rank:
        fetch_step(store, step, target)
    collective.barrier()
    return str(target)


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


def resume_from_store(trainer: Any, url: str | os.PathLike, **kwargs: Any):
    """``trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer, **kwargs))``.

    Returns:
        transformers.trainer_utils.TrainOutput: what ``train`` returns.
    """
    return trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer, **kwargs))


__all__ = ["resume_from_store", "store_checkpoint"]
