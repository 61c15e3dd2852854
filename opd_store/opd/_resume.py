"""Resume modes: may this run resume that checkpoint? (docs/resume.md, "Resume modes").

The seed checked differences one key at a time and could reset its rollout-limit flag; here the
whole set is collected first and decided at once. The config is duck-typed: ``fingerprint()`` and
``as_dict()`` (the seed's contract), optionally the markings of
:class:`opd_store.opd._config.OPDConfig`: ``execution_only_paths()`` (dotted paths, each covering
everything beneath it), ``rollout_limit_path()`` and ``execution_only_provenance`` (keys, or a
callable returning them). Without markings every change is refused, and the error says so.
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
        rollout_limit_changed (bool): only under ``rollout_limit_change``, when the limit differs; the
            loader then resets the validation baseline (the seed's rule).
        accepted_changes (tuple[str, ...]): allowed differing config paths (diffed only when the
            fingerprint differs) and ``"provenance.<key>"`` entries.
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
        config (Any): ``config.checkpoint.resume_mode`` is read when present (``checkpoint`` may be a
            mapping).

    Returns:
        str: the mode; ``"exact"`` (the seed's only behaviour) when the config names none.

    Raises:
        ValueError: the mode is not one of :data:`RESUME_MODES`.
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

    The seed called this function without defining it. Dicts are compared leaf by leaf by dotted
    path (keys on one side included; tuples equal lists, as after the YAML round trip); provenance
    key by key. Every difference is classified before anything is decided.

    Args:
        saved_config_dict (dict): the parent's ``config.yaml``, parsed with ``yaml.safe_load``.
        config (Any): the current config; its markings decide which differences are allowed.
        saved_provenance, provenance_fingerprints (dict[str, str]): the parent's and this run's.
        allow_rollout_limit_change (bool): whether the rollout limit may differ.
        checkpoint_url (str): named in error messages.
        mode (str | None): the mode named in errors; default from ``allow_rollout_limit_change``.

    Returns:
        tuple[tuple[str, ...], bool]: the accepted differing paths (config paths sorted, then
        ``"provenance.<key>"``), and whether the rollout limit changed.

    Raises:
        ResumeMismatchError: a difference is not allowed (each named with dotted path, saved and
            current values and reason), or ``saved_config_dict`` is not a mapping.
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

    Rules, in order: (1) world size must match except under ``elastic``; (2) fingerprint and
    provenance both match: accepted (the seed); (3) ``exact``: any mismatch refused, naming the
    differing fields and the mode that would accept them; (4) a config without markings: refused;
    (5) only provenance differs: only provenance is judged; (6) fingerprint differs and no
    ``config.yaml``: refused; (7) otherwise :func:`validate_execution_change` (identical dicts under
    different fingerprints are accepted).

    Args:
        checkpoint_url (str): named in every error.
        saved_config_fingerprint (str), saved_provenance (dict[str, str]), saved_world_size (int):
            the parent's.
        saved_config_dict (dict | None): the parent's parsed ``config.yaml``, ``None`` if absent.
        config (Any): an object with ``fingerprint()`` and ``as_dict()``.
        provenance_fingerprints (dict[str, str]), world_size (int): this run's.

    Returns:
        ResumeDecision: the mode used, whether the rollout limit changed, the accepted changes.

    Raises:
        ResumeMismatchError: refused, naming the URL and every differing field or both world sizes.
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
