"""Soak: SIGKILL the main job at N random moments, resume each time on a fresh machine, compare.

    python -m bench.soak                     # N=50 kills, local store under bench/results/tmp/
    python -m bench.soak --n 5 --seed 1      # quicker
    python -m bench.soak --s3-emulator       # the store on moto's S3 server (its own process)
    python -m bench.soak --store s3://bucket/prefix --storage-option ...   # any store

What it does (issue 5, "Soak"):

1. An uninterrupted reference run of ``opd-store train`` into ``<store>/reference``, timed.
2. The spot run into ``<store>/spot-1``: every start is a new process whose working directory,
   ``HOME`` and ``TMPDIR`` are new and empty, so only the store carries state. Each start is
   SIGKILLed at a moment drawn uniformly from [0, the reference's training time] after its first
   event (``resumed``, or its first ``update``; the interpreter start before it is the same for
   every start), so kills land in updates, between them and while a save streams its payloads,
   until N kills happened. A start that finishes before its kill
   moment ends the spot run; the next start begins a new one (``spot-2``, ...).
3. Every resume (a start after a kill) is checked bit for bit:

   * it resumed from the step that was the store's latest complete checkpoint after the kill
     (or started fresh when there was none);
   * every per-update log record it wrote (loss, learning rate, verdicts; full float precision)
     equals the reference's record of the same attempted update;
   * every checkpoint it committed holds payloads byte-identical to the reference's checkpoint
     of the same step (``config.yaml`` aside: it names the store prefix; PEFT's
     ``adapter_config.json`` lists ``target_modules`` in hash order, compared as a set);
   * when it ran to the end, its final adapter weights, optimizer state and counters equal the
     reference's (``torch.equal``).

The report (markdown: a table of starts and "resumes bit-exact: X of N") is printed and written to
``bench/results/soak-<date>[-s3].md``. Exit status 0 only when every resume was bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from opd_store.testing.machines import fresh_machine
from opd_store.testing.s3 import MotoProcess

from ._common import REPO_ROOT, machine_description, now_stamp

CONFIG_YAML = "config.yaml"


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the kill
    return out


class Soak:
    def __init__(self, args: argparse.Namespace, store_url: str, store_args: list[str], storage_env: dict[str, str],
                 storage_options: dict[str, Any], workdir: Path) -> None:
        self.args = args
        self.store_url = store_url.rstrip("/")
        self.store_args = store_args
        self.storage_env = storage_env
        self.storage_options = storage_options
        self.workdir = workdir
        self.rng = random.Random(args.seed)
        self.count = 0

    def store(self, name: str):
        from opd_store import CheckpointStore

        return CheckpointStore(f"{self.store_url}/{name}", storage_options=self.storage_options)

    def _cmd(self, prefix: str, log: Path, final: Path) -> list[str]:
        return [sys.executable, "-m", "opd_store", "train", "--store", f"{self.store_url}/{prefix}",
                "--updates", str(self.args.updates), "--checkpoint-every", str(self.args.checkpoint_every),
                "--seed", str(self.args.train_seed), "--log", str(log), "--events", "/dev/stdout",
                "--final-state", str(final), *self.store_args]

    def start(self, prefix: str, kill_after_secs: float | None) -> dict[str, Any]:
        """One start on a fresh machine; SIGKILL it ``kill_after_secs`` after it is ready.

        "Ready" is the job's first event (``resumed`` after loading a checkpoint, or its first
        ``update``): interpreter start-up takes most of a start's time on a small machine, and a
        kill there tests nothing a kill at the first update does not.
        """
        self.count += 1
        tag = f"{self.count:03d}"
        log, final = self.workdir / f"{tag}-log.jsonl", self.workdir / f"{tag}-final.pt"
        env, cwd = fresh_machine(self.workdir, self.storage_env, pythonpath=[str(REPO_ROOT)])
        spawned = time.monotonic()
        process = subprocess.Popen(self._cmd(prefix, log, final), env=env, cwd=cwd,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        evs: list[dict[str, Any]] = []
        ready = threading.Event()
        stderr_chunks: list[str] = []

        def read_events() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(event, dict) and "event" in event:
                    evs.append(event)
                    ready.set()

        readers = [threading.Thread(target=read_events, daemon=True),
                   threading.Thread(target=lambda: stderr_chunks.append(process.stderr.read()), daemon=True)]
        for reader in readers:
            reader.start()
        while not ready.wait(timeout=0.5) and process.poll() is None:
            pass  # waiting for the job's first event (or its exit)
        ready_at = time.monotonic()
        killed = False
        try:
            process.wait(timeout=kill_after_secs)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
            killed = True
        ended = time.monotonic()
        for reader in readers:
            reader.join(timeout=30)
        stderr = "".join(stderr_chunks)
        if not killed and process.returncode != 0:
            raise RuntimeError(f"start {tag} failed (exit {process.returncode}):\n{stderr[-4000:]}")
        begun = [e["step"] for e in evs if e.get("event") == "save_begin"]
        saved = [e["step"] for e in evs if e.get("event") == "saved"]
        resumed = next((e["step"] for e in evs if e.get("event") == "resumed"), None)
        if not killed:
            phase = "ran to the end"
        elif begun and (not saved or begun[-1] != saved[-1]):
            phase = f"during the save of step {begun[-1]}"
        elif saved and saved[-1] >= self.args.updates:
            phase = "after its last save (writing the final state or exiting)"
        elif any(e.get("event") == "update" for e in evs):
            phase = "between updates"
        else:
            phase = "after resuming, before an update"
        return {"tag": tag, "prefix": prefix, "killed": killed, "kill_after_secs": kill_after_secs,
                "seconds": ended - spawned, "ready_secs": ready_at - spawned, "train_secs": ended - ready_at,
                "phase": phase, "resumed": resumed, "saved": saved, "log": _records(log),
                "final": final if final.exists() else None}

    def latest(self, prefix: str) -> int | None:
        from opd_store.errors import CheckpointNotFoundError

        try:
            return self.store(prefix).latest_step()
        except CheckpointNotFoundError:
            return None


def _comparable(name: str, data: bytes) -> bytes | Any:
    """The payload as compared: its bytes, except PEFT's ``adapter_config.json``.

    PEFT keeps ``target_modules`` as a Python ``set`` and writes it in the set's iteration order,
    which follows the process's string-hash seed (``PYTHONHASHSEED``): two processes write
    ``["q_proj", "v_proj"]`` and ``["v_proj", "q_proj"]`` for the same adapter. That list is
    compared as a set; every other byte of every payload is compared as is.
    """
    if name.endswith("adapter_config.json"):
        parsed = json.loads(data)
        if isinstance(parsed.get("target_modules"), list):
            parsed["target_modules"] = sorted(parsed["target_modules"])
        return parsed
    return data


def _checkpoint_problems(spot, reference, step: int) -> list[str]:
    names = sorted(n for n in spot.names(step) if n != CONFIG_YAML)
    ref_names = sorted(n for n in reference.names(step) if n != CONFIG_YAML)
    if names != ref_names:
        return [f"step {step}: payload names differ from the reference's"]
    return [f"step {step}: {name} differs from the reference's" for name in names
            if _comparable(name, spot.read(step, name)) != _comparable(name, reference.read(step, name))]


def run(args: argparse.Namespace, store_url: str, store_args: list[str], storage_env: dict[str, str],
        storage_options: dict[str, Any], workdir: Path, out=sys.stdout) -> int:
    import torch

    from opd_store.job.demo import _compare_states

    soak = Soak(args, store_url, store_args, storage_env, storage_options, workdir)
    reference = soak.start("reference", None)
    ref_secs = reference["train_secs"]
    ref_log = {r["attempted_update"]: r for r in reference["log"]}
    ref_state = torch.load(reference["final"], weights_only=True)
    ref_store = soak.store("reference")
    print(f"reference run: {args.updates} updates, {len(ref_log)} attempted, {reference['ready_secs']:.1f} s "
          f"to its first update, then {ref_secs:.1f} s "
          f"(saves: {reference['saved']})", file=out, flush=True)

    rows: list[dict[str, Any]] = []
    kills = resumes = exact = 0
    run_index, prefix = 1, "spot-1"
    expected: int | None = None  # the step the next start must resume from
    after_kill = False
    while True:
        kill_at = soak.rng.uniform(0.0, ref_secs) if kills < args.n else None
        result = soak.start(prefix, kill_at)
        problems: list[str] = []
        if result["resumed"] != expected:
            problems.append(f"resumed from {result['resumed']}, expected {expected}")
        for record in result["log"]:
            if record != ref_log.get(record["attempted_update"]):
                problems.append(f"attempted update {record['attempted_update']} differs from the reference")
        spot_store = soak.store(prefix)
        for step in result["saved"]:
            problems += _checkpoint_problems(spot_store, ref_store, step)
        if not result["killed"]:
            if result["final"] is None:
                problems.append("no final state written")
            else:
                problems += _compare_states(ref_state, torch.load(result["final"], weights_only=True))
        result["problems"] = problems
        result["is_resume"] = after_kill
        if after_kill:
            resumes += 1
            exact += not problems
        rows.append(result)
        print(f"start {result['tag']} ({prefix}): resumed from {result['resumed']}, "
              f"{'killed ' + result['phase'] + f' at {kill_at:.1f} s' if result['killed'] else 'ran to the end'}, "
              f"{len(result['log'])} updates logged, saves {result['saved']}"
              f"{'' if not problems else ' MISMATCH: ' + '; '.join(problems[:3])}", file=out, flush=True)
        if result["killed"]:
            kills += 1
            after_kill = True
            expected = soak.latest(prefix)
            continue
        if kills >= args.n:
            break
        run_index += 1  # the spot run finished before its kill moment: start another one
        prefix, expected, after_kill = f"spot-{run_index}", None, False

    lines = [
        f"# Soak: SIGKILL at {args.n} random moments, resume on a fresh machine ({now_stamp()})",
        "",
        f"`python -m bench.soak {' '.join(sys.argv[1:])}`",
        "",
        f"- store: `{store_url}`",
        f"- main job: `opd-store train --updates {args.updates} --checkpoint-every {args.checkpoint_every} "
        f"--seed {args.train_seed}`; reference run: {reference['ready_secs']:.1f} s to its first update "
        f"(interpreter start, models), then {ref_secs:.1f} s for {len(ref_log)} attempted updates and its saves",
        f"- kill moments: uniform in [0, {ref_secs:.1f} s] after each start's first event (its `resumed` or "
        f"first `update`), seed {args.seed}",
        f"- spot runs: {run_index}; starts: {len(rows)}; kills: {kills}",
        "",
        f"**resumes bit-exact: {exact} of {resumes}**",
        "",
        "| start | spot run | resumed from | kill at (s) | killed | updates logged | saves committed | bit-exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        verdict = ("yes" if not row["problems"] else "NO: " + "; ".join(row["problems"][:3])) if row["is_resume"] else "(first start)"
        lines.append(
            f"| {row['tag']} | {row['prefix']} | {row['resumed'] if row['resumed'] is not None else 'fresh'} | "
            f"{row['kill_after_secs']:.1f} | {row['phase']} | {len(row['log'])} | {row['saved'] or '-'} | {verdict} |"
            if row["kill_after_secs"] is not None else
            f"| {row['tag']} | {row['prefix']} | {row['resumed'] if row['resumed'] is not None else 'fresh'} | - | "
            f"{row['phase']} | {len(row['log'])} | {row['saved'] or '-'} | {verdict} |"
        )
    phases: dict[str, int] = {}
    for row in rows:
        if row["killed"]:
            key = "during a save" if row["phase"].startswith("during the save") else row["phase"]
            phases[key] = phases.get(key, 0) + 1
    lines += ["", "Kills by phase: " + ", ".join(f"{k}: {v}" for k, v in sorted(phases.items())), "", "## Machine", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in machine_description()]
    text = "\n".join(lines) + "\n"
    print("\n" + text, file=out)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"soak-{time.strftime('%Y-%m-%d', time.gmtime())}{'-s3' if args.s3_emulator else ''}.md"
    path.write_text(text, encoding="utf-8")
    print(f"written to {path}", file=out)
    return 0 if exact == resumes == args.n else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="number of SIGKILLs (default 50)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the kill moments (default: random)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--store", default=None, help="store URL (default: a new local directory under bench/results/tmp/)")
    where.add_argument("--s3-emulator", action="store_true", help="use moto's S3 server in its own process")
    parser.add_argument("--storage-option", action="append", default=[], help="KEY=VALUE fsspec option (repeatable)")
    parser.add_argument("--updates", type=int, default=8, help="successful updates of the main job (default 8)")
    parser.add_argument("--checkpoint-every", type=int, default=2, help="save every K successful updates (default 2)")
    parser.add_argument("--train-seed", type=int, default=0, help="the main job's --seed (default 0)")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be >= 1")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)

    from opd_store.cli.common import parse_storage_options

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    workdir = REPO_ROOT / "bench" / "results" / "tmp" / f"soak-{stamp}"
    workdir.mkdir(parents=True, exist_ok=True)
    store_args = [a for pair in args.storage_option for a in ("--storage-option", pair)]
    options = parse_storage_options(args.storage_option, None)
    storage_env: dict[str, str] = {}
    moto = None
    try:
        if args.s3_emulator:
            moto = MotoProcess(key_buffer_bytes=None)
            moto.new_bucket("opd-soak")
            storage_env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
            os.environ.update(storage_env)
            store_url = f"s3://opd-soak/{stamp}"
            options = {"endpoint_url": moto.endpoint_url}
            store_args = ["--s3-endpoint-url", moto.endpoint_url]
        else:
            store_url = args.store or str(workdir / "store")
        print(f"store: {store_url}\nwork directory: {workdir}\nkill seed: {args.seed}", flush=True)
        return run(args, store_url, store_args, storage_env, options, workdir)
    finally:
        if moto is not None:
            moto.stop()


if __name__ == "__main__":
    sys.exit(main())
