"""Resume a Hugging Face ``Trainer`` run from the newest complete checkpoint of a store
(docs/integrations.md; the damaged-step rule: docs/resume.md, "A damaged checkpoint").

``Trainer.train`` resolves ``resume_from_checkpoint`` before any callback runs, so the check and
the verified fetch happen before the call.
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

    Newer uncommitted or damaged steps are skipped with a warning naming the step and file; each
    payload is downloaded once, verified as it lands. The best checkpoint ``trainer_state.json``
    names is fetched beside it and pointed at, so ``load_best_model_at_end`` ends on it.

    Args:
        url (str | os.PathLike | BaseStore): the store (a URL, or a plain or tiered store).
        local_dir (str | os.PathLike | None): where ``checkpoint-N`` goes; default ``args.output_dir``.
        storage_options (dict | None): fsspec options.
        trainer (transformers.Trainer | None): its args and model config are checked against the
            checkpoint's before anything is fetched.
        step (int | None): this complete step instead of the newest (not skipped if damaged).
        resume_mode (str): as :class:`StoreCallback` (``elastic`` is refused).

    Returns:
        str | None: the local checkpoint directory; ``None`` (no resume) when the store is empty.

    Rank obligations: with several ranks every rank calls it (a collective): rank 0 chooses, checks
    and fetches; each other distinct local directory is fetched once, after.

    Raises:
        StoreUnreachableError: the store cannot be used.
        ResumeMismatchError: the checkpoint belongs to another run (names every differing field).
        CheckpointNotFoundError: ``step`` is not complete.
        IntegrityError, IncompleteCheckpointError: a payload of the given ``step`` differs from its
            manifest (nothing is published locally).
        DistributedLoadError: (several ranks) the fetch failed on some ranks; raised on every rank.
        ValueError: neither ``local_dir`` nor ``trainer`` given, or ``resume_mode='elastic'``.
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

    Newest first: a step incomplete by the listing is skipped without a download, a complete one is
    checked (``check``) and fetched, and a CRC32C mismatch while downloading skips it too. One warning
    per skipped step; ``None``, with a warning, when no step is intact.
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
    """Fetch ``step`` into ``local/checkpoint-<step>``, then the best checkpoint it names, and point
    ``best_model_checkpoint`` at the local copy (the Trainer drops a non-local one on resume). A best
    checkpoint no longer intact is a warning.

    Raises:
        IntegrityError, IncompleteCheckpointError: a payload of ``step`` is damaged (nothing published).
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
    """Whether this rank fetches into ``local``: the lowest rank sharing that directory, found by
    marker files rather than host names (hosts sharing a network filesystem would otherwise collide
    publishing ``checkpoint-N``). A rank that cannot create its marker fetches alone.

    Rank obligations: a collective (two ``all_gather``).
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
    """What ``Trainer.train`` does to the model config first (transformers 5: the tokenizer's special
    token ids into ``model.config``), done now so the compared config is the trained one.
    """
    try:
        from transformers.trainer_utils import align_special_tokens
    except ImportError:
        return
    if getattr(trainer, "processing_class", None) is not None:
        align_special_tokens(trainer.model, trainer.processing_class)


def resume_from_store(trainer: Any, url: str | os.PathLike | BaseStore, **kwargs: Any):
    """``trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer, **kwargs))``;
    returns ``train``'s ``TrainOutput``.
    """
    return trainer.train(resume_from_checkpoint=store_checkpoint(url, trainer=trainer, **kwargs))


__all__ = ["FETCH_MARKER_PREFIX", "resume_from_store", "store_checkpoint"]
