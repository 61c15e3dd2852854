"""Resume modes: may this run resume that checkpoint? (issue 3, item 4)

The seed checked the config fingerprint, the provenance fingerprints and the world size one key at
a time and called a ``validate_execution_change`` it never defined, once per differing key, keeping
only the last call's rollout-limit flag. Here the whole set of differences is collected first and
decided at once, so a later difference can never reset what an earlier one established.

Modes (``config.checkpoint.resume_mode``):

* ``exact`` (default, the seed's only behaviour): config fingerprint, provenance and world size must
  all match.
* ``execution_change``: the parent's ``config.yaml`` and the current config may differ only in
  fields the config marks execution-only; provenance only in keys it marks execution-only.
* ``rollout_limit_change``: as ``execution_change``, and the rollout limit (stopping rule) may
  change.

Whatever the mode, a world-size change is refused: each rank restores its own RNG state.

The config is duck-typed. It must offer ``fingerprint() -> str`` and ``as_dict() -> dict``
(the seed's contract). It may also offer the markings that
:class:`opd_store.opd.config.OPDConfig` provides:

* ``execution_only_paths() -> Iterable[str]``: dotted paths of execution-only fields; a path covers
  everything beneath it;
* ``rollout_limit_path() -> str | None``: dotted path of the rollout limit;
* ``execution_only_provenance``: an iterable of provenance keys that may change (or a callable
  returning one).

A config with none of these has no execution-only markings, so every change is refused under every
mode, and the error says so. This module uses only the standard library and
:mod:`opd_store.errors`; it never imports the config module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from opd_store.errors import ResumeMismatchError

RESUME_MODES = ("exact", "execution_change", "rollout_limit_change")

_MAX_SHOWN = 200


@dataclasses.dataclass(frozen=True)
class ResumeDecision:
    """The outcome of an accepted resume check.

    Attributes:
        mode (str): the resume mode used, one of :data:`RESUME_MODES`.
        rollout_limit_changed (bool): True only under ``rollout_limit_change`` when the rollout
            limit differs from the parent's; the loader then drops the validation baseline and
            records ``rollout_limit_changed_at_update`` (issue 3, item 4, after the seed).
        accepted_changes (tuple[str, ...]): dotted config paths and ``"provenance.<key>"`` entries
            that differed but were allowed. The config is diffed only when its fingerprint
            differs, so execution-only config changes are listed only then; empty when
            fingerprint and provenance both matched.
    """

    mode: str
    rollout_limit_changed: bool
    accepted_changes: tuple[str, ...]


class _Absent:
    """Stands for a key present on only one side of a comparison."""

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


@dataclasses.dataclass(frozen=True)
class _Difference:
    path: str
    saved: Any
    current: Any

    def describe(self) -> str:
        return f"{self.path}: saved {_show(self.saved)}, current {_show(self.current)}"


@dataclasses.dataclass(frozen=True)
class _Markings:
    declared: bool
    execution_only_paths: tuple[str, ...]
    rollout_limit_path: str | None
    execution_only_provenance: frozenset[str]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(item) for item in value)


def _markings_of(config: Any) -> _Markings:
    """Read the config's execution-only markings through the duck-typed hooks."""
    paths_hook = getattr(config, "execution_only_paths", None)
    limit_hook = getattr(config, "rollout_limit_path", None)
    provenance = getattr(config, "execution_only_provenance", None)
    if callable(provenance):
        provenance = provenance()
    return _Markings(
        declared=callable(paths_hook) or callable(limit_hook) or provenance is not None,
        execution_only_paths=_names(paths_hook()) if callable(paths_hook) else (),
        rollout_limit_path=limit_hook() if callable(limit_hook) else None,
        execution_only_provenance=frozenset(_names(provenance)),
    )


def _plain(value: Any) -> Any:
    """Normalise containers the way a YAML round trip does: mappings to dicts, tuples to lists."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _diff(saved: Any, current: Any, path: str = "") -> list[_Difference]:
    """Leaf-level differences by dotted path, including keys present on one side only."""
    saved_is_map = isinstance(saved, Mapping)
    current_is_map = isinstance(current, Mapping)
    if (saved_is_map or saved is _ABSENT) and (current_is_map or current is _ABSENT) and (
        saved_is_map or current_is_map
    ):
        saved_map = saved if saved_is_map else {}
        current_map = current if current_is_map else {}
        keys = sorted(set(saved_map) | set(current_map), key=str)
        if not keys and saved_is_map != current_is_map:
            return [_Difference(path, saved, current)]  # an empty section on one side only
        differences: list[_Difference] = []
        for key in keys:
            child = f"{path}.{key}" if path else str(key)
            differences.extend(
                _diff(saved_map.get(key, _ABSENT), current_map.get(key, _ABSENT), child)
            )
        return differences
    if saved != current:
        return [_Difference(path, saved, current)]
    return []


def _provenance_diff(saved: Mapping | None, current: Mapping | None) -> list[_Difference]:
    saved_map = _plain(saved or {})
    current_map = _plain(current or {})
    return [
        _Difference(f"provenance.{key}", saved_map.get(key, _ABSENT), current_map.get(key, _ABSENT))
        for key in sorted(set(saved_map) | set(current_map))
        if saved_map.get(key, _ABSENT) != current_map.get(key, _ABSENT)
    ]


def _covers(marked: str, path: str) -> bool:
    return path == marked or path.startswith(marked + ".")


def _unmarked_reason(config: Any) -> str:
    return (
        f"config type {type(config).__name__} declares no execution-only markings (it offers no "
        "execution_only_paths(), rollout_limit_path() or execution_only_provenance, only "
        "fingerprint() and as_dict()), so no field or provenance entry may change under any "
        "resume mode"
    )


def _classify(
    config_diffs: list[_Difference],
    provenance_diffs: list[_Difference],
    markings: _Markings,
    *,
    allow_rollout_limit_change: bool,
) -> tuple[list[str], list[tuple[_Difference, str]], bool]:
    """Decide every difference at once: (accepted paths, refused with reasons, limit changed)."""
    accepted: list[str] = []
    refused: list[tuple[_Difference, str]] = []
    rollout_limit_changed = False
    limit = markings.rollout_limit_path
    for difference in config_diffs:
        if limit is not None and _covers(limit, difference.path):
            if allow_rollout_limit_change:
                accepted.append(difference.path)
                rollout_limit_changed = True
            else:
                refused.append(
                    (difference, "the rollout limit may change only under resume_mode "
                     "'rollout_limit_change'")
                )
        elif any(_covers(marked, difference.path) for marked in markings.execution_only_paths):
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


def _refusal(
    checkpoint_url: str,
    mode: str,
    refused: list[tuple[_Difference, str]],
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


def resume_mode_of(config: Any) -> str:
    """The resume mode a config asks for.

    Args:
        config (Any): any config object; ``config.checkpoint.resume_mode`` is read when present
            (``checkpoint`` may also be a mapping with a ``"resume_mode"`` key).

    Returns:
        str: the mode, or ``"exact"`` when the config has no checkpoint section or no resume mode
        (the seed's only behaviour, so seed-style configs keep it).

    Raises:
        ValueError: the mode is not one of :data:`RESUME_MODES`; the message names it.
    """
    section = getattr(config, "checkpoint", None)
    if isinstance(section, Mapping):
        mode = section.get("resume_mode")
    else:
        mode = getattr(section, "resume_mode", None)
    if mode is None:
        return "exact"
    if mode not in RESUME_MODES:
        raise ValueError(f"unknown resume_mode {mode!r}; expected one of {list(RESUME_MODES)}")
    return mode


def validate_execution_change(
    saved_config_dict: dict,
    config: Any,
    saved_provenance: dict[str, str],
    provenance_fingerprints: dict[str, str],
    *,
    allow_rollout_limit_change: bool,
    checkpoint_url: str = "",
) -> tuple[tuple[str, ...], bool]:
    """Check that only execution-only fields (and maybe the rollout limit) changed.

    The seed called this function without defining it; this is our definition (issue 3, item 4).
    Nested dicts are compared leaf by leaf by dotted path, keys present on one side only included;
    tuples and lists compare equal, as they do after the YAML round trip of ``config.yaml``.
    Provenance is compared key by key; an added or removed key is a difference. Every difference is
    classified before anything is decided, so the rollout-limit flag cannot be reset by another
    difference (the seed's per-key loop could do that).

    Args:
        saved_config_dict (dict): the parent's ``config.yaml``, parsed with ``yaml.safe_load``.
        config (Any): the current config; ``as_dict()`` is diffed against ``saved_config_dict`` and
            its markings (see the module docstring) decide which differences are allowed.
        saved_provenance (dict[str, str]): the parent's provenance fingerprints.
        provenance_fingerprints (dict[str, str]): this run's provenance fingerprints.
        allow_rollout_limit_change (bool): whether the rollout limit may differ
            (``rollout_limit_change`` mode).
        checkpoint_url (str): named in error messages.

    Returns:
        tuple[tuple[str, ...], bool]: the differing paths that were accepted (config paths sorted,
        then ``"provenance.<key>"``), and whether the rollout limit changed.

    Raises:
        ResumeMismatchError: any difference is not allowed; the message names the checkpoint and
            every refused difference with its dotted path, saved and current values and reason.
            Also raised when ``saved_config_dict`` is not a mapping. A config without markings
            refuses every difference, and the message says why.
    """
    mode = "rollout_limit_change" if allow_rollout_limit_change else "execution_change"
    if not isinstance(saved_config_dict, Mapping):
        raise ResumeMismatchError(
            f"cannot resume OPD checkpoint {checkpoint_url or '<unnamed>'} under resume_mode "
            f"{mode!r}: its config.yaml is a {type(saved_config_dict).__name__}, not a mapping"
        )
    config_diffs = _diff(_plain(saved_config_dict), _plain(config.as_dict()))
    provenance_diffs = _provenance_diff(saved_provenance, provenance_fingerprints)
    return _decide(
        config_diffs,
        provenance_diffs,
        config,
        allow_rollout_limit_change=allow_rollout_limit_change,
        checkpoint_url=checkpoint_url,
        mode=mode,
    )


def _decide(
    config_diffs: list[_Difference],
    provenance_diffs: list[_Difference],
    config: Any,
    *,
    allow_rollout_limit_change: bool,
    checkpoint_url: str,
    mode: str,
) -> tuple[tuple[str, ...], bool]:
    markings = _markings_of(config)
    if not markings.declared and (config_diffs or provenance_diffs):
        refused = [(d, "no execution-only markings") for d in config_diffs + provenance_diffs]
        raise _refusal(checkpoint_url, mode, refused, header=_unmarked_reason(config))
    accepted, refused, rollout_limit_changed = _classify(
        config_diffs, provenance_diffs, markings,
        allow_rollout_limit_change=allow_rollout_limit_change,
    )
    if refused:
        raise _refusal(checkpoint_url, mode, refused, accepted=accepted)
    return tuple(accepted), rollout_limit_changed


def validate_resume(
    *,
    checkpoint_url: str,
    saved_config_fingerprint: str,
    saved_provenance: dict[str, str],
    saved_world_size: int,
    saved_config_dict: dict | None,
    config: Any,
    provenance_fingerprints: dict[str, str],
    world_size: int,
) -> ResumeDecision:
    """Decide whether this run may resume a checkpoint, under the config's resume mode.

    Order of the rules:

    1. World size must match, under every mode (issue 3, item 4; each rank restores its own RNG).
    2. Fingerprint and provenance both match: accepted without diffing (the seed's ``exact`` rule;
       the fingerprint stands for the config).
    3. ``exact``: any mismatch is refused (the seed). The message lists the differing config fields
       when ``saved_config_dict`` is given, and says which other mode would accept the change.
    4. Other modes with a config that declares no markings: refused, saying why (issue 3, item 4).
    5. Fingerprint matches, provenance differs: only provenance is judged (the config is unchanged
       as far as its fingerprint can tell).
    6. Fingerprint differs and no ``config.yaml``: refused, nothing to diff.
    7. Otherwise :func:`validate_execution_change`. If the dicts are identical although the
       fingerprints differ (the config's fingerprint definition changed), the change is accepted,
       since every field it could be in is equal.

    Args:
        checkpoint_url (str): the checkpoint, named in every error.
        saved_config_fingerprint (str): the parent's ``config_fingerprint``.
        saved_provenance (dict[str, str]): the parent's provenance fingerprints.
        saved_world_size (int): the parent's world size.
        saved_config_dict (dict | None): the parent's ``config.yaml`` parsed with
            ``yaml.safe_load``; ``None`` if the checkpoint has none.
        config (Any): an ``OPDConfig`` or any object with ``fingerprint()`` and ``as_dict()``.
        provenance_fingerprints (dict[str, str]): this run's provenance fingerprints.
        world_size (int): this run's world size.

    Returns:
        ResumeDecision: the mode used, whether the rollout limit changed, and the accepted changes.

    Raises:
        ResumeMismatchError: the resume is refused; the message names the checkpoint URL and every
            differing field (dotted path, saved value, current value), or both world sizes.
        ValueError: the config asks for an unknown resume mode.
    """
    url = checkpoint_url or "<unnamed>"
    if saved_world_size != world_size:
        raise ResumeMismatchError(
            f"cannot resume OPD checkpoint {url}: it was saved with world_size {saved_world_size} "
            f"and this run has world_size {world_size}; a world-size change is refused under "
            "every resume mode (each rank restores its own RNG state)"
        )
    mode = resume_mode_of(config)
    current_fingerprint = config.fingerprint()
    fingerprint_matches = saved_config_fingerprint == current_fingerprint
    provenance_diffs = _provenance_diff(saved_provenance, provenance_fingerprints)
    if fingerprint_matches and not provenance_diffs:
        return ResumeDecision(mode=mode, rollout_limit_changed=False, accepted_changes=())

    fingerprint_diff = _Difference(
        "config_fingerprint", saved_config_fingerprint, current_fingerprint
    )
    config_diffs: list[_Difference] | None = None
    if not fingerprint_matches:
        config_diffs = (
            _diff(_plain(saved_config_dict), _plain(config.as_dict()))
            if isinstance(saved_config_dict, Mapping)
            else None
        )
    markings = _markings_of(config)

    if mode == "exact":
        raise _exact_refusal(
            url, fingerprint_matches, fingerprint_diff, config_diffs, provenance_diffs, markings,
            config,
        )
    if not markings.declared:
        refused = [] if fingerprint_matches else [(fingerprint_diff, "config changed")]
        refused += [(d, "no execution-only markings") for d in (config_diffs or [])]
        refused += [(d, "no execution-only markings") for d in provenance_diffs]
        raise _refusal(url, mode, refused, header=_unmarked_reason(config))

    allow = mode == "rollout_limit_change"
    if fingerprint_matches:
        accepted, changed = _decide(
            [], provenance_diffs, config,
            allow_rollout_limit_change=allow, checkpoint_url=url, mode=mode,
        )
    elif saved_config_dict is None:
        raise _refusal(
            url, mode, [(fingerprint_diff, "config changed")],
            header="the checkpoint has no config.yaml, so the changed fields cannot be told apart "
            "from execution-only ones",
        )
    else:
        accepted, changed = validate_execution_change(
            saved_config_dict, config, saved_provenance, provenance_fingerprints,
            allow_rollout_limit_change=allow, checkpoint_url=url,
        )
    return ResumeDecision(mode=mode, rollout_limit_changed=changed, accepted_changes=accepted)


def _exact_refusal(
    url: str,
    fingerprint_matches: bool,
    fingerprint_diff: _Difference,
    config_diffs: list[_Difference] | None,
    provenance_diffs: list[_Difference],
    markings: _Markings,
    config: Any,
) -> ResumeMismatchError:
    refused: list[tuple[_Difference, str]] = []
    notes: list[str] = []
    if not fingerprint_matches:
        refused.append((fingerprint_diff, "config changed"))
        if config_diffs is None:
            notes.append("the checkpoint has no readable config.yaml: changed fields unknown")
        elif not config_diffs:
            notes.append("config.yaml fields are identical: the config's fingerprint definition "
                         "may have changed")
        execution_only = [
            d for d in config_diffs or []
            if markings.declared
            and not (markings.rollout_limit_path and _covers(markings.rollout_limit_path, d.path))
            and any(_covers(marked, d.path) for marked in markings.execution_only_paths)
        ]
        refused.extend(
            (d, "resume_mode 'exact'") for d in config_diffs or [] if d not in execution_only
        )
        if execution_only:
            notes.append("also differing, execution-only and outside the fingerprint: "
                         + ", ".join(d.path for d in execution_only))
    refused.extend((d, "resume_mode 'exact'") for d in provenance_diffs)
    if not markings.declared:
        notes.append(_unmarked_reason(config))
    elif fingerprint_matches or config_diffs is not None:
        _, still_refused, changed = _classify(
            config_diffs or [], provenance_diffs, markings, allow_rollout_limit_change=True
        )
        if not still_refused:
            better = "rollout_limit_change" if changed else "execution_change"
            notes.append(f"resume_mode {better!r} would accept these changes")
    return _refusal(url, "exact", refused, notes=notes)


__all__ = [
    "RESUME_MODES",
    "ResumeDecision",
    "resume_mode_of",
    "validate_execution_change",
    "validate_resume",
]
