"""The soak's phases: what a start can still reach, which kill point to arm next, and the verdict.

The soak (:mod:`opd_testkit.soak`, ``python -m bench.soak``) kills the main job by event, not
by clock: before each start it arms one kill point (:mod:`opd_store.runtime._kill_points`) in a phase that
start will reach, chosen from the reference run's record (its per-update log says which attempted
updates step the optimizer, its checkpoints which payloads a save writes and how large they are).
The phase with the fewest kills so far is chosen (ties at random), so every phase gets its share;
the details (which update, which module call, which payload, which byte) are drawn at random.

:func:`verdict` is what the report's pass/fail rests on: every kill counted was at its armed point
(a kill point that the start never reached is a *miss*, recorded and redrawn, never counted), each
phase got at least its floor of kills, and every resume was bit-exact.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from opd_store.runtime._kill_points import PHASES

MID_UPDATE = ("forward", "backward", "optimizer_step")
SINGLE_PROCESS_ONLY = ("tier_upload", "async_write")  # the job refuses --async-save/--local-tier with --nproc > 1
RANK0_ONLY = ("before_manifest", "after_commit", "retention_delete")  # rank 0 commits and runs retention
# Torch hook calls per attempted update of the main job (measured: the forward pre-hook fires
# 588 to 776 times in an update (sampling and loss), the backward pre-hook 38 or 76 times in one that
# steps); the armed call is drawn below these, so it always falls inside the armed update.
FORWARD_CALLS, BACKWARD_CALLS = 500, 36


def required_phases(world_size: int) -> tuple[str, ...]:
    """The phases a run at ``world_size`` must reach (every one in :data:`PHASES` for one rank)."""
    return tuple(p for p in PHASES if world_size == 1 or p not in SINGLE_PROCESS_ONLY)


def floor_for(n: int, world_size: int) -> int:
    """Kills each phase needs in a run of ``n`` kills: 4 once ``n`` allows it, at least 1."""
    return max(1, min(4, n // len(required_phases(world_size))))


@dataclasses.dataclass(frozen=True)
class Reference:
    """What the uninterrupted reference run did.

    Attributes:
        log (dict[int, dict]): attempted update (1-based) -> its log record.
        payloads (dict[int, dict[str, int]]): checkpoint step -> payload name -> size in bytes.
    """

    log: dict[int, dict[str, Any]]
    payloads: dict[int, dict[str, int]]

    @property
    def saves(self) -> list[int]:
        return sorted(self.payloads)

    def attempted_at(self, step: int | None) -> int:
        """The attempted-update count when the run reached ``step`` successful updates (0 fresh)."""
        if not step:
            return 0
        return min(a for a, record in self.log.items() if record["step"] == step and record["ok"])


@dataclasses.dataclass
class StartPlan:
    """One start's kill point: ``kill`` is the :data:`~opd_store.runtime._kill_points.ENV_VAR` plan (without
    ``report``), ``flags`` the job options the phase needs, ``where`` a short description."""

    phase: str
    kill: dict[str, Any]
    flags: list[str]
    where: str


def reachable_phases(ref: Reference, resume_step: int | None, older_steps: bool, world_size: int) -> list[str]:
    """The phases a start resuming from ``resume_step`` (``None``: fresh) still reaches.

    ``older_steps``: the store holds a complete step older than ``resume_step`` (retention's first
    delete then falls on a step of an earlier start, already compared with the reference).
    """
    first = ref.attempted_at(resume_step)
    attempts = [a for a in sorted(ref.log) if a > first]
    saves = [s for s in ref.saves if s > (resume_step or 0)]
    reach = {
        "forward": bool(attempts),
        "backward": any(ref.log[a]["ok"] for a in attempts),
        "optimizer_step": any(ref.log[a]["ok"] for a in attempts),
        "between_updates": len(attempts) >= 2,
        "payload_stream": bool(saves),
        "before_manifest": bool(saves),
        "after_commit": bool(saves),
        # Retention (keep-last 1) deletes only once a step older than the run's newest exists and
        # the resume parent is no longer protected (the run's second checkpoint). Earlier starts'
        # parents can be protected too (killed before their second checkpoint): then it misses.
        "retention_delete": bool(resume_step) and bool(saves) and (older_steps or len(saves) >= 2),
        "tier_upload": bool(saves),
        "async_write": bool(saves),
    }
    return [p for p in required_phases(world_size) if reach[p]]


def plan_start(ref: Reference, resume_step: int | None, older_steps: bool, counts: dict[str, int],
               rng: random.Random, *, world_size: int = 1, last_rank: int | None = None,
               tiered: bool = False) -> StartPlan | None:
    """The next start's kill point, or ``None`` when the start has nothing left to do.

    Args:
        counts: kills so far per phase (the least-killed reachable phase is chosen).
        last_rank: the rank killed last (a multi-rank run kills a different one when it can).
        tiered: every start runs with a local tier (then ``tier_upload`` needs no extra flag).
    """
    phases = reachable_phases(ref, resume_step, older_steps, world_size)
    if not phases:
        return None
    fewest = min(counts.get(p, 0) for p in phases)
    phase = rng.choice([p for p in phases if counts.get(p, 0) == fewest])
    first = ref.attempted_at(resume_step)
    saves = [s for s in ref.saves if s > (resume_step or 0)]
    kill: dict[str, Any] = {"phase": phase}
    flags: list[str] = []
    if phase in MID_UPDATE:
        candidates = [a for a in sorted(ref.log) if a > first and (phase == "forward" or ref.log[a]["ok"])]
        kill["attempted"] = rng.choice(candidates)
        kill["call"] = rng.randint(1, {"forward": FORWARD_CALLS, "backward": BACKWARD_CALLS}.get(phase, 1))
        where = f"update {kill['attempted']}, {phase} hook call {kill['call']}"
    elif phase == "between_updates":
        kill["attempted"] = rng.choice([a for a in sorted(ref.log) if a > first + 1])
        where = f"before update {kill['attempted']}"
    elif phase == "retention_delete":
        kill["object"] = rng.randint(0, 1)
        flags += ["--keep-last", "1"]
        where = ("retention decided, before the first delete" if kill["object"] == 0
                 else "first deleted step's manifest gone, payloads not yet")
    else:
        kill["step"] = step = rng.choice(saves)
        where = f"save of step {step}"
        if phase in ("payload_stream", "tier_upload", "async_write"):
            rank = _pick_rank(rng, world_size, last_rank) if phase == "payload_stream" else 0
            # Rank r > 0 writes only its RNG part; rank 0 everything else and its own part.
            names = sorted(n for n, size in ref.payloads[step].items() if size > 0 and (
                world_size == 1 or n == f"rng-rank-{rank:02d}.pt" or (rank == 0 and not n.startswith("rng-rank-"))))
            kill["name"] = name = rng.choice(names)
            kill["byte"] = rng.randrange(ref.payloads[step][name])
            kill["rank"] = rank if world_size > 1 else None
            where += f", {name} at byte {kill['byte']} of {ref.payloads[step][name]}"
        if phase == "async_write":
            flags.append("--async-save")
        if phase == "tier_upload" and not tiered:
            flags.append("--local-tier")
    if world_size > 1 and "rank" not in kill:
        kill["rank"] = 0 if phase in RANK0_ONLY else _pick_rank(rng, world_size, last_rank)
    if kill.get("rank") is not None and world_size > 1:
        where += f", rank {kill['rank']}"
    return StartPlan(phase, kill, flags, where)


def _pick_rank(rng: random.Random, world_size: int, last_rank: int | None) -> int:
    if world_size == 1:
        return 0
    return rng.choice([r for r in range(world_size) if r != last_rank])


def verdict(kills: list[dict[str, Any]], n: int, world_size: int = 1) -> list[str]:
    """Why a soak run fails (empty: it passes).

    Args:
        kills: one record per counted kill: ``phase`` (where it landed) and ``resume_problems``
            (the checks of the start that resumed after it; empty when bit-exact).
        n: the kills asked for.

    A run fails when it has fewer than ``n`` kills, when a phase of :func:`required_phases` got
    fewer than :func:`floor_for` kills (a kill in any other phase, such as after the last
    checkpoint, counts toward ``n`` but toward no floor), or when a resume was not bit-exact.
    """
    problems = []
    if len(kills) < n:
        problems.append(f"{len(kills)} kills, {n} asked for")
    floor = floor_for(n, world_size)
    counts = phase_counts(kills)
    short = [f"{p} ({counts.get(p, 0)})" for p in required_phases(world_size) if counts.get(p, 0) < floor]
    if short:
        problems.append(f"phases below the floor of {floor} kills: {', '.join(short)}")
    inexact = sum(1 for k in kills if k["resume_problems"])
    if inexact:
        problems.append(f"{inexact} of {len(kills)} resumes not bit-exact")
    return problems


def phase_counts(kills: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kill in kills:
        counts[kill["phase"]] = counts.get(kill["phase"], 0) + 1
    return counts


__all__ = ["Reference", "StartPlan", "floor_for", "phase_counts", "plan_start", "reachable_phases",
           "required_phases", "verdict"]
