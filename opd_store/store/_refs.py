"""Turn what callers pass (a store, a path, a URL, a checkpoint URL) into a store and a step."""

from __future__ import annotations

import os
from typing import Any

from ..format import parse_step_dirname
from ..storage import refuse_mistyped_url
from ._api import BaseStore, ReadableStore
from ._checkpoint_store import CheckpointStore


def as_store(
    target: "BaseStore | str | os.PathLike", storage_options: dict[str, Any] | None = None
) -> BaseStore:
    """Return ``target`` if it is a store (plain or tiered, or a read view such as a
    :class:`~opd_store.store._verified_copy.VerifiedCopy`, which only readers take), else open a
    store at that path or URL."""
    if isinstance(target, ReadableStore):
        return target  # type: ignore[return-value]
    return CheckpointStore(target, storage_options=storage_options)


def split_checkpoint_url(
    checkpoint: str | os.PathLike, storage_options: dict[str, Any] | None = None
) -> tuple[CheckpointStore, int]:
    """Split a checkpoint URL (``.../step-000042``) into its store and step.

    Raises:
        ValueError: the last component is not a canonical ``step-NNNNNN`` name.
    """
    text = os.fspath(checkpoint).rstrip("/")
    if "://" not in text:
        refuse_mistyped_url(text)
        text = os.path.abspath(text)  # a local path, relative or at "/", as the seed's Path allowed
    parent, _, last = text.rpartition("/")
    step = parse_step_dirname(last)
    if step is None:
        raise ValueError(f"not a checkpoint URL (expected .../step-NNNNNN): {text}")
    if parent.endswith(":/") or parent.endswith(":"):
        raise ValueError(f"not a checkpoint URL (no store root): {text}")
    return CheckpointStore(parent or "/", storage_options=storage_options), step


__all__ = ["as_store", "split_checkpoint_url"]
