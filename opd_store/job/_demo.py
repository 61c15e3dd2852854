"""``opd-store demo``: train, lose the machine, resume elsewhere, and prove nothing changed.

An uninterrupted reference run; then a spot run SIGKILLed at a random update boundary (the job's
own kill point), again while a save streams, then run to the end, each start on a fresh "machine"
(only the store carries state). Final weights, optimizer state and loss log must equal the
reference bit for bit, and ``opd-store report`` must say which starts were killed, where, and the
updates redone; any mismatch exits non-zero (README.md, the first section).
"""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..format import MANIFEST_NAME, step_dirname
from ..ledger import report_store
from ..runtime import kill_points
from ..store import CheckpointStore
from ._compare import job_state_differences
from ._machines import fresh_machine


@dataclasses.dataclass
class Start:
    """One process start of the spot run."""

    label: str
    killed: bool
    kill_point: str
    resumed_step: int | None
    saves: list[dict[str, Any]]
    killed_during_save: bool | None = None


def _train_cmd(store_url: str, updates: int, every: int, seed: int, store_args: list[str], log: Path,
               final_state: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "opd_store", "train", "--store", store_url, "--updates", str(updates),
           "--checkpoint-every", str(every), "--seed", str(seed), "--resume", "auto",
           "--log", str(log), "--events", "/dev/stdout", "--journal-progress-secs", "0", *store_args]
    if final_state is not None:
        cmd += ["--final-state", str(final_state)]
    return cmd


def _kill_while_streaming(process: subprocess.Popen, store: CheckpointStore, step: int) -> bool:
    """SIGKILL ``process`` once payload objects of ``step`` exist but its manifest does not.

    Watches the store's step prefix (fresh listings) from the moment the save began. Returns
    False when the manifest appeared first (the save committed before it could be caught); the
    caller then waits for the next save.
    """
    prefix = step_dirname(step)
    while process.poll() is None:
        objects = store.storage.list_tree(prefix)
        if MANIFEST_NAME in objects:
            return False
        if any(name.startswith("attempt-") for name in objects):
            process.send_signal(signal.SIGKILL)
            return True
    return False


def _run_until(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, *, kill_at_attempted: int | None,
               kill_on_save: bool, timeout_secs: float, popen: Callable[..., Any] = subprocess.Popen,
               spot: CheckpointStore | None = None) -> tuple[bool, str, list[dict[str, Any]], int | None]:
    """Run one start; SIGKILL it at the chosen point. Returns (killed, kill point, events, resumed step).

    ``kill_at_attempted`` arms the job's kill point before that attempted update; ``kill_on_save``
    kills while a save streams into ``spot`` (objects written, no manifest). ``popen`` starts it.

    Raises:
        RuntimeError: a start that was not killed exited non-zero (its stderr in the message).
        TimeoutError: the start ran longer than ``timeout_secs``.
    """
    if kill_at_attempted is not None:
        env = dict(env, **{kill_points.ENV_VAR: json.dumps({"phase": "between_updates",
                                                            "attempted": kill_at_attempted})})
    process = popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[dict[str, Any]] = []
    resumed_step = None
    killed = False
    kill_point = "none (ran to the end)"
    deadline = time.monotonic() + timeout_secs
    assert process.stdout is not None
    for line in process.stdout:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        events.append(event)
        if event.get("event") == "resumed":
            resumed_step = event["step"]
        if kill_on_save and event.get("event") == "save_begin" and spot is not None:
            if _kill_while_streaming(process, spot, event["step"]):
                killed, kill_point = True, f"during the save of step {event['step']}"
                break
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"training start timed out after {timeout_secs} s: {' '.join(cmd)}")
    process.wait()
    stderr = process.stderr.read() if process.stderr else ""
    if kill_at_attempted is not None and process.returncode == -signal.SIGKILL:
        killed, kill_point = True, f"after attempted update {kill_at_attempted - 1}"
    if not killed and process.returncode != 0:
        raise RuntimeError(f"training failed (exit {process.returncode}):\n{stderr[-4000:]}")
    return killed, kill_point, events, resumed_step


def _log_entries(paths: list[Path]) -> dict[int, list[dict[str, Any]]]:
    entries: dict[int, list[dict[str, Any]]] = {}
    for path in paths:
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    entries.setdefault(record["attempted_update"], []).append(record)
    return entries


def run_demo(*, store_url: str, store_args: list[str], storage_env: dict[str, str], storage_options: dict[str, Any],
             workdir: Path, updates: int = 8, every: int = 2, seed: int = 0, kill_seed: int | None = None,
             timeout_secs: float = 600.0, popen: Callable[..., Any] = subprocess.Popen, out=None) -> int:
    """Run the whole demo; return 0 when the resumed run matches the reference bit for bit.

    ``popen`` starts each training process (``subprocess.Popen``, or a preloaded fork server's);
    ``out`` (default ``sys.stdout``) gets the report.

    Raises:
        ValueError: ``every < 1`` or ``updates < 2 * every``.
        TimeoutError: a start ran longer than ``timeout_secs``.
        RuntimeError: a start that was not killed exited non-zero (its stderr is in the message).
    """
    out = sys.stdout if out is None else out
    if every < 1 or updates < 2 * every:
        raise ValueError(f"the demo needs --checkpoint-every >= 1 and --updates >= 2 x --checkpoint-every "
                         f"(got {updates} and {every})")
    rng = random.Random(kill_seed)
    workdir.mkdir(parents=True, exist_ok=True)
    reference_url = store_url.rstrip("/") + "/reference"
    spot_url = store_url.rstrip("/") + "/spot"
    print(f"store: {store_url}\nwork directory: {workdir}", file=out)

    ref_log, ref_state = workdir / "reference-log.jsonl", workdir / "reference-final.pt"
    env, cwd = fresh_machine(workdir, storage_env)
    started = time.perf_counter()
    _run_until(_train_cmd(reference_url, updates, every, seed, store_args, ref_log, ref_state), env, cwd, ref_log,
               kill_at_attempted=None, kill_on_save=False, timeout_secs=timeout_secs, popen=popen)
    print(f"reference run: {updates} updates in {time.perf_counter() - started:.1f} s", file=out)

    spot = CheckpointStore(spot_url, storage_options=storage_options)
    # Warm its client now: a first S3 request builds the client (about a second), long enough for
    # a small save to commit before the watcher could see its payloads.
    spot.check_reachable()
    starts: list[Start] = []
    logs: list[Path] = []
    # Start 1 dies 0 to `every - 1` attempted updates after its first checkpoint, before the next
    # one (the reference's log says which attempted update reached it: the runs are identical; the
    # run has `every` attempted updates at least after it); start 2 dies inside its first save;
    # start 3 runs to the end.
    first_save = min(a for a, records in _log_entries([ref_log]).items()
                     if records[0]["step"] == every and records[0]["ok"])
    plan = [("start 1", first_save + rng.randint(1, every), False), ("start 2", None, True),
            ("start 3", None, False)]
    final_state = workdir / "spot-final.pt"
    for index, (label, kill_at, kill_on_save) in enumerate(plan):
        log = workdir / f"spot-log-{index + 1}.jsonl"
        logs.append(log)
        env, cwd = fresh_machine(workdir, storage_env)
        is_last = index == len(plan) - 1
        killed, point, events, resumed = _run_until(
            _train_cmd(spot_url, updates, every, seed, store_args, log, final_state),
            env, cwd, log, kill_at_attempted=kill_at, kill_on_save=kill_on_save, timeout_secs=timeout_secs,
            popen=popen, spot=spot,
        )
        saves = [e for e in events if e.get("event") == "saved"]
        start = Start(label, killed, point, resumed, saves)
        if killed and kill_on_save:
            step = next(e["step"] for e in reversed(events) if e.get("event") == "save_begin")
            leftovers = [info for info in spot.checkpoints() if info.step == step]
            # Proof that the kill landed mid-save: the attempt's objects are there, no manifest.
            start.killed_during_save = bool(leftovers) and leftovers[0].status == "uncommitted" and bool(leftovers[0].attempts)
            start.kill_point += f" ({leftovers[0].total_size_bytes if leftovers else 0} B of payloads written)"
        starts.append(start)
        if not killed and not is_last:
            break  # the run finished before the kill point: nothing left to resume

    problems: list[str] = []
    if not Path(final_state).exists():
        problems.append("the spot run never reached the end")
    else:
        problems += job_state_differences(torch.load(ref_state, weights_only=True), torch.load(final_state, weights_only=True))
    reference_entries = _log_entries([ref_log])
    spot_entries = _log_entries(logs)
    for update, records in sorted(spot_entries.items()):
        expected = reference_entries.get(update, [None])[0]
        for record in records:
            if record != expected:
                problems.append(f"loss log of attempted update {update} differs: {record} vs {expected}")
    missing = sorted(set(reference_entries) - set(spot_entries))
    if missing:
        problems.append(f"attempted updates never logged by the spot run: {missing}")
    if not any(s.killed_during_save for s in starts):
        problems.append("no kill landed inside a save (the save finished first); rerun the demo")
    report_lines, report_problems = _check_report(spot, starts, logs)
    problems += report_problems

    print("", file=out)
    print("| start | resumed from step | killed | saves (step: seconds, bytes) |", file=out)
    print("|---|---|---|---|", file=out)
    for start in starts:
        saves = ", ".join(f"{s['step']}: {s['seconds']:.3f} s, {s['size_bytes']} B" for s in start.saves) or "-"
        kill = start.kill_point + (", step left uncommitted" if start.killed_during_save else "")
        print(f"| {start.label} | {start.resumed_step if start.resumed_step is not None else 'fresh'} | {kill} | {saves} |", file=out)
    print("", file=out)
    print(f"updates: {updates} successful, checkpoint every {every}", file=out)
    print(f"complete checkpoints in the spot store: {[i.step for i in spot.checkpoints() if i.status == 'complete']}", file=out)
    for line in report_lines:
        print(line, file=out)
    if problems:
        print("MISMATCH:", file=out)
        for problem in problems:
            print(f"  - {problem}", file=out)
        return 1
    print("match: adapter weights, optimizer state and per-update loss log are bit-identical to the reference", file=out)
    return 0


def _check_report(spot: CheckpointStore, starts: list[Start], logs: list[Path]) -> tuple[list[str], list[str]]:
    """What ``opd-store report`` says of the spot store against where the demo killed each start:
    the step a killed start reached (its per-update log's last record), the step the next start
    resumed from, the updates redone. Returns (lines to print, problems)."""
    truth = []
    for index, start in enumerate(starts[:-1]):
        if start.killed:
            records = [r for entries in _log_entries([logs[index]]).values() for r in entries]
            reached = max((r["step"] for r in records), default=start.resumed_step or 0)
            resumed = starts[index + 1].resumed_step
            truth.append((reached, resumed, reached - (resumed or 0)))
    report = report_store(spot, use_default_prices=False)
    said = [((p.last_step or 0), p.resumed_step, p.updates_lost) for p in report.preemptions]
    lines = [f"opd-store report: {len(report.preemptions)} preemptions"
             + "".join(f"; start {p.start_index + 1} reached step {p.last_step}, the next resumed from "
                       f"{p.resumed_step}: {p.updates_lost} update{'' if p.updates_lost == 1 else 's'} redone"
                       for p in report.preemptions)
             + (f"; goodput {report.goodput:.1%}" if report.goodput is not None else "")]
    if said == truth and all(p.exact for p in report.preemptions):
        lines.append("report: matches where the demo killed the job")
        return lines, []
    return lines, [f"opd-store report says {said} (step reached, resumed from, updates redone), the demo killed at {truth}"]


__all__ = ["run_demo"]
