"""Local tier benchmark (issue 8, item 3): how long a save blocks the caller with the local tier,
against a plain local save and a direct S3 save, measured side by side in one run.

    python -m bench.tiered                 # 1 GiB state, 3 rounds
    python -m bench.tiered --size-mib 64   # quicker

Each round saves the same state (``--size-mib`` MiB of float32 tensors, one ``torch_io.torch_save``
payload) three ways, in rotating order: (1) a plain ``CheckpointStore`` on local disk (fsync, the
ordinary commit), (2) a ``TieredStore`` with the local tier on the same disk and the bucket on S3
(moto in its own process over loopback): the time until ``commit()`` returns, i.e. what training
waits for; the background upload is then timed until it is durable (``flush``) before anything
else runs, (3) a plain ``CheckpointStore`` on the same S3. Target: tiered <= 1.1x plain local.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shutil
import tempfile
import time
from pathlib import Path

from bench._common import MotoProcess, machine_description, make_state, median, state_nbytes

from opd_store import CheckpointStore
from opd_store.tiered import TieredStore
from opd_store.torch_io import torch_save


def _save(store, step: int, state: dict) -> float:
    started = time.perf_counter()
    with store.begin(step) as txn:
        with txn.open("model.pt") as writer:
            torch_save(state, writer)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three saves (default 3)")
    parser.add_argument("--tmp-dir", default=None, help="directory for the local stores (default: system temp)")
    parser.add_argument("--no-direct-s3", action="store_true",
                        help="skip the direct S3 save (the slowest part; the target compares with plain local)")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"),
                        help="where the markdown report is written (tiered-<date>-<size>mib.md)")
    args = parser.parse_args(argv)

    state = make_state(args.size_mib)
    moto = MotoProcess()
    moto.new_bucket("bench")
    options = moto.storage_options()
    root = Path(tempfile.mkdtemp(prefix="bench-tiered-", dir=args.tmp_dir))
    times: dict[str, list[float]] = {"plain local": [], "tiered (blocking)": [], "tiered upload (background)": [],
                                     "direct s3": []}
    try:
        for round_ in range(args.rounds):
            order = ["plain", "tiered"] + ([] if args.no_direct_s3 else ["s3"])
            order = order[round_ % len(order):] + order[:round_ % len(order)]
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
    finally:
        moto.stop()
        shutil.rmtree(root, ignore_errors=True)

    times = {name: values for name, values in times.items() if values}
    plain = median(times["plain local"])
    lines = [f"# Local tier: {state_nbytes(state) / 2**20:.0f} MiB state, {args.rounds} rounds "
             f"({_dt.datetime.now(_dt.timezone.utc):%Y-%m-%dT%H:%M:%SZ})", "",
             f"Command: `python -m bench.tiered --size-mib {args.size_mib} --rounds {args.rounds}"
             + (" --no-direct-s3" if args.no_direct_s3 else "") + "`", "",
             "| save | median s | min s | x plain local | runs (s) |", "|---|---:|---:|---:|---|"]
    for name, values in times.items():
        lines.append(f"| {name} | {median(values):.3f} | {min(values):.3f} | {median(values) / plain:.2f} | "
                     + ", ".join(f"{v:.2f}" for v in values) + " |")
    tiered = median(times["tiered (blocking)"])
    direct = median(times["direct s3"]) if "direct s3" in times else None
    verdict = "PASS" if tiered / plain <= 1.10 else "MISS"
    lines += ["", f"tiered blocking / plain local = {tiered / plain:.2f} (target <= 1.10: {verdict})"
                  + (f"; tiered blocking / direct s3 = {tiered / direct:.2f}" if direct else ""), "",
              "(the background upload row is the time from commit() returning to the step being durable)", ""]
    lines += [f"- {key}: {value}" for key, value in machine_description(str(root.parent))]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tiered-{_dt.date.today():%Y-%m-%d}-{args.size_mib}mib.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
