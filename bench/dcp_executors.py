"""The training loop's slowdown while a DCP save streams: DCP's thread executor against its process executor.

    python -m bench.dcp_executors                          # 256 MiB to a local store, 3 rounds
    python -m bench.dcp_executors --size-mib 512 --rounds 5 --store /mnt/nvme/bench-store

One process, a one-rank gloo group (DCP's process executor needs a process group). A training
loop (a small MLP, forward, backward and SGD step on one CPU thread: Python work and kernels, as a
real loop's host side) runs continuously; ``opd_store.dcp.async_save`` of a state of ``--size-mib``
MiB (64 float32 tensors) is started with ``AsyncCheckpointerType.THREAD`` and with ``PROCESS``,
alternating, each round once per executor, and the loop keeps stepping until the commit. Reported
per executor, medians over the rounds: the call's blocked time (staging), the time to the commit,
the loop's median step time while the save streams over its median step time with no save (the
slowdown), and the steps done during the save. A warm-up save of each executor is not counted (the
process executor's first save starts its background process: ``spawn`` and imports).

The thread executor writes in this process: its Python work (pickling, ``torch.save``, the payload
writer) takes the GIL from the loop. The process executor writes from DCP's background process;
the loop shares only CPU cores and memory bandwidth with it. Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def _loop(steps_until, *, seed: int = 0) -> list[float]:
    """Run training steps until ``steps_until()`` is true; the duration of each step (seconds)."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(32, 256)
    durations = []
    while not steps_until():
        started = time.perf_counter()
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        durations.append(time.perf_counter() - started)
    return durations


def _state(size_mib: int) -> dict:
    import torch

    count = 64
    elements = size_mib * (1 << 20) // 4 // count
    return {f"layer{i}.weight": torch.full((elements,), float(i)) for i in range(count)}


def _one_save(state: dict, store, step: int, kind) -> dict:
    """One async save with the loop running until it commits."""
    from opd_store.dcp import async_save

    started = time.perf_counter()
    pending = async_save(state, store, step, async_checkpointer_type=kind)
    blocked = time.perf_counter() - started
    durations = _loop(pending.committed.done)
    pending.result()
    return {"blocked_secs": blocked, "commit_secs": time.perf_counter() - started,
            "median_step_secs": statistics.median(durations) if durations else float("nan"),
            "steps": len(durations)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dcp_executors", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store", help="store URL (default: a new local directory)")
    parser.add_argument("--baseline-secs", type=float, default=3.0, help="loop alone, before each round")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from opd_store import CheckpointStore

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    work = Path(tempfile.mkdtemp(prefix="dcp-executors-"))
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=0, world_size=1)
    store = CheckpointStore(args.store or work / "store")
    state = _state(args.size_mib)
    kinds = (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS)
    step = max(store.steps(), default=0)
    for kind in kinds:  # warm-up: the process executor starts its background process here
        step += 1
        _one_save(state, store, step, kind)
    rows: dict[str, list[dict]] = {kind.value: [] for kind in kinds}
    for round_index in range(args.rounds):
        order = kinds if round_index % 2 == 0 else tuple(reversed(kinds))
        for kind in order:
            deadline = time.perf_counter() + args.baseline_secs
            baseline = statistics.median(_loop(lambda: time.perf_counter() > deadline))
            step += 1
            row = _one_save(state, store, step, kind)
            row["slowdown"] = row["median_step_secs"] / baseline
            row["baseline_step_secs"] = baseline
            rows[kind.value].append(row)
    dist.destroy_process_group()

    print(f"# DCP async_save executors: {args.size_mib} MiB to {store.url}, {args.rounds} rounds, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}")
    print("\n| executor | blocked (s) | to commit (s) | loop step alone (ms) | loop step during save (ms) | "
          "slowdown | steps during save |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    medians = {}
    for kind, measured in rows.items():
        med = {key: statistics.median(row[key] for row in measured) for key in measured[0]}
        medians[kind] = med
        print(f"| {kind} | {med['blocked_secs']:.2f} | {med['commit_secs']:.2f} | {med['baseline_step_secs'] * 1e3:.2f} | "
              f"{med['median_step_secs'] * 1e3:.2f} | {med['slowdown']:.2f}x | {med['steps']:.0f} |")
    ratio = medians["thread"]["slowdown"] / medians["process"]["slowdown"]
    per_round = ", ".join(f"{t['slowdown'] / p['slowdown']:.2f}" for t, p in zip(rows["thread"], rows["process"]))
    print(f"\nloop slowdown, thread executor over process executor: {ratio:.2f}x (per round: {per_round})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
