"""Resume a Hugging Face ``Trainer`` run from the newest complete checkpoint of a store.

``trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer))`` on a fresh machine:
check that this run may resume the newest committed step (the OPD layer's resume rules over
``TrainingArguments`` and the model config, :mod:`opd_store.integrations._run_config`), fetch every
file verified against the manifest into ``<output_dir>/checkpoint-N`` (the fetch is the check:
each payload is downloaded once), and fetch the Trainer's best checkpoint with it. A damaged or
uncommitted newer step is skipped with a warning (the rule every entry point keeps:
:mod:`opd_store.store._resume_guard`, docs/resume.md). ``Trainer.train`` resolves
``resume_from_checkpoint`` before any callback runs, so the fetch happens before the call.
Re-exported by :mod:`opd_store.integrations.transformers`.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError
from ..opd import current_group, decide_on_rank0, load_collective
from ..store import COMPLETE, BaseStore, as_store
from ._files import fetch_step
from ._hf_layout import TRAINER_STATE_NAME, checkpoint_dirname, step_of_dirname
from ._run_config import check_resume, check_trainer_resume_mode, trainer_run_config

logger = logging.getLogger("opd_store.integrations.transformers")

FETCH_MARKER_PREFIX = ".opd-store-fetch-"
"""Name prefix of the empty file each rank creates in its ``local_dir`` for a moment, so that ranks
whose directories are one directory (one host, or hosts sharing a filesystem) fetch it once."""


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
    (the function returns ``None``, which ``train`` reads as "no resume"). Newer steps that are
    uncommitted or damaged (a payload missing, short or altered) are skipped with a warning naming
    the step and the file; each payload of the resumed step is downloaded once, verified as it
    lands. The checkpoint its ``trainer_state.json`` names as best (``best_model_checkpoint``) is
    fetched beside it, and that field pointed at it, so ``load_best_model_at_end`` ends on it.

    Args:
        url (str | os.PathLike | BaseStore): the store (a URL, or a store: plain or tiered).
        local_dir (str | os.PathLike | None): where ``checkpoint-N`` is created; default
            ``trainer.args.output_dir``.
        storage_options (dict | None): fsspec options.
        trainer (transformers.Trainer | None): when given, the checkpoint's recorded run config is
            checked against ``trainer.args`` and ``trainer.model`` before anything is fetched.
        step (int | None): a given complete step instead of the newest (not skipped if damaged).
        resume_mode (str): see :class:`StoreCallback` (``elastic`` is refused).

    Returns:
        str | None: the local checkpoint directory, or ``None`` when the store is empty.

    Raises:
        StoreUnreachableError: the store cannot be used.
        ResumeMismatchError: the checkpoint belongs to another run (names every differing field).
        CheckpointNotFoundError: ``step`` is not complete.
        IntegrityError, IncompleteCheckpointError: a payload of the given ``step`` differs from its
            manifest (nothing is published locally).
        DistributedLoadError: (several ranks) the fetch failed on some ranks but not all; raised
            on every rank, naming each failing rank and its error.
        ValueError: neither ``local_dir`` nor ``trainer`` given, or ``resume_mode='elastic'``.

    Rank obligations: with a process group of several ranks, every rank calls it (a collective):
    rank 0 chooses, checks and fetches the step; every other distinct local directory (found by
    the filesystem, so hosts sharing one fetch it once) is fetched once, after.
    """
    check_trainer_resume_mode(resume_mode)
    store = as_store(url, storage_options)
    store.check_reachable()
    if local_dir is None:
        if trainer is None:
            raise ValueError("store_checkpoint needs local_dir or trainer (whose args.output_dir is used)")
        local_dir = trainer.args.output_dir
    local = Path(local_dir)
    current = None
    if trainer is not None:
        _align_special_tokens(trainer)
        current = trainer_run_config(trainer.args, trainer.model, resume_mode=resume_mode)

    def check(chosen: int, manifest) -> None:
        if current is not None:
            check_resume(manifest.metadata.get("run_config"), current, checkpoint_url=store.step_url(chosen),
                         world_size=trainer.args.world_size)

    def choose_and_fetch() -> int | None:
        if step is None:
            return _newest_intact_fetched(store, local, check)
        if store.status(step) != COMPLETE:
            raise CheckpointNotFoundError(f"step {step} of {store.url} is {store.status(step)}, not complete")
        manifest = store.manifest(step)
        check(step, manifest)
        _fetch_with_best(store, step, local, manifest)
        return step

    # Rank 0 decides (and fetches) and broadcasts, so every rank resumes the same step even while
    # another writer (a previous machine's late background upload) commits a newer one. Every rank
    # learns whether every fetch succeeded (a rank failing alone must not leave the others waiting).
    group = current_group()
    if group is None:
        chosen = choose_and_fetch()
    else:
        fetches = _fetches_its_directory(group, local)
        chosen = decide_on_rank0(group, choose_and_fetch)
        if chosen is not None:
            load_collective(group, lambda: _fetch_with_best(store, chosen, local) if fetches and group.rank else None)
    return None if chosen is None else str(local / checkpoint_dirname(chosen))


def _newest_intact_fetched(store: BaseStore, local: Path, check: Callable[[int, Any], None]) -> int | None:
    """Fetch the newest step that is complete and whose bytes match its manifest; return it.

    Steps are tried newest first (one listing, one manifest read per committed step): one that is
    not complete by the listing (uncommitted, a payload missing or short) is skipped without a
    download; a complete one is checked (``check``: the run config) and fetched, and a payload whose
    CRC32C differs (found while it downloads) skips it too, nothing of it published. Each skipped
    step is one warning ``URL: skipped step N (<status>: <what, naming the file>)``; ``None``, with
    a warning, when no step is intact.
    """
    for info in reversed(store.checkpoints()):
        if info.status != COMPLETE:
            detail = "; ".join(p.detail for p in info.problems) or "no manifest"
            logger.warning("%s: skipped step %d (%s: %s)", store.url, info.step, info.status, detail)
            continue
        check(info.step, info.manifest)
        try:
            _fetch_with_best(store, info.step, local, info.manifest)
        except (IntegrityError, IncompleteCheckpointError) as exc:
            status = "corrupt" if isinstance(exc, IntegrityError) else "incomplete"
            logger.warning("%s: skipped step %d (%s: %s)", store.url, info.step, status, exc)
            continue
        return info.step
    logger.warning("%s holds no complete checkpoint; training starts from scratch", store.url)
    return None


def _fetch_with_best(store: BaseStore, step: int, local: Path, manifest=None) -> None:
    """Fetch ``step`` into ``local/checkpoint-<step>``, then the best checkpoint its
    ``trainer_state.json`` names, and point ``best_model_checkpoint`` at the local copy.

    The Trainer drops a ``best_model_checkpoint`` that is not a local directory when it resumes
    (and then ends a ``load_best_model_at_end`` run on its last weights), and the recorded path is
    the saving machine's. A best checkpoint the store no longer holds intact is a warning naming
    the step; the resume goes on without it, as the Trainer's own would.

    Raises:
        IntegrityError, IncompleteCheckpointError: a payload of ``step`` is damaged (from
            :func:`fetch_step`; nothing is published).
    """
    target = fetch_step(store, step, local / checkpoint_dirname(step), manifest=manifest)
    state_path = target / TRAINER_STATE_NAME
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # not a Trainer checkpoint (a directory stored by other means): nothing refers to a best
    best = step_of_dirname(state.get("best_model_checkpoint")) if isinstance(state, dict) else None
    if best is None:
        return
    best_dir = local / checkpoint_dirname(best)
    if best != step:
        try:
            fetch_step(store, best, best_dir)
        except (CheckpointNotFoundError, IntegrityError, IncompleteCheckpointError) as exc:
            logger.warning("%s: the best checkpoint of step %d (step %d, its best_model_checkpoint) cannot be "
                           "fetched (%s); load_best_model_at_end will end on the last weights unless a later "
                           "evaluation sets a new best", store.url, step, best, exc)
            return
    if state["best_model_checkpoint"] != str(best_dir):
        state["best_model_checkpoint"] = str(best_dir)
        temp = state_path.with_name(f".{TRAINER_STATE_NAME}.{uuid.uuid4().hex[:8]}")
        temp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")  # TrainerState's format
        os.replace(temp, state_path)


def _fetches_its_directory(group: Any, local: Path) -> bool:
    """Whether this rank of ``group`` (the process group's ``RankGroup``) fetches into ``local``:
    the lowest rank of the ranks whose ``local`` is the same directory, found by the filesystem
    (each rank creates a marker file there and looks for the others'), not by host name and path:
    hosts sharing an output directory over a network filesystem would otherwise both fetch
    ``checkpoint-N`` and collide publishing it ("Directory not empty"). A rank that cannot create
    its marker fetches alone (and its fetch names why).

    Rank obligations: a collective (two ``all_gather``): every rank calls it.
    """
    token = uuid.uuid4().hex
    marker = local / f"{FETCH_MARKER_PREFIX}{token}"
    try:
        local.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        marker = None
    tokens = group.all_gather(token if marker is not None else None)
    if marker is None:
        same = [group.rank]
    else:
        same = [rank for rank, other in enumerate(tokens)
                if other is not None and (local / f"{FETCH_MARKER_PREFIX}{other}").exists()]
    group.all_gather(None)  # every rank has looked before any marker goes
    if marker is not None:
        marker.unlink(missing_ok=True)
    return min(same) == group.rank


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


__all__ = ["FETCH_MARKER_PREFIX", "resume_from_store", "store_checkpoint"]
