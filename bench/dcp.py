"""Sharded save and load through opd_store's DCP layer against DCP's own fsspec writer and reader.

The same FSDP2 state (a stack of ``Linear`` layers sharded with ``fully_shard`` on a CPU mesh,
AdamW after one step: parameters, ``exp_avg`` and ``exp_avg_sq``) is saved and loaded by every rank
through:

* ``opd``: ``opd_store.dcp.save``/``load`` (:class:`~opd_store.dcp.StoreWriter`/``StoreReader``:
  parts of one attempt, CRC32C while streaming, one create-only manifest; every file a rank reads
  checked before any tensor changes);
* ``dcp``: ``dcp.save``/``dcp.load`` with ``FsspecWriter``/``FsspecReader`` (``.metadata.tmp``,
  delete, rename: a copy and a delete on S3);

on the same S3 server, alternating in one run (each repeat a new step/directory). A save's or load's
time is from a barrier before it to a barrier after it (the slowest rank). Peak RSS per rank is
each rank's ``VmHWM`` over that operation alone (reset through ``/proc/self/clear_refs``).

    python -m bench.dcp                                  # moto in its own process, 64 MiB, 2 and 4 ranks
    python -m bench.dcp --size-mib 256 --repeats 5
    python -m bench.dcp --s3-endpoint-url http://127.0.0.1:8333 --bucket bench   # any S3 server (SeaweedFS)

Ranks are forked from this process after the imports (``fork``; the machine's cores are shared by
the ranks and the S3 server). Output: a markdown table on stdout and in
``bench/results/dcp-<date>-<size>mib.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import tempfile
import time
import uuid
from pathlib import Path

from opd_testkit.s3 import MotoProcess

from bench._common import machine_description, median, proc_status_kib, reset_peak_rss
from opd_store.job._machines import process_cpu_secs

RESULTS = Path(__file__).resolve().parent / "results"


def _model(group_size: int, size_mib: int, seed: int):
    """``Linear`` layers of width 256 holding ``size_mib`` MiB of state with AdamW's two moments."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = 256
    layers = max(1, size_mib * 2**20 // (3 * 4 * (width * width + width)))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (group_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(4, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def _timed(op, moto: MotoProcess | None = None) -> dict:
    """``op()`` between two barriers: ``seconds``, this rank's ``rss`` (peak MiB during it) and
    ``cpu`` seconds, and on rank 0 the S3 ``requests`` every rank made and the server's CPU seconds
    (``server_cpu``), when the server is the bench's moto (``moto``). CPU seconds are the figure
    least moved by other load on a shared machine."""
    import torch.distributed as dist

    counted = moto if dist.get_rank() == 0 else None
    if counted is not None:
        counted.reset_requests()
    dist.barrier()
    reset_peak_rss()
    server_before = counted.cpu_secs() if counted is not None else None
    cpu_before, started = process_cpu_secs(), time.perf_counter()
    op()
    cpu = process_cpu_secs() - cpu_before
    dist.barrier()
    seconds = time.perf_counter() - started
    peak = proc_status_kib("VmHWM")
    return {"seconds": seconds, "rss": None if peak is None else peak / 1024, "cpu": cpu,
            "requests": counted.requests() if counted is not None else None,
            "server_cpu": None if counted is None else counted.cpu_secs() - server_before}


def _rank(rank: int, world_size: int, spec: dict, moto: MotoProcess | None) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from opd_store import CheckpointStore
    from opd_store.dcp import load, save

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['rendezvous']}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=1800))
    model, optimizer = _model(world_size, spec["size_mib"], seed=0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    import gc

    gc.freeze()  # the imports' objects out of the collector's way: its pauses otherwise land in either method
    options = spec["storage_options"]
    store = CheckpointStore(f"{spec['root']}/opd", storage_options=options)
    rows = []
    for repeat in range(-1, spec["repeats"]):  # repeat -1: a warm-up of both (first connections), not reported
        directory = f"{spec['root']}/dcp/run-{repeat + 1}"
        order = ("opd", "dcp") if repeat % 2 == 0 else ("dcp", "opd")
        for method in order:
            if method == "opd":
                measured = _timed(lambda: save(state, store, repeat + 2), moto)
            else:
                measured = _timed(lambda: dcp.save(state, storage_writer=FsspecWriter(directory, **options)),
                                  moto)
            rows.append({"rank": rank, "method": method, "op": "save", "repeat": repeat, **measured})
        for method in order:
            fresh_model, fresh_optimizer = _model(world_size, spec["size_mib"], seed=1)
            fresh_sd, fresh_osd = get_state_dict(fresh_model, fresh_optimizer)
            target = {"model": fresh_sd, "optim": fresh_osd}
            if method == "opd":
                measured = _timed(lambda: load(target, store, repeat + 2), moto)
            else:
                measured = _timed(lambda: dcp.load(target, storage_reader=FsspecReader(directory, **options)),
                                  moto)
            equal = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model_sd.values(), fresh_sd.values()))
            rows.append({"rank": rank, "method": method, "op": "load", "repeat": repeat, "equal": equal, **measured})
    Path(spec["out"], f"rank-{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    os._exit(0)


def run(world_size: int, size_mib: int, repeats: int, root: str, options: dict,
        moto: MotoProcess | None = None) -> list[dict]:
    """One configuration: ``world_size`` forked ranks; every rank's measurements."""
    with tempfile.TemporaryDirectory(prefix="bench-dcp-") as tmp:
        spec = {"size_mib": size_mib, "repeats": repeats, "root": root, "storage_options": options,
                "rendezvous": f"{tmp}/rendezvous", "out": tmp}
        context = multiprocessing.get_context("fork")
        # fork: ``moto`` reaches the ranks as it is (not pickled)
        ranks = [context.Process(target=_rank, args=(rank, world_size, spec, moto)) for rank in range(world_size)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        rows = []
        for rank in range(world_size):
            path = Path(tmp, f"rank-{rank}.json")
            if not path.exists():
                raise RuntimeError(f"rank {rank} of {world_size} died (exit code {ranks[rank].exitcode})")
            rows += json.loads(path.read_text())
        return rows


def summarise(world_size: int, rows: list[dict]) -> list[dict]:
    """Per operation: median seconds of each method over repeats (the slowest rank's time; the
    barriers make every rank's equal), the ratio opd/dcp, and the largest peak RSS per rank."""
    out = []
    for op in ("save", "load"):
        entry = {"world_size": world_size, "op": op}
        for method in ("opd", "dcp"):
            mine = [row for row in rows if row["op"] == op and row["method"] == method and row["repeat"] >= 0]
            per_repeat = {}
            for row in mine:
                per_repeat[row["repeat"]] = max(per_repeat.get(row["repeat"], 0.0), row["seconds"])
            entry[f"{method}_secs"] = median(list(per_repeat.values()))
            entry[f"{method}_min_secs"] = min(per_repeat.values())
            cpu = {}
            for row in mine:
                cpu[row["repeat"]] = cpu.get(row["repeat"], 0.0) + row["cpu"] + (row.get("server_cpu") or 0.0)
            entry[f"{method}_cpu"] = median(list(cpu.values()))
            entry[f"{method}_rss_mib"] = [max(r["rss"] or 0 for r in mine if r["rank"] == rank)
                                          for rank in range(world_size)]
            if op == "load":
                entry[f"{method}_equal"] = all(row["equal"] for row in mine)
            counted = [row["requests"] for row in mine if row["rank"] == 0 and row.get("requests")]
            entry[f"{method}_requests"] = counted[-1] if counted else None
        entry["ratio"] = entry["opd_secs"] / entry["dcp_secs"]
        entry["min_ratio"] = entry["opd_min_secs"] / entry["dcp_min_secs"]
        entry["cpu_ratio"] = entry["opd_cpu"] / entry["dcp_cpu"]
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64, help="total state (parameters and AdamW moments)")
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--s3-endpoint-url", default=None,
                        help="an S3 server already running (e.g. SeaweedFS: `weed mini ... -s3.port=PORT`); default: "
                        "moto in its own process")
    parser.add_argument("--bucket", default="bench-dcp", help="bucket (created when missing)")
    parser.add_argument("--no-write", action="store_true", help="print only; no file under bench/results/")
    args = parser.parse_args(argv)

    moto = None
    if args.s3_endpoint_url is None:
        moto = MotoProcess()
        endpoint = moto.endpoint_url
        server = "moto (its own process)"
    else:
        endpoint, server = args.s3_endpoint_url, f"S3 at {args.s3_endpoint_url}"
    options = {"endpoint_url": endpoint, "key": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
               "secret": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
               "client_kwargs": {"region_name": "us-east-1"},
               "config_kwargs": {"read_timeout": 1800, "connect_timeout": 60}}
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=options["key"],
                          aws_secret_access_key=options["secret"], region_name="us-east-1")
    try:
        client.create_bucket(Bucket=args.bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401

    import opd_store.dcp  # noqa: F401 - the imports, once, before the ranks are forked

    summary = []
    try:
        for world_size in [int(n) for n in args.ranks.split(",")]:
            root = f"s3://{args.bucket}/{uuid.uuid4().hex[:8]}-w{world_size}"
            summary += summarise(world_size, run(world_size, args.size_mib, args.repeats, root, options, moto))
    finally:
        if moto is not None:
            moto.stop()
    lines = [f"# DCP layer vs DCP's fsspec writer/reader: {args.size_mib} MiB FSDP2 state, {server}", ""]
    lines += [f"- {name}: {value}" for name, value in machine_description()]
    lines += ["", f"Median of {args.repeats} repeats, methods alternating; time = slowest rank (barriers); "
              "one warm-up round of both first (not reported).", "",
              "CPU s: every rank's and the S3 server's CPU seconds over the operation (median of repeats).", "",
              "| ranks | op | opd_store s | DCP fsspec s | ratio (median) | ratio (min) | opd_store CPU s | DCP CPU s | "
              "CPU ratio | opd_store peak RSS per rank (MiB) | DCP peak RSS per rank (MiB) | loaded equal |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for entry in summary:
        rss = lambda values: ", ".join(f"{v:.0f}" for v in values)  # noqa: E731
        equal = "" if entry["op"] == "save" else f"{entry['opd_equal']} / {entry['dcp_equal']}"
        lines.append(f"| {entry['world_size']} | {entry['op']} | {entry['opd_secs']:.2f} | {entry['dcp_secs']:.2f} | "
                     f"{entry['ratio']:.2f}x | {entry['min_ratio']:.2f}x | {entry['opd_cpu']:.2f} | {entry['dcp_cpu']:.2f} | "
                     f"{entry['cpu_ratio']:.2f}x | {rss(entry['opd_rss_mib'])} | {rss(entry['dcp_rss_mib'])} | {equal} |")
    lines += ["", "Target: ratio <= 1.10 for save and load (docs/performance.md).", ""]
    for entry in summary:
        for method in ("opd", "dcp"):
            counted = entry.get(f"{method}_requests")
            if counted:
                kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(counted["by_kind"].items()))
                lines.append(f"- {entry['world_size']} ranks, {entry['op']}, {method}: {counted['total']} S3 requests "
                             f"(last repeat, all ranks): {kinds}")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"dcp-{time.strftime('%Y-%m-%d', time.gmtime())}-{args.size_mib}mib.md"
        path.write_text(text)
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
