"""Multi-rank saves: the same total state saved by 1, 2 and 4 ranks, local and moto S3.

Each configuration spawns N ranks in a gloo process group on 127.0.0.1 (``torch.multiprocessing``,
spawn). A save is :func:`opd_store.pipeline.run_save_collective`, the stages
``save_opd_checkpoint`` runs with a process group: rank 0 chooses the attempt, every rank
``torch.save``-streams its shard (``SIZE/N`` MiB of float32 tensors) into its part, rank 0 commits
one manifest. The time of a save is the slowest rank's, from a barrier before it to its return;
the table prints the median over ``--repeats`` saves (each a new step) and its ratio to the
single-rank time of the same backend, measured in the same run.

    python -m bench.multirank --size-mib 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from opd_testkit.s3 import MotoProcess
from opd_testkit.stores import free_port

from bench._common import make_state, median


def _request(store, step: int, world_size: int, shard: dict):
    """The pipeline's save request of one rank's shard (and, on rank 0, a small shared payload)."""
    import torch

    from opd_store.pipeline import AfterCommit, SaveRequest

    def write(txn, shared: bool) -> None:
        with txn.open(f"shard-rank-{txn.rank:02d}.pt") as writer:
            torch.save(shard, writer)
        if shared:
            txn.write_bytes("meta.json", json.dumps({"world_size": world_size}).encode())

    return SaveRequest(AfterCommit(store, step), world_size=world_size, metadata={}, write=write)


def _rank_main(rank: int, world_size: int, port: int, url: str, options: dict, size_mib: int, repeats: int,
               out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from opd_store import CheckpointStore
    from opd_store.opd import current_group
    from opd_store.pipeline import run_save_collective, write_and_commit

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=1800))
    group = current_group()
    shard = make_state(max(1, size_mib // world_size), n_tensors=max(1, 64 // world_size), seed=rank)
    store = CheckpointStore(url, storage_options=options)
    store.check_reachable()
    times = []
    for step in range(1, repeats + 2):  # the first save warms clients and page cache; not counted
        dist.barrier()
        started = time.perf_counter()
        if group is None:
            write_and_commit(_request(store, step, 1, shard))
        else:
            run_save_collective(group, lambda: _request(store, step, world_size, shard))
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step > 1:
            times.append(float(elapsed[0]))
    if rank == 0:
        assert store.steps() == list(range(1, repeats + 2)), store.steps()
        sizes = store.manifest(repeats + 1).total_size_bytes
        Path(out).write_text(json.dumps({"times": times, "total_size_bytes": sizes}))
    dist.destroy_process_group()


def run_one(world_size: int, url: str, options: dict, size_mib: int, repeats: int, tmp: str) -> dict:
    import torch.multiprocessing as mp

    out = os.path.join(tmp, f"result-{world_size}.json")
    mp.start_processes(_rank_main, args=(world_size, free_port(), url, options, size_mib, repeats, out),
                       nprocs=world_size, start_method="spawn", join=True)
    return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="total state size over all ranks (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed saves per configuration (default 3)")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--backends", default="local,s3")
    parser.add_argument("--tmp-dir", default=tempfile.gettempdir())
    args = parser.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    rows = []
    moto = MotoProcess() if "s3" in args.backends.split(",") else None
    try:
        for backend in args.backends.split(","):
            base = None
            for world_size in ranks:
                tmp = tempfile.mkdtemp(prefix="opd-multirank-", dir=args.tmp_dir)
                try:
                    if backend == "local":
                        url, options = os.path.join(tmp, "store"), {}
                    else:
                        moto.reset()
                        bucket = f"bench-{world_size}"
                        moto.new_bucket(bucket)
                        url, options = f"s3://{bucket}/run", moto.storage_options()
                    result = run_one(world_size, url, options, args.size_mib, args.repeats, tmp)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                secs = median(result["times"])
                base = secs if world_size == 1 or base is None else base
                rows.append((backend, world_size, result["total_size_bytes"] / 2**20, secs, secs / base))
    finally:
        if moto is not None:
            moto.stop()
    print(f"multi-rank save: {args.size_mib} MiB total, median of {args.repeats} saves, "
          f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    print("| backend | ranks | checkpoint MiB | secs per save | vs 1 rank |")
    print("|---|---|---|---|---|")
    for backend, world_size, mib, secs, ratio in rows:
        print(f"| {backend} | {world_size} | {mib:.1f} | {secs:.3f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
