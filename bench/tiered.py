"""Local tier benchmark: how long a save blocks the caller with the local tier,
against a plain local save and a direct S3 save, measured side by side in one run.

    python -m bench.tiered                 # 1 GiB state, 3 rounds
    python -m bench.tiered --size-mib 64   # quicker
    python -m bench.tiered --overhead-only # only the fixed cost per save (a minute)

Each round saves the same state (``--size-mib`` MiB of float32 tensors, one ``torch_io.torch_save``
payload) three ways, in rotating order: (1) a plain ``CheckpointStore`` on local disk (fsync, the
ordinary commit), (2) a ``TieredStore`` with the local tier on the same disk and the bucket on S3
(moto in its own process over loopback): the time until ``commit()`` returns, i.e. what training
waits for; the background upload is then timed until it is durable (``flush``) before anything
else runs, (3) a plain ``CheckpointStore`` on the same S3. Target: tiered <= 1.1x plain local (the
spot-saves target in ``docs/performance.md``).

Each round starts with one untimed plain local save (the warm-up). The previous round's cleanup
frees several GiB at once (its local stores, and moto's copy of the upload); on VMs that hand free
memory back to the host (free page reporting, see ``docs/performance.md``) whichever save comes
first afterwards pays to fault that memory back in, seconds at 1 GiB. Without the warm-up that cost
lands on the first timed save of each round, plain or tiered by the rotation, and decides the
median. The report gives the per-round ratio beside the medians.

Then the fixed cost of the tier itself, which the 1 GiB rounds cannot resolve on a noisy VM:
``--overhead-saves`` saves of a 1 KiB state, alternating plain and tiered (each tiered save's upload
is flushed, untimed, before the next save), median milliseconds of each and their difference. A
tiered save runs the plain save's code plus a bucket check in a thread and queueing the upload, so
this difference is what it adds to a save of any size.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shutil
import tempfile
import time
from pathlib import Path

from opd_testkit.s3 import MotoProcess

from bench._common import machine_description, make_state, median
from opd_store import CheckpointStore
from opd_store.format import torch_save
from opd_store.tiered import TieredStore


def _save(store, step: int, state: dict) -> float:
    started = time.perf_counter()
    with store.begin(step) as txn:
        with txn.open("model.pt") as writer:
            torch_save(state, writer)
    return time.perf_counter() - started


def _fixed_overhead(root: Path, options: dict, saves: int) -> dict[str, list[float]]:
    import torch

    state = {"w": torch.arange(256, dtype=torch.float32)}  # 1 KiB
    plain = CheckpointStore(root / "overhead-plain")
    tiered = TieredStore(root / "overhead-tier", "s3://bench/overhead", storage_options=options)
    tiered.check_reachable()
    times: dict[str, list[float]] = {"plain": [], "tiered": []}
    try:
        for i in range(saves):
            for kind in (("plain", "tiered") if i % 2 == 0 else ("tiered", "plain")):
                times[kind].append(_save(plain if kind == "plain" else tiered, i + 1, state))
                if kind == "tiered":
                    tiered.flush()
        assert tiered.durable_steps()[-1] == saves
    finally:
        tiered.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three saves (default 3)")
    parser.add_argument("--tmp-dir", default=None, help="directory for the local stores (default: system temp)")
    parser.add_argument("--no-direct-s3", action="store_true",
                        help="skip the direct S3 save (the slowest part; the target compares with plain local)")
    parser.add_argument("--overhead-saves", type=int, default=20,
                        help="1 KiB saves per kind for the fixed cost per save (default 20; 0 skips)")
    parser.add_argument("--overhead-only", action="store_true", help="measure only the fixed cost per save")
    parser.add_argument("--tag", default="", help="suffix of the report's file name")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"),
                        help="where the markdown report is written (tiered-<date>-<size>mib.md)")
    args = parser.parse_args(argv)

    if args.overhead_only:
        args.rounds = 0
    state = make_state(args.size_mib) if args.rounds else {}
    moto = MotoProcess()
    moto.new_bucket("bench")
    options = moto.storage_options()
    root = Path(tempfile.mkdtemp(prefix="bench-tiered-", dir=args.tmp_dir))
    times: dict[str, list[float]] = {"plain local": [], "tiered (blocking)": [], "tiered upload (background)": [],
                                     "direct s3": []}
    # Every round: an untimed warm-up save, then the timed saves (see the module docstring).
    try:
        for round_ in range(args.rounds):
            order = ["plain", "tiered"] + ([] if args.no_direct_s3 else ["s3"])
            order = order[round_ % len(order):] + order[:round_ % len(order)]
            _save(CheckpointStore(root / f"warmup-{round_}"), 1, state)
            for kind in order:
                if kind == "plain":
                    store = CheckpointStore(root / f"plain-{round_}")
                    times["plain local"].append(_save(store, 1, state))
                elif kind == "tiered":
                    store = TieredStore(root / f"tier-{round_}", f"s3://bench/tiered-{round_}", storage_options=options)
                    store.check_reachable()  # the client is built before the clock starts, as in a job
                    times["tiered (blocking)"].append(_save(store, 1, state))
                    started = time.perf_counter()
                    store.close()
                    times["tiered upload (background)"].append(time.perf_counter() - started)
                    assert store.is_durable(1)
                else:
                    store = CheckpointStore(f"s3://bench/direct-{round_}", storage_options=options)
                    store.check_reachable()
                    times["direct s3"].append(_save(store, 1, state))
            for path in root.iterdir():
                shutil.rmtree(path)
            moto.reset()
            moto.new_bucket("bench")
        overhead = _fixed_overhead(root, options, args.overhead_saves) if args.overhead_saves else None
    finally:
        moto.stop()
        shutil.rmtree(root, ignore_errors=True)

    times = {name: values for name, values in times.items() if values}
    command = ("python -m bench.tiered " + (f"--overhead-only --overhead-saves {args.overhead_saves}" if args.overhead_only
               else f"--size-mib {args.size_mib} --rounds {args.rounds} --overhead-saves {args.overhead_saves}"
               + (" --no-direct-s3" if args.no_direct_s3 else "")))
    title = "fixed cost per save" if not args.rounds else f"{args.size_mib} MiB state, {args.rounds} rounds"
    lines = [f"# Local tier: {title} ({_dt.datetime.now(_dt.timezone.utc):%Y-%m-%dT%H:%M:%SZ})", "",
             f"Command: `{command}`", ""]
    plain = median(times["plain local"]) if times else None
    if times:
        lines += ["| save | median s | min s | x plain local | runs (s) |", "|---|---:|---:|---:|---|"]
        for name, values in times.items():
            lines.append(f"| {name} | {median(values):.3f} | {min(values):.3f} | {median(values) / plain:.2f} | "
                         + ", ".join(f"{v:.2f}" for v in values) + " |")
        tiered = median(times["tiered (blocking)"])
        direct = median(times["direct s3"]) if "direct s3" in times else None
        verdict = "PASS" if tiered / plain <= 1.10 else "MISS"
        per_round = [t / p for t, p in zip(times["tiered (blocking)"], times["plain local"])]
        lines += ["", "Per round, tiered blocking / plain local: " + ", ".join(f"{r:.2f}" for r in per_round)
                  + f" (median {median(per_round):.2f})"]
        lines += ["", f"tiered blocking / plain local = {tiered / plain:.2f} (target <= 1.10: {verdict})"
                      + (f"; tiered blocking / direct s3 = {tiered / direct:.2f}" if direct else ""), "",
                  "(the background upload row is the time from commit() returning to the step being durable)", ""]
    if overhead:
        extra_ms = 1000 * (median(overhead["tiered"]) - median(overhead["plain"]))
        lines += [f"Fixed cost per save ({args.overhead_saves} saves of a 1 KiB state each, alternating):", "",
                  "| save | median ms | min ms | max ms |", "|---|---:|---:|---:|"]
        for kind, values in overhead.items():
            lines.append(f"| {kind} | {1000 * median(values):.1f} | {1000 * min(values):.1f} | {1000 * max(values):.1f} |")
        lines += ["", f"A tiered save adds {extra_ms:.1f} ms to a save (median difference)"
                  + (f": {100 * extra_ms / 1000 / plain:.2f}% of this run's plain {args.size_mib} MiB save" if plain else "")
                  + ".", ""]
    lines += [f"- {key}: {value}" for key, value in machine_description(str(root.parent))]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = f"tiered-{_dt.date.today():%Y-%m-%d}-" + ("overhead" if args.overhead_only else f"{args.size_mib}mib")
    (out / f"{name}{'-' + args.tag if args.tag else ''}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
