"""The soak: kill the main job at chosen events, resume it on a fresh machine, compare bit for bit.

:class:`Soak` runs ``opd-store train`` once uninterrupted (the *reference*, prefix ``reference``),
then a spot run (prefix ``spot-1``): start after start on fresh machines
(:func:`~opd_store.job._machines.fresh_machine`: only the store carries state), each armed with
one kill point (:mod:`opd_store.runtime._kill_points`) that :func:`~opd_testkit.soak_phases.plan_start`
chose from the phases the start still reaches. The armed process SIGKILLs itself (one rank of a
multi-rank job: the others then fail and the job exits) exactly there. A start that ends without
reaching its kill point is a *miss*: recorded, never counted, and the next start draws again. A
start that runs to the end closes the spot run and the next one begins (``spot-2``, ...).

After every start the soak checks, against the reference:

* it resumed from the newest step complete in the store when the previous start was killed
  (fresh when there was none);
* each per-update log record it wrote equals the reference's record of that attempted update;
* every committed checkpoint in the store has every part its manifest names, with the sizes it
  records (``status`` complete), and names the reference's payloads (every rank's part); each
  one, once, is byte-identical to the reference's checkpoint of that step (``config.yaml`` aside:
  it names the store prefix);
* a start that ran to the end wrote the reference's final adapter weights, optimizer state and
  counters (``torch.equal``).

The checks of the start after a kill are that kill's resume verdict.

At the end, :meth:`Soak.check_reports` holds ``opd-store report`` of every spot run
(:mod:`opd_store.ledger`) against what the soak knows: the starts it killed, the step each reached
(its per-update log), the step the next start resumed from and the updates that start redid. A
kill on a background thread (``async_write``, ``tier_upload``) can land between the training
thread's log record of an update and the journal's progress event of it, so there the report may
be one update short; every other kill point is on the training thread and must match exactly.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from opd_store.job._machines import fresh_machine
from opd_store.runtime._kill_points import ENV_VAR

from .soak_phases import Reference, StartPlan, phase_counts, plan_start

CONFIG_YAML = "config.yaml"
BACKGROUND_PHASES = ("async_write", "tier_upload")  # kill points off the training thread


@dataclasses.dataclass
class Start:
    """One process start: what was armed, how it ended, what the checks found."""

    tag: str
    prefix: str
    plan: StartPlan | None
    flags: list[str]
    resumed: int | None = None
    expected: int | None = None
    killed: dict[str, Any] | None = None  # the kill point's record when it fired
    log: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    saved: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)
    after_kill: bool = False
    final: Path | None = None  # the final state, when it ran to the end

    @property
    def outcome(self) -> str:
        if self.killed is not None:
            return f"killed: {self.killed['phase']}"
        return "missed (redrawn), ran to the end" if self.plan is not None else "ran to the end"


def _json_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the kill
    return out


def _comparable(name: str, data: bytes) -> Any:
    """The payload as compared: its bytes, except PEFT's ``adapter_config.json``, whose
    ``target_modules`` list follows the process's string-hash order (compared as a set)."""
    if name.endswith("adapter_config.json"):
        parsed = json.loads(data)
        if isinstance(parsed.get("target_modules"), list):
            parsed["target_modules"] = sorted(parsed["target_modules"])
        return parsed
    return data


class Soak:
    """One soak run against one store (see the module docstring).

    Args:
        store_url: the store root; the reference and the spot runs get prefixes under it.
        storage_options: fsspec options for this process's checks.
        storage_env: environment a start needs (S3 credentials).
        store_args: ``opd-store train`` options that reach the store (``--s3-endpoint-url URL``).
        workdir: an existing directory for machines, logs and kill reports.
        updates / checkpoint_every / train_seed: the main job's ``--updates``, ``--checkpoint-every``
            and ``--seed``.
        world_size: the job's ``--nproc``.
        tiered: every start commits to a local tier on its machine first (``--local-tier``).
        popen: starts a process (:class:`subprocess.Popen` or a preloaded fork server's ``popen``).
        timeout_secs: a start that runs longer fails the soak.
        out: progress lines.
    """

    def __init__(self, *, store_url: str, storage_options: dict[str, Any], storage_env: dict[str, str],
                 store_args: list[str], workdir: Path, updates: int = 8, checkpoint_every: int = 2,
                 train_seed: int = 0, world_size: int = 1, tiered: bool = False,
                 popen: Callable[..., Any] = subprocess.Popen, timeout_secs: float = 600.0, out=sys.stdout) -> None:
        self.store_url = store_url.rstrip("/")
        self.storage_options = storage_options
        self.storage_env = storage_env
        self.store_args = store_args
        self.workdir = Path(workdir)
        self.updates, self.checkpoint_every, self.train_seed = updates, checkpoint_every, train_seed
        self.world_size, self.tiered = world_size, tiered
        self.popen, self.timeout_secs, self.out = popen, timeout_secs, out
        self.starts: list[Start] = []
        self.kills: list[dict[str, Any]] = []
        self.reference: Reference | None = None
        self.reference_secs = 0.0
        self._compared: set[tuple[str, int, str]] = set()  # (prefix, step, attempt id) found identical
        self._reference_payloads: dict[tuple[int, str], Any] = {}  # (step, name) -> comparable form
        self._stores: dict[str, Any] = {}  # prefix -> CheckpointStore
        self.report_problems: list[str] = []

    def store(self, prefix: str):
        """The store of ``prefix``, one per prefix (its listings are fresh on every call)."""
        from opd_store.store import CheckpointStore

        if prefix not in self._stores:
            self._stores[prefix] = CheckpointStore(f"{self.store_url}/{prefix}", storage_options=self.storage_options)
        return self._stores[prefix]

    # -- one start ------------------------------------------------------------------------------
    def _start(self, prefix: str, plan: StartPlan | None, *, reference: bool = False) -> Start:
        tag = "ref" if reference else f"{len(self.starts) + 1:03d}"
        env, cwd = fresh_machine(self.workdir, self.storage_env)
        flags = [] if plan is None else list(plan.flags)
        if not reference and self.tiered and "--local-tier" not in flags:
            flags.append("--local-tier")
        flags = [a for f in flags for a in ((f, str(cwd.parent / "tier")) if f == "--local-tier" else (f,))]
        start = Start(tag, prefix, plan, flags)
        files = {name: self.workdir / f"{tag}-{name}" for name in ("log.jsonl", "events.jsonl", "final.pt",
                                                                   "kill.jsonl", "output.txt")}
        if plan is not None:
            env[ENV_VAR] = json.dumps({**plan.kill, "report": str(files["kill.jsonl"])})
        cmd = [sys.executable, "-m", "opd_store", "train", "--store", f"{self.store_url}/{prefix}",
               "--updates", str(self.updates), "--checkpoint-every", str(self.checkpoint_every),
               "--seed", str(self.train_seed), "--log", str(files["log.jsonl"]),
               "--events", str(files["events.jsonl"]), "--final-state", str(files["final.pt"]),
               "--journal-progress-secs", "0", *self.store_args, *flags]
        if self.world_size > 1:
            cmd += ["--nproc", str(self.world_size), "--dist-timeout-secs", "60"]
        began = time.monotonic()
        with open(files["output.txt"], "wb") as output:
            process = self.popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=output,
                                 stderr=subprocess.STDOUT)
            try:
                code = process.wait(timeout=self.timeout_secs)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise RuntimeError(f"start {tag} ({prefix}) ran over {self.timeout_secs} s; output in "
                                   f"{files['output.txt']}") from None
        start.seconds = time.monotonic() - began
        reports = _json_lines(files["kill.jsonl"])
        start.killed = reports[0] if reports else None
        if start.killed is None and code != 0:
            tail = files["output.txt"].read_bytes()[-4000:].decode(errors="replace")
            raise RuntimeError(f"start {tag} ({prefix}) failed (exit {code}) without reaching a kill point:\n{tail}")
        events = _json_lines(files["events.jsonl"])
        start.resumed = next((e["step"] for e in events if e.get("event") == "resumed"), None)
        start.saved = [e["step"] for e in events if e.get("event") == "saved"]
        start.log = _json_lines(files["log.jsonl"])
        start.final = files["final.pt"] if files["final.pt"].exists() and start.killed is None else None
        return start

    # -- checks ---------------------------------------------------------------------------------
    def check_store(self, prefix: str) -> list[str]:
        """Every committed step of ``prefix``: complete, the reference's payload names, and (once
        per committed attempt) byte-identical to the reference's step."""
        assert self.reference is not None
        spot, ref = self.store(prefix), self.store("reference")
        problems = []
        for info in spot.checkpoints():
            if info.status in ("uncommitted",):
                continue
            if info.status != "complete":
                problems.append(f"step {info.step} is {info.status}: a committed checkpoint lacks a part")
                continue
            manifest = spot.manifest(info.step)
            key = (prefix, info.step, manifest.attempt_id)
            if key in self._compared:
                continue
            expected = self.reference.payloads.get(info.step)
            names = sorted(e.name for e in manifest.payloads)
            if expected is None or names != sorted(expected):
                problems.append(f"step {info.step}: payloads {names} are not the reference's")
                continue
            for name in names:
                if name == CONFIG_YAML:
                    continue
                if (info.step, name) not in self._reference_payloads:  # the reference never changes
                    self._reference_payloads[info.step, name] = _comparable(name, ref.read(info.step, name))
                spot_payload = _comparable(name, spot.read(info.step, name, manifest=manifest))
                if spot_payload != self._reference_payloads[info.step, name]:
                    problems.append(f"step {info.step}: {name} differs from the reference's")
            if not problems:
                self._compared.add(key)
        return problems

    def check_start(self, start: Start) -> list[str]:
        import torch

        from opd_store.job._compare import job_state_differences

        assert self.reference is not None
        problems = []
        if start.resumed != start.expected:
            problems.append(f"resumed from {start.resumed}, expected {start.expected}")
        for record in start.log:
            if record != self.reference.log.get(record["attempted_update"]):
                problems.append(f"attempted update {record['attempted_update']} differs from the reference's")
        problems += self.check_store(start.prefix)
        if start.killed is None:
            if start.final is None:
                problems.append("ran to the end but wrote no final state")
            else:
                problems += job_state_differences(self.reference_state, torch.load(start.final, weights_only=True))
        return problems

    def _latest(self, prefix: str) -> tuple[int | None, list[int]]:
        steps = self.store(prefix).durable_steps()
        return (steps[-1] if steps else None), steps

    # -- the run --------------------------------------------------------------------------------
    def run_reference(self) -> Reference:
        import torch

        began = time.monotonic()
        start = self._start("reference", None, reference=True)
        self.reference_secs = time.monotonic() - began
        store = self.store("reference")
        payloads = {step: {e.name: e.size_bytes for e in store.manifest(step).payloads}
                    for step in store.durable_steps()}
        self.reference = Reference({r["attempted_update"]: r for r in start.log}, payloads)
        self.reference_state = torch.load(start.final, weights_only=True)
        print(f"reference: {len(start.log)} attempted updates, checkpoints {self.reference.saves}, "
              f"{self.reference_secs:.1f} s", file=self.out, flush=True)
        return self.reference

    def run(self, n: int, seed: int) -> None:
        """Run until ``n`` kills were counted and the start after the last one was checked."""
        rng = random.Random(seed)
        if self.reference is None:
            self.run_reference()
        run_index, prefix, expected, older, after_kill = 1, "spot-1", None, False, False
        pending: dict[str, Any] | None = None
        last_rank: int | None = None
        while True:
            plan = None
            if len(self.kills) < n:
                plan = plan_start(self.reference, expected, older, phase_counts(self.kills), rng,
                                  world_size=self.world_size, last_rank=last_rank, tiered=self.tiered)
            start = self._start(prefix, plan)
            start.expected, start.after_kill = expected, after_kill
            start.problems = self.check_start(start)
            self.starts.append(start)
            if pending is not None:
                pending["resume_problems"] = start.problems
                pending = None
            print(f"start {start.tag} ({prefix}): resumed from {start.resumed}; "
                  f"{plan.where if plan else 'unarmed'}; {start.outcome}; {start.seconds:.1f} s"
                  f"{'; MISMATCH: ' + '; '.join(start.problems[:3]) if start.problems else ''}",
                  file=self.out, flush=True)
            if start.killed is not None:
                pending = {"phase": start.killed["phase"], "where": plan.where, "tag": start.tag,
                           "rank": plan.kill.get("rank"), "resume_problems": None}
                self.kills.append(pending)
                last_rank = plan.kill.get("rank")
                expected, steps = self._latest(prefix)
                older = any(s < (expected or 0) for s in steps)
                after_kill = True
                continue
            if len(self.kills) >= n:
                break
            run_index += 1  # ran to the end (nothing left, or a miss): the next spot run
            prefix, expected, older, after_kill = f"spot-{run_index}", None, False, False
        self.report_problems = self.check_reports()

    def check_reports(self) -> list[str]:
        """``opd-store report`` of each spot run against the soak's ground truth (module docstring)."""
        from opd_store.ledger import report_store

        problems = []
        for prefix in dict.fromkeys(start.prefix for start in self.starts):
            starts = [start for start in self.starts if start.prefix == prefix]
            truth = []
            for index, start in enumerate(starts[:-1]):
                if start.killed is not None:
                    reached = max((record["step"] for record in start.log), default=start.resumed or 0)
                    truth.append((start.tag, start.killed["phase"], reached, starts[index + 1].resumed))
            report = report_store(self.store(prefix), use_default_prices=False)
            # rank 0 of a job whose other rank was killed gives up: its start ends "failed"
            outcomes = ["killed" if row.outcome == "failed" and self.world_size > 1 else row.outcome
                        for row in report.starts]
            expected = ["killed" if start.killed is not None else "finished" for start in starts]
            if outcomes != expected:
                problems.append(f"{prefix}: the report's starts ended {outcomes}, the soak's {expected}")
            if len(report.preemptions) != len(truth):
                problems.append(f"{prefix}: the report counts {len(report.preemptions)} preemptions, the soak killed "
                                f"{len(truth)} starts that were resumed")
                continue
            for (tag, phase, reached, resumed), row in zip(truth, report.preemptions):
                slack = 1 if phase in BACKGROUND_PHASES else 0
                said = row.last_step or 0
                if row.resumed_step != resumed or not 0 <= reached - said <= slack or not row.exact:
                    problems.append(f"{prefix}: start {tag} ({phase}): the report says it reached step {said} and the "
                                    f"next start resumed from {row.resumed_step}; the soak: step {reached}, resumed "
                                    f"from {resumed}")
                elif row.updates_lost != said - (resumed or 0):
                    problems.append(f"{prefix}: start {tag}: {row.updates_lost} updates lost in the report, "
                                    f"{said - (resumed or 0)} by its steps")
        return problems

    @property
    def misses(self) -> int:
        return sum(1 for s in self.starts if s.plan is not None and s.killed is None)

    @property
    def start_problems(self) -> list[str]:
        """Problems of starts that did not follow a kill (a spot run's first start)."""
        return [f"start {s.tag}: {p}" for s in self.starts if not s.after_kill for p in s.problems]


__all__ = ["Soak", "Start"]
