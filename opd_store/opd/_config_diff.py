"""Comparing a checkpoint's config and provenance with the current run's, field by field: every
difference is collected by dotted path and classified at once against the execution-only
markings (:mod:`opd_store.opd._resume`). Standard library and :mod:`opd_store.errors` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from opd_store.errors import ResumeMismatchError

MAX_SHOWN = 200


class Absent:
    """Stands for a key present on only one side of a comparison."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = Absent()


@dataclasses.dataclass(frozen=True)
class Difference:
    path: str
    saved: Any
    current: Any

    def describe(self) -> str:
        return f"{self.path}: saved {show(self.saved)}, current {show(self.current)}"


@dataclasses.dataclass(frozen=True)
class Markings:
    declared: bool
    execution_only_paths: tuple[str, ...]
    rollout_limit_path: str | None
    execution_only_provenance: frozenset[str]


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def names_of(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(item) for item in value)


def markings_of(config: Any) -> Markings:
    """Read the config's execution-only markings through the duck-typed hooks."""
    paths_hook = getattr(config, "execution_only_paths", None)
    limit_hook = getattr(config, "rollout_limit_path", None)
    provenance = getattr(config, "execution_only_provenance", None)
    if callable(provenance):
        provenance = provenance()
    return Markings(
        declared=callable(paths_hook) or callable(limit_hook) or provenance is not None,
        execution_only_paths=names_of(paths_hook()) if callable(paths_hook) else (),
        rollout_limit_path=limit_hook() if callable(limit_hook) else None,
        execution_only_provenance=frozenset(names_of(provenance)),
    )


def plain(value: Any) -> Any:
    """Normalise containers the way a YAML round trip does: mappings to dicts, tuples to lists."""
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def diff(saved: Any, current: Any, path: str = "") -> list[Difference]:
    """Leaf-level differences by dotted path, including keys present on one side only."""
    saved_is_map = isinstance(saved, Mapping)
    current_is_map = isinstance(current, Mapping)
    if (saved_is_map or saved is ABSENT) and (current_is_map or current is ABSENT) and (
        saved_is_map or current_is_map
    ):
        saved_map = saved if saved_is_map else {}
        current_map = current if current_is_map else {}
        keys = sorted(set(saved_map) | set(current_map), key=str)
        if not keys and saved_is_map != current_is_map:
            return [Difference(path, saved, current)]  # an empty section on one side only
        differences: list[Difference] = []
        for key in keys:
            child = f"{path}.{key}" if path else str(key)
            differences.extend(
                diff(saved_map.get(key, ABSENT), current_map.get(key, ABSENT), child)
            )
        return differences
    if saved != current:
        return [Difference(path, saved, current)]
    return []


def provenance_diff(saved: Mapping | None, current: Mapping | None) -> list[Difference]:
    saved_map = plain(saved or {})
    current_map = plain(current or {})
    return [
        Difference(f"provenance.{key}", saved_map.get(key, ABSENT), current_map.get(key, ABSENT))
        for key in sorted(set(saved_map) | set(current_map))
        if saved_map.get(key, ABSENT) != current_map.get(key, ABSENT)
    ]


def covers(marked: str, path: str) -> bool:
    return path == marked or path.startswith(marked + ".")


def unmarked_reason(config: Any) -> str:
    return (
        f"config type {type(config).__name__} declares no execution-only markings (it offers no "
        "execution_only_paths(), rollout_limit_path() or execution_only_provenance, only "
        "fingerprint() and as_dict()), so no field or provenance entry may change under any "
        "resume mode"
    )


def classify_differences(
    config_diffs: list[Difference],
    provenance_diffs: list[Difference],
    markings: Markings,
    *,
    allow_rollout_limit_change: bool,
) -> tuple[list[str], list[tuple[Difference, str]], bool]:
    """Decide every difference at once: (accepted paths, refused with reasons, limit changed)."""
    accepted: list[str] = []
    refused: list[tuple[Difference, str]] = []
    rollout_limit_changed = False
    limit = markings.rollout_limit_path
    for difference in config_diffs:
        if limit is not None and covers(limit, difference.path):
            if allow_rollout_limit_change:
                accepted.append(difference.path)
                rollout_limit_changed = True
            else:
                refused.append(
                    (difference, "the rollout limit may change only under resume_mode "
                     "'rollout_limit_change'")
                )
        elif any(covers(marked, difference.path) for marked in markings.execution_only_paths):
            accepted.append(difference.path)
        else:
            refused.append((difference, "not marked execution-only"))
    for difference in provenance_diffs:
        key = difference.path.removeprefix("provenance.")
        if key in markings.execution_only_provenance:
            accepted.append(difference.path)
        else:
            refused.append((difference, "provenance key not marked execution-only"))
    return accepted, refused, rollout_limit_changed


def refusal(
    checkpoint_url: str,
    mode: str,
    refused: list[tuple[Difference, str]],
    *,
    header: str = "",
    accepted: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> ResumeMismatchError:
    lines = [f"cannot resume OPD checkpoint {checkpoint_url or '<unnamed>'} under resume_mode "
             f"{mode!r}: {len(refused)} refused difference(s)" + (f"; {header}" if header else "")]
    lines.extend(f"  - {difference.describe()} ({reason})" for difference, reason in refused)
    if accepted:
        lines.append("  accepted (execution-only): " + ", ".join(accepted))
    lines.extend(f"  {note}" for note in notes)
    return ResumeMismatchError("\n".join(lines))


__all__ = [
    "ABSENT",
    "Difference",
    "Markings",
    "classify_differences",
    "covers",
    "diff",
    "markings_of",
    "plain",
    "provenance_diff",
    "refusal",
    "unmarked_reason",
]
