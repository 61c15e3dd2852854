"""The soak's report: the verdict first, kills per phase, then every start (markdown).

The headline is the verdict of :func:`~opd_testkit.soak_phases.verdict`, not the count of
exact resumes: a run whose kills all landed where nothing is at stake (after the last checkpoint,
before the first update) fails however many of its resumes were exact.
"""

from __future__ import annotations

from typing import Any, Iterable

from .soak_phases import floor_for, phase_counts, required_phases, verdict

PHASE_TEXT = {
    "forward": "mid-update: a module's forward (sampling or the loss)",
    "backward": "mid-update: a module's backward",
    "optimizer_step": "mid-update: after `optimizer.step()`, before the scheduler and counters",
    "between_updates": "between updates (the previous one logged and saved)",
    "payload_stream": "a synchronous save's payload streaming, at a random byte",
    "before_manifest": "every payload written, before the manifest's create",
    "after_commit": "right after the manifest's create, before the job logs the save",
    "retention_delete": "during a retention delete",
    "tier_upload": "a tier upload to the bucket, at a random byte of a payload",
    "async_write": "an asynchronous save's background write, at a random byte of a payload",
}


def phase_table(kills: list[dict[str, Any]], world_size: int = 1) -> list[str]:
    """Markdown rows: phase, what it is, kills, resumes bit-exact (every required phase, then any
    other phase a kill was recorded in)."""
    counts = phase_counts(kills)
    phases = list(required_phases(world_size)) + sorted(set(counts) - set(required_phases(world_size)))
    lines = ["| phase | where the kill lands | kills | resumes bit-exact |", "|---|---|---|---|"]
    for phase in phases:
        mine = [k for k in kills if k["phase"] == phase]
        exact = sum(1 for k in mine if k["resume_problems"] == [])
        lines.append(f"| `{phase}` | {PHASE_TEXT.get(phase, '(not a soak phase)')} | {len(mine)} | {exact} of {len(mine)} |")
    lines.append(f"| all | | {len(kills)} | {sum(1 for k in kills if k['resume_problems'] == [])} of {len(kills)} |")
    return lines


def render(*, kills: list[dict[str, Any]], n: int, header: Iterable[str], starts: Iterable[Any] = (),
           extra_problems: Iterable[str] = (), world_size: int = 1,
           machine: Iterable[tuple[str, str]] = ()) -> tuple[str, list[str]]:
    """The report and the reasons it fails (empty: it passes).

    Args:
        kills: the counted kills (``phase``, ``where``, ``tag``, ``resume_problems``).
        n: kills asked for.
        header: bullet lines describing the run (store, job, seeds).
        starts: :class:`~opd_testkit.soak.Start` objects, one table row each.
        extra_problems: failures outside the resumes (a spot run's first start).
    """
    problems = verdict(kills, n, world_size) + list(extra_problems)
    exact = sum(1 for k in kills if k["resume_problems"] == [])
    head = (f"**PASSED**: {len(kills)} kills, every phase at least {floor_for(n, world_size)}, "
            f"resumes bit-exact: {exact} of {len(kills)}" if not problems
            else "**FAILED**: " + "; ".join(problems))
    lines = [*header, "", head, "", "## Kills per phase", "", *phase_table(kills, world_size), ""]
    rows = list(starts)
    if rows:
        lines += ["## Starts", "",
                  "| start | spot run | options | resumed from | armed kill point | outcome | updates logged | check |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in rows:
            options = " ".join(f for f in s.flags if not f.startswith("/")) or "-"
            check = "yes" if not s.problems else "NO: " + "; ".join(s.problems[:3])
            check = check if s.after_kill else f"(first start) {check}"
            lines.append(f"| {s.tag} | {s.prefix} | {options} | {'fresh' if s.resumed is None else s.resumed} | "
                         f"{(s.plan.phase + ': ' + s.plan.where) if s.plan else '-'} | {s.outcome} | "
                         f"{len(s.log)} | {check} |")
        lines.append("")
    machine = list(machine)
    if machine:
        lines += ["## Machine", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in machine)]
    return "\n".join(lines) + "\n", problems


__all__ = ["PHASE_TEXT", "phase_table", "render"]
