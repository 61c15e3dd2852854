"""Pins: steps that retention and garbage collection never delete.

A pin is one small JSON object ``pins/step-NNNNNN.json`` beside (not inside) the step prefixes:

* the manifest is immutable, so a pin is never written into it or into the step prefix;
* step listing only counts ``step-NNNNNN/manifest.json`` objects, so ``pins/`` is never taken for
  a step (``pins`` is not a step name);
* pinning is one create-only write (the store's commit primitive) and unpinning one delete, so
  two operators pinning at once both succeed and leave one pin.

See docs/protocol.md, "Pins".
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket

from ..errors import CheckpointNotFoundError
from ..format import parse_step_dirname, step_dirname
from ..storage import Meaning, classify
from ._checkpoint_store import CheckpointStore
from ._legacy import LegacyReader
from ._status import UNCOMMITTED

PINS_DIR = "pins"
_SUFFIX = ".json"


def pin_rel(step: int) -> str:
    """Path of ``step``'s pin object relative to the store root (``pins/step-000042.json``)."""
    return f"{PINS_DIR}/{step_dirname(step)}{_SUFFIX}"


def pinned_steps(store: CheckpointStore) -> set[int]:
    """Steps pinned in ``store`` (one delimiter listing of ``pins/``)."""
    _dirs, files = store.storage.list_children(PINS_DIR)
    steps = set()
    for name in files:
        if name.endswith(_SUFFIX):
            step = parse_step_dirname(name[: -len(_SUFFIX)])
            if step is not None:
                steps.add(step)
    return steps


def pin(store: CheckpointStore, step: int, *, reason: str = "") -> bool:
    """Pin ``step`` so that retention and gc never delete it.

    Args:
        store (CheckpointStore): the store.
        step (int): a committed step (any status but ``uncommitted``: a damaged step may be pinned
            for inspection, a legacy one too).
        reason (str): free text kept in the pin object.

    Returns:
        bool: True when this call created the pin, False when the step was already pinned.

    Raises:
        CheckpointNotFoundError: ``step`` has no manifest and no legacy marker (nothing to pin).
    """
    if LegacyReader(store).status(step) == UNCOMMITTED:
        raise CheckpointNotFoundError(f"cannot pin step {step}: no checkpoint at {store.step_url(step)}")
    body = {
        "step": step,
        "pinned_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "by": f"{socket.gethostname()} pid {os.getpid()}",
        "reason": reason,
    }
    try:
        store.storage.create_exclusive(pin_rel(step), (json.dumps(body, indent=1) + "\n").encode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - a lost create race means the pin is there already
        if classify(exc) is Meaning.LOST_RACE:
            return False
        raise
    return True


def unpin(store: CheckpointStore, step: int) -> bool:
    """Remove ``step``'s pin. Returns False when it was not pinned (not an error)."""
    rel = pin_rel(step)
    if store.storage.size(rel) is None:
        return False
    store.storage.delete(rel)
    return True


__all__ = ["PINS_DIR", "pin", "pin_rel", "pinned_steps", "unpin"]
