"""Resume modes: may this run resume that checkpoint?

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
* ``elastic``: as ``execution_change``, and the world size may change (a job back from a
  preemption with fewer or more machines). What the loaders then restore is the elastic policy of
  :mod:`opd_store.opd._elastic` (docs/resume.md, "Elastic resume").

Under every other mode a world-size change is refused, naming both sizes: each rank restores its
own RNG state, and a different number of ranks has no exact next update.

The config is duck-typed. It must offer ``fingerprint() -> str`` and ``as_dict() -> dict``
(the seed's contract). It may also offer the markings that
:class:`opd_store.opd._config.OPDConfig` provides:

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
from collections.abc import Mapping
from typing import Any

from opd_store.errors import ResumeMismatchError

from ._config_diff import (
    Difference,
    Markings,
    classify_differences,
    covers,
    diff,
    markings_of,
    plain,
    provenance_diff,
    refusal,
    unmarked_reason,
)

RESUME_MODES = ("exact", "execution_change", "rollout_limit_change", "elastic")
ELASTIC = "elastic"


@dataclasses.dataclass(frozen=True)
class ResumeDecision:
    """The outcome of an accepted resume check.

    Attributes:
        mode (str): the resume mode used, one of :data:`RESUME_MODES`.
        rollout_limit_changed (bool): True only under ``rollout_limit_change`` when the rollout
            limit differs from the parent's; the loader then drops the validation baseline and
            records ``rollout_limit_changed_at_update`` (the seed's rule).
        accepted_changes (tuple[str, ...]): dotted config paths and ``"provenance.<key>"`` entries
            that differed but were allowed. The config is diffed only when its fingerprint
            differs, so execution-only config changes are listed only then; empty when
            fingerprint and provenance both matched.
        saved_world_size (int | None): the parent's world size.
        world_size (int | None): this run's; differs from ``saved_world_size`` only under ``elastic``.
    """

    mode: str
    rollout_limit_changed: bool
    accepted_changes: tuple[str, ...]
    saved_world_size: int | None = dataclasses.field(default=None, compare=False)
    world_size: int | None = dataclasses.field(default=None, compare=False)


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
    mode: str | None = None,
) -> tuple[tuple[str, ...], bool]:
    """Check that only execution-only fields (and maybe the rollout limit) changed.

    The seed called this function without defining it; this is our definition.
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
        mode (str | None): the resume mode the user asked for, named in error messages (``elastic``
            judges config changes as ``execution_change`` does); default ``rollout_limit_change`` or
            ``execution_change`` after ``allow_rollout_limit_change``.

    Returns:
        tuple[tuple[str, ...], bool]: the differing paths that were accepted (config paths sorted,
        then ``"provenance.<key>"``), and whether the rollout limit changed.

    Raises:
        ResumeMismatchError: any difference is not allowed; the message names the checkpoint and
            every refused difference with its dotted path, saved and current values and reason.
            Also raised when ``saved_config_dict`` is not a mapping. A config without markings
            refuses every difference, and the message says why.
    """
    mode = mode or ("rollout_limit_change" if allow_rollout_limit_change else "execution_change")
    if not isinstance(saved_config_dict, Mapping):
        raise ResumeMismatchError(
            f"cannot resume OPD checkpoint {checkpoint_url or '<unnamed>'} under resume_mode "
            f"{mode!r}: its config.yaml is a {type(saved_config_dict).__name__}, not a mapping"
        )
    config_diffs = diff(plain(saved_config_dict), plain(config.as_dict()))
    provenance_diffs = provenance_diff(saved_provenance, provenance_fingerprints)
    return _decide(
        config_diffs,
        provenance_diffs,
        config,
        allow_rollout_limit_change=allow_rollout_limit_change,
        checkpoint_url=checkpoint_url,
        mode=mode,
    )


def _decide(
    config_diffs: list[Difference],
    provenance_diffs: list[Difference],
    config: Any,
    *,
    allow_rollout_limit_change: bool,
    checkpoint_url: str,
    mode: str,
) -> tuple[tuple[str, ...], bool]:
    markings = markings_of(config)
    if not markings.declared and (config_diffs or provenance_diffs):
        refused = [(d, "no execution-only markings") for d in config_diffs + provenance_diffs]
        raise refusal(checkpoint_url, mode, refused, header=unmarked_reason(config))
    accepted, refused, rollout_limit_changed = classify_differences(
        config_diffs, provenance_diffs, markings,
        allow_rollout_limit_change=allow_rollout_limit_change,
    )
    if refused:
        raise refusal(checkpoint_url, mode, refused, accepted=accepted)
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

    1. World size must match, under every mode but ``elastic`` (each rank restores its own RNG).
    2. Fingerprint and provenance both match: accepted without diffing (the seed's ``exact`` rule;
       the fingerprint stands for the config).
    3. ``exact``: any mismatch is refused (the seed). The message lists the differing config fields
       when ``saved_config_dict`` is given, and says which other mode would accept the change.
    4. Other modes with a config that declares no markings: refused, saying why.
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
    if saved_world_size != world_size and _mode_or_none(config) != ELASTIC:
        raise ResumeMismatchError(
            f"cannot resume OPD checkpoint {url}: it was saved with world_size {saved_world_size} "
            f"and this run has world_size {world_size}; a world-size change is refused under "
            f"every resume mode except {ELASTIC!r} (each rank restores its own RNG state; "
            "docs/resume.md, 'Elastic resume')"
        )
    mode = resume_mode_of(config)
    sizes = {"saved_world_size": saved_world_size, "world_size": world_size}
    current_fingerprint = config.fingerprint()
    fingerprint_matches = saved_config_fingerprint == current_fingerprint
    provenance_diffs = provenance_diff(saved_provenance, provenance_fingerprints)
    if fingerprint_matches and not provenance_diffs:
        return ResumeDecision(mode=mode, rollout_limit_changed=False, accepted_changes=(), **sizes)

    fingerprint_diff = Difference(
        "config_fingerprint", saved_config_fingerprint, current_fingerprint
    )
    config_diffs: list[Difference] | None = None
    if not fingerprint_matches:
        config_diffs = (
            diff(plain(saved_config_dict), plain(config.as_dict()))
            if isinstance(saved_config_dict, Mapping)
            else None
        )
    markings = markings_of(config)

    if mode == "exact":
        raise _exact_refusal(
            url, fingerprint_matches, fingerprint_diff, config_diffs, provenance_diffs, markings,
            config,
        )
    if not markings.declared:
        refused = [] if fingerprint_matches else [(fingerprint_diff, "config changed")]
        refused += [(d, "no execution-only markings") for d in (config_diffs or [])]
        refused += [(d, "no execution-only markings") for d in provenance_diffs]
        raise refusal(url, mode, refused, header=unmarked_reason(config))

    allow = mode == "rollout_limit_change"
    if fingerprint_matches:
        accepted, changed = _decide(
            [], provenance_diffs, config,
            allow_rollout_limit_change=allow, checkpoint_url=url, mode=mode,
        )
    elif saved_config_dict is None:
        raise refusal(
            url, mode, [(fingerprint_diff, "config changed")],
            header="the checkpoint has no config.yaml, so the changed fields cannot be told apart "
            "from execution-only ones",
        )
    else:
        accepted, changed = validate_execution_change(
            saved_config_dict, config, saved_provenance, provenance_fingerprints,
            allow_rollout_limit_change=allow, checkpoint_url=url, mode=mode,
        )
    return ResumeDecision(mode=mode, rollout_limit_changed=changed, accepted_changes=accepted, **sizes)


def _mode_or_none(config: Any) -> str | None:
    """The config's resume mode, or ``None`` when it names no valid one (decided later)."""
    try:
        return resume_mode_of(config)
    except ValueError:
        return None


def _exact_refusal(
    url: str,
    fingerprint_matches: bool,
    fingerprint_diff: Difference,
    config_diffs: list[Difference] | None,
    provenance_diffs: list[Difference],
    markings: Markings,
    config: Any,
) -> ResumeMismatchError:
    refused: list[tuple[Difference, str]] = []
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
            and not (markings.rollout_limit_path and covers(markings.rollout_limit_path, d.path))
            and any(covers(marked, d.path) for marked in markings.execution_only_paths)
        ]
        refused.extend(
            (d, "resume_mode 'exact'") for d in config_diffs or [] if d not in execution_only
        )
        if execution_only:
            notes.append("also differing, execution-only and outside the fingerprint: "
                         + ", ".join(d.path for d in execution_only))
    refused.extend((d, "resume_mode 'exact'") for d in provenance_diffs)
    if not markings.declared:
        notes.append(unmarked_reason(config))
    elif fingerprint_matches or config_diffs is not None:
        _, still_refused, changed = classify_differences(
            config_diffs or [], provenance_diffs, markings, allow_rollout_limit_change=True
        )
        if not still_refused:
            better = "rollout_limit_change" if changed else "execution_change"
            notes.append(f"resume_mode {better!r} would accept these changes")
    return refusal(url, "exact", refused, notes=notes)


__all__ = [
    "ELASTIC",
    "RESUME_MODES",
    "ResumeDecision",
    "resume_mode_of",
    "validate_execution_change",
    "validate_resume",
]
