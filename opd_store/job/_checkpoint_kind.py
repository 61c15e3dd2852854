"""Whether the main job can resume a checkpoint the way it was started: sharded or replicated.

Each kind loads only with its own loader, so a run started the other way is refused before any
model is built, naming the flag that would resume it (the loaders' own errors would name a missing
payload).
"""

from __future__ import annotations

from ..errors import ResumeMismatchError
from ..format import parse_step_dirname
from ..opd import SCHEMA_SHARDED
from ..store import ReadableStore


def check_checkpoint_kind(store: ReadableStore, checkpoint_url: str | None, *, shard: bool) -> int | None:
    """Refuse to resume ``checkpoint_url`` (a step of ``store``) when it was saved the other way.

    Args:
        store (ReadableStore): the job's store.
        checkpoint_url (str | None): the step to resume; ``None``: no resume.
        shard (bool): whether this run shards (``--shard``).

    Returns:
        int | None: the step's saved world size; ``None`` without a step or a readable manifest.

    Raises:
        ResumeMismatchError: the step is sharded and ``shard`` is off, or the other way round (names
            the step, its URL and the flag); an unreadable (legacy) manifest is left to the loader.
    """
    if checkpoint_url is None:
        return None
    step = parse_step_dirname(checkpoint_url.rstrip("/").rsplit("/", 1)[-1])
    if step is None:
        return None
    try:
        manifest = store.manifest(step)
    except (FileNotFoundError, ValueError):
        return None
    sharded = manifest.metadata.get("opd_schema") == SCHEMA_SHARDED
    if sharded and not shard:
        raise ResumeMismatchError(
            f"step {step} at {checkpoint_url} is a sharded checkpoint (saved with --shard, world size "
            f"{manifest.world_size}); pass --shard to resume it")
    if shard and not sharded:
        raise ResumeMismatchError(
            f"step {step} at {checkpoint_url} is a replicated checkpoint (saved without --shard); "
            "resume it without --shard")
    return manifest.world_size


__all__ = ["check_checkpoint_kind"]
