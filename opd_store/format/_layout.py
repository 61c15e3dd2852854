"""Where the objects of a save go: the key layout, recorded in the manifest. Pure, no I/O.

S3 serves about 3,500 writes and 5,500 reads per second per *partitioned prefix* and answers
``503 SlowDown`` above that; a new prefix starts in one partition and S3 splits a hot key range
over tens of minutes (AWS, "Best practices design patterns: optimizing Amazon S3 performance").
Under the ``step`` layout every object of a save lies under ``step-NNNNNN/<attempt>/``, a key range
no earlier save used, so each save starts in one partition again. The ``spread`` layout puts each
payload under one of ``prefixes`` fixed prefixes ahead of the step, ``.spread/00/`` to
``.spread/ff/``: the same key ranges save after save, which S3 can split once and keep
(docs/protocol.md, "Key layouts")::

    step-000042/manifest.json                         both layouts: the manifest stays here
    step-000042/<attempt>/<name>                      step layout: every payload
    .spread/0a/step-000042/<attempt>/<name>           spread layout: a payload under prefix 0a

The prefix of a payload is ``(rank + h(name)) % prefixes``: ``rank`` the writing rank, ``h`` the
first 4 bytes of the BLAKE2b digest of the name with each run of digits written ``#``. The files
every rank writes differ by their rank number only (DCP's ``__12_0.distcp``, ``rng-rank-12.pt``),
so they hash alike and consecutive ranks land on consecutive prefixes: at 512 ranks over 16
prefixes, 32 each, where a hash of the whole name leaves the busiest prefix with about 45 (its rate
limit is the save's).
Every manifest entry names its prefix (:attr:`PayloadEntry.prefix
<opd_store.format._manifest.PayloadEntry.prefix>`), so readers never recompute it; a manifest
naming a prefix its layout does not allow is refused like a path escaping its attempt.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._names import parse_step_dirname, step_dirname

STEP_LAYOUT = "step"
SPREAD_LAYOUT = "spread"
LAYOUTS = (STEP_LAYOUT, SPREAD_LAYOUT)
SPREAD_DIR = ".spread"
"""The directory under the store root holding the spread prefixes (never a step name)."""
DEFAULT_SPREAD_PREFIXES = 16
"""Prefixes of the spread layout by default: 16 x 3,500 writes per second once S3 has split them."""
MAX_SPREAD_PREFIXES = 256
"""Most prefixes of the spread layout (two hex digits each)."""
_DIGITS = re.compile(r"[0-9]+")


class KeyLayout(BaseModel):
    """The key layout of a save (module docstring); the manifest records it as ``layout``.

    Attributes:
        strategy (str): ``step`` (every object under the step prefix: the layout of every
            checkpoint written before layouts existed) or ``spread``.
        prefixes (int): how many spread prefixes (1 for ``step``; 1 to 256 for ``spread``).

    Raises:
        ValueError: (pydantic's ``ValidationError``) an unknown strategy or a count out of range.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["step", "spread"] = STEP_LAYOUT
    prefixes: int = Field(default=1, ge=1, le=MAX_SPREAD_PREFIXES, strict=True)

    @model_validator(mode="after")
    def _consistent(self) -> "KeyLayout":
        if self.strategy == STEP_LAYOUT and self.prefixes != 1:
            raise ValueError(f"the step layout has one prefix, not {self.prefixes}")
        return self

    @classmethod
    def named(cls, strategy: Any, prefixes: Any = None) -> "KeyLayout":
        """The layout the storage options ``key_layout`` and ``key_prefixes`` ask for.

        Raises:
            ValueError: a strategy that is not ``step`` or ``spread`` (named), or a prefix count
                that is not an integer from 1 to 256 (``step`` takes none).
        """
        if strategy not in LAYOUTS:
            raise ValueError(f"storage option key_layout: unknown layout {strategy!r} (known: {', '.join(LAYOUTS)})")
        if strategy == STEP_LAYOUT:
            if prefixes not in (None, 1):
                raise ValueError(f"storage option key_prefixes={prefixes!r} needs key_layout=spread")
            return cls()
        count = DEFAULT_SPREAD_PREFIXES if prefixes is None else prefixes
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SPREAD_PREFIXES:
            raise ValueError(f"storage option key_prefixes must be an integer from 1 to {MAX_SPREAD_PREFIXES}, "
                             f"got {prefixes!r}")
        return cls(strategy=SPREAD_LAYOUT, prefixes=count)

    @property
    def is_default(self) -> bool:
        """True for the step layout (what a manifest of format version 1 means)."""
        return self.strategy == STEP_LAYOUT

    def prefix_names(self) -> tuple[str, ...]:
        """The spread prefixes, relative to the store root (``.spread/00`` ...); empty for ``step``."""
        if self.strategy == STEP_LAYOUT:
            return ()
        return tuple(spread_prefix(index) for index in range(self.prefixes))

    def prefix_for(self, rank: int, name: str) -> str | None:
        """The prefix of payload ``name`` written by ``rank`` (``None``: the step prefix itself)."""
        if self.strategy == STEP_LAYOUT:
            return None
        shape = _DIGITS.sub("#", name).encode("utf-8")
        digest = int.from_bytes(hashlib.blake2b(shape, digest_size=4).digest(), "big")
        return spread_prefix((rank + digest) % self.prefixes)

    def allows(self, prefix: str | None) -> bool:
        """Whether an entry may lie under ``prefix`` in this layout."""
        return prefix is None if self.strategy == STEP_LAYOUT else prefix in self.prefix_names()


def spread_prefix(index: int) -> str:
    """The spread prefix number ``index`` (``.spread/0a``)."""
    return f"{SPREAD_DIR}/{index:02x}"


def step_rel(step: int, prefix: str | None) -> str:
    """The step's prefix relative to the store root under ``prefix`` (``None``: ``step-NNNNNN``)."""
    return step_dirname(step) if prefix is None else f"{prefix}/{step_dirname(step)}"


def object_rel(step: int, prefix: str | None, path: str) -> str:
    """The key of a payload relative to the store root, from its entry's ``prefix`` and ``path``
    (``<attempt_id>/<name>``)."""
    return f"{step_rel(step, prefix)}/{path}"


def key_in_step(prefix: str | None, path: str) -> str:
    """How a payload is named in a step's object map (:func:`split_step_rel`): ``path`` under the
    step layout, ``<prefix>/<path>`` under a spread prefix."""
    return path if prefix is None else f"{prefix}/{path}"


def split_step_rel(rel: str) -> tuple[int, str] | None:
    """The step of an object relative to the store root and its key in that step's object map
    (:func:`key_in_step`): ``step-000042/a/b`` -> ``(42, "a/b")``, ``.spread/0a/step-000042/a/b`` ->
    ``(42, ".spread/0a/a/b")``; ``None`` for an object of no step (a pin, a probe, the step
    prefix itself)."""
    parts = rel.split("/")
    if parts[0] == SPREAD_DIR:
        if len(parts) < 4 or _spread_index(parts[1]) is None:
            return None
        step = parse_step_dirname(parts[2])
        return None if step is None else (step, "/".join([parts[0], parts[1], *parts[3:]]))
    step = parse_step_dirname(parts[0])
    if step is None or len(parts) < 2 or not parts[1]:
        return None
    return step, "/".join(parts[1:])


def split_key_in_step(key: str) -> tuple[str | None, str]:
    """``(prefix, path)`` of a key in a step's object map (the inverse of :func:`key_in_step`)."""
    parts = key.split("/")
    if parts[0] == SPREAD_DIR and len(parts) >= 3 and _spread_index(parts[1]) is not None:
        return f"{parts[0]}/{parts[1]}", "/".join(parts[2:])
    return None, key


def _spread_index(name: str) -> int | None:
    if len(name) != 2 or any(ch not in "0123456789abcdef" for ch in name):
        return None
    return int(name, 16)


__all__ = [
    "DEFAULT_SPREAD_PREFIXES",
    "KeyLayout",
    "LAYOUTS",
    "MAX_SPREAD_PREFIXES",
    "SPREAD_DIR",
    "SPREAD_LAYOUT",
    "STEP_LAYOUT",
    "key_in_step",
    "object_rel",
    "split_key_in_step",
    "split_step_rel",
    "spread_prefix",
    "step_rel",
]
