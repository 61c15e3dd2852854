"""Hundreds of ranks against S3's request-rate limits, simulated on one machine.

    python -m bench.simulation --bookkeeping            # N = 8, 64, 256, 512; 4 scenarios each
    python -m bench.simulation --ranks 8,64 --scenarios spread
    python -m bench.simulation --bookkeeping-only       # requests per save at 10, 100, 1,000 kept steps

Each save is a simulated one (:mod:`opd_testkit.simulation`): ``N`` virtual ranks, each a thread with
a store of its own, in ``--processes`` spawned processes, through opd_store's own multi-rank write
path (``run_save_collective``: rank parts, then rank 0's commit), against moto in its own process
(``S3_UPLOAD_PART_MIN_SIZE`` lowered to the scaled part) behind the request-rate proxy in a process of
its own (:class:`opd_testkit.rate_limit.RateLimitProxyProcess`). A rank writes ``--parts-per-rank``
parts of ``--part-kib`` KiB: the requests of a real rank writing that many 16 MiB parts. Scenarios:

* ``free``: spread layout, no limit: what this machine serves (its request capacity);
* ``one-prefix``: the step layout (every object under ``step-NNNNNN/``: one partition, as a new
  prefix on S3), ``--prefix-writes`` writes per second per partition;
* ``one-prefix-unpaced``: the same, every rank's pacer counting throttled answers but never
  slowing down (the client's retries and the part writer's, without the adaptive limit and rate:
  what the save sends without opd_store's pacing);
* ``spread``: the spread layout over ``--prefixes`` partitioned prefixes, the same rate each.

Per save: the requests (admitted and refused at the proxy, by operation), the time to commit (rank
0, from the start signal to its commit), the throttled answers and retries of every rank's pacer,
the manifest's size and the time to create it (parse and a create-only write of the same bytes), and
the time of ``latest_step()`` and ``verify()`` on a fresh store. Then the model of
docs/performance.md ("Past one machine") fitted on the ``free`` runs, checked against every measured
point, and the largest state that commits within 30 s and 120 s. Output: a Markdown report on
stdout and in ``bench/results/simulation-<date>.md``, every save as a JSON line in
``simulation-<date>-runs.jsonl``.

``--bookkeeping``: a save of 8 payloads with ``keep_last=3, keep_every=10`` after 10, 100 and 1,000
kept steps (written straight into moto with boto3), its requests beyond its payloads counted at the
store's client, for the first save of a store instance and the next ones.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime as _dt
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from opd_testkit.rate_limit import RateLimitProxyProcess, RateLimits
from opd_testkit.s3 import MotoProcess
from opd_testkit.simulation import SimSpec, moto_min_part_env, simulate
from opd_testkit.stores import aio_session

from bench._common import REPO_ROOT, log, machine_description

SCENARIOS = ("free", "one-prefix", "spread")
ALL_SCENARIOS = (*SCENARIOS, "one-prefix-unpaced")
REAL_PART_MIB = 16
BUDGETS_SECS = (30.0, 120.0)
AWS_PREFIX_WRITES = 3500.0


# -- one save ---------------------------------------------------------------------------------------


def _limits(scenario: str, args, bucket: str, root: str) -> RateLimits:
    if scenario == "free":
        return RateLimits(prefix_writes_per_sec=None, prefix_reads_per_sec=None)
    partitions = tuple(f"{bucket}/{root}/.spread/{i:02x}/" for i in range(args.prefixes))
    return RateLimits(prefix_writes_per_sec=args.prefix_writes, prefix_reads_per_sec=args.prefix_reads,
                      bucket_writes_per_sec=args.bucket_writes, partitions=partitions, burst_secs=args.burst_secs)


def _measure_reads(store, step: int) -> dict[str, float]:
    """latest_step and verify on a fresh store, and the manifest's size and create time."""
    started = time.perf_counter()
    latest = store.latest_step()
    latest_secs = time.perf_counter() - started
    assert latest == step, (latest, step)
    started = time.perf_counter()
    report = store.verify(step)
    verify_secs = time.perf_counter() - started
    assert report.ok, report
    data = store.storage.read_bytes(f"step-{step:06d}/manifest.json")
    from opd_store.format import parse_manifest

    started = time.perf_counter()
    parse_manifest(data, url="bench")
    store.storage.create_exclusive(f"bench-scratch/{step}/manifest.json", data)
    create_secs = time.perf_counter() - started
    store.storage.delete(f"bench-scratch/{step}/manifest.json")
    return {"latest_step_secs": latest_secs, "verify_secs": verify_secs, "manifest_bytes": len(data),
            "manifest_create_secs": create_secs}


def run_save(args, moto: MotoProcess, proxy: RateLimitProxyProcess, ranks: int, scenario: str,
             step: int, parts: int) -> dict[str, Any]:
    bucket, root = "sim", f"n{ranks}-{scenario}-p{parts}"
    proxy.set_limits(_limits(scenario, args, bucket, root))
    proxy.reset()
    spec = SimSpec(world_size=ranks, step=step, state_bytes=parts * args.part_kib * 1024,
                   part_size_bytes=args.part_kib * 1024, parts_in_flight=args.parts_in_flight,
                   key_layout="step" if scenario.startswith("one-prefix") else "spread", key_prefixes=args.prefixes,
                   processes=1 if ranks <= 16 else args.processes, pacing=not scenario.endswith("-unpaced"))
    options = dict(moto.storage_options(), endpoint_url=proxy.endpoint_url)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    result = simulate(spec, f"s3://{bucket}/{root}", options)
    wall = time.perf_counter() - started
    stats = proxy.stats()
    row: dict[str, Any] = {
        "ranks": ranks, "scenario": scenario, "parts_per_rank": parts, "part_kib": args.part_kib,
        "commit_secs": result.commit_secs, "setup_secs": result.setup_secs, "wall_secs": wall,
        "errors": len(result.errors), "first_error": next(iter(result.errors.values()), None),
        "requests": stats["requests"], "throttled": stats["throttled"], "writes": stats["writes"],
        "throttled_writes": stats["throttled_writes"], "by_op": stats["by_op"],
        "throttled_by_op": stats["throttled_by_op"], "partitions_used": len([p for p in stats["by_partition"] if p]),
        "busiest_partition_writes": max(stats["by_partition"].values(), default=0),
        "throttled_answers": result.total("throttled_answers"), "retries": result.total("retries"),
        "throttled_secs_max": max(o.throttled_secs for o in result.ranks),
        "load_1min_before": load, "limits": dataclasses.asdict(_limits(scenario, args, bucket, root)) | {
            "partitions": len(_limits(scenario, args, bucket, root).partitions)},
    }
    row["admitted_writes"] = row["writes"] - row["throttled_writes"]
    if not result.errors:
        from opd_store import CheckpointStore

        proxy.set_limits(_limits("free", args, bucket, root))
        row.update(_measure_reads(CheckpointStore(f"s3://{bucket}/{root}", storage_options=dict(
            options, session=aio_session())), step))
    return row


# -- the model --------------------------------------------------------------------------------------


def fit(rows: list[dict]) -> dict[str, float]:
    """The model's machine constants from the ``free`` saves: ``t0`` (fixed seconds) and
    ``capacity`` (admitted writes per second), a least-squares line of commit time against writes."""
    free = [r for r in rows if r["scenario"] == "free" and not r["errors"]]
    if len(free) < 2:
        return {"t0": 0.0, "capacity": float("inf")}
    xs, ys = [r["admitted_writes"] for r in free], [r["commit_secs"] for r in free]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return {"t0": max(0.0, mean_y - slope * mean_x), "capacity": 1.0 / slope if slope > 0 else float("inf")}


def writes_per_save(ranks: int, parts: int) -> int:
    """Writes of a save: per rank one upload created, ``parts`` parts, one completion (a rank's
    one-part state is one PutObject instead), and rank 0's shared file and manifest."""
    per_rank = 1 if parts <= 1 else parts + 2
    return ranks * per_rank + 2


def write_rate(scenario: str, args, constants: dict[str, float], *, prefix_writes: float | None = None) -> float:
    """Admitted writes per second a save gets: the machine's capacity, capped by the partitions it
    writes to (``one-prefix``: 1, ``spread``: ``--prefixes``) times the per-prefix rate, and by the
    bucket's rate."""
    prefix = args.prefix_writes if prefix_writes is None else prefix_writes
    rates = [constants["capacity"]]
    if scenario != "free":
        rates.append(prefix * (1 if scenario.startswith("one-prefix") else args.prefixes))
        if args.bucket_writes:
            rates.append(args.bucket_writes)
    return min(rates)


def predict(row: dict, args, constants: dict[str, float]) -> float:
    return constants["t0"] + writes_per_save(row["ranks"], row["parts_per_rank"]) / write_rate(
        row["scenario"], args, constants)


def largest_parts(ranks: int, budget_secs: float, rate: float, t0: float) -> int:
    """The most parts per rank whose writes fit ``budget_secs`` at ``rate`` writes per second."""
    room = (budget_secs - t0) * rate - 2
    return max(0, math.floor(room / ranks) - 2) if room > 0 else 0


# -- bookkeeping ------------------------------------------------------------------------------------


def bookkeeping(moto: MotoProcess) -> list[dict]:
    """Requests of a save beyond its payloads after 10, 100 and 1,000 kept steps."""
    from opd_store import CheckpointStore
    from opd_store.format import Manifest, PayloadEntry, Writer, crc32c_hex
    from opd_store.pipeline import AfterCommit
    from opd_store.retention import RetentionPolicy

    policy = RetentionPolicy(keep_last=3, keep_every=10)
    client = moto.boto3_client(max_pool_connections=16)
    pool = concurrent.futures.ThreadPoolExecutor(16)
    rows = []
    for kept in (10, 100, 1000):
        bucket = f"kept-{kept}"
        moto.create_bucket(bucket)
        items = []
        for step in range(10, 10 * kept + 1, 10):
            aid, data = f"attempt-20260101T000000Z-{step:012x}", f"step {step}".encode()
            manifest = Manifest(step=step, attempt_id=aid, writer=Writer(host="bench", pid=1),
                                created_at=_dt.datetime(2026, 1, 1, tzinfo=_dt.timezone.utc),
                                payloads=(PayloadEntry(name="s.bin", path=f"{aid}/s.bin", size_bytes=len(data),
                                                       crc32c=crc32c_hex(data)),))
            items += [(f"run/step-{step:06d}/{aid}/s.bin", data), (f"run/step-{step:06d}/manifest.json",
                                                                     manifest.to_json_bytes())]
        list(pool.map(lambda item: client.put_object(Bucket=bucket, Key=item[0], Body=item[1]), items))
        store = CheckpointStore(f"s3://{bucket}/run", storage_options=dict(moto.storage_options(),
                                                                         session=aio_session()))
        store.storage.fs.connect()
        sent: list[tuple[str, str]] = []
        store.storage.fs.s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(
            (request.method, request.url)))
        per_save = []
        for k in range(1, 6):
            sent.clear()
            step = 10 * kept + k
            started = time.perf_counter()
            with store.begin(step) as txn:
                for index in range(8):
                    txn.write_bytes(f"rank-{index}/state.bin", b"x" * 100)
            AfterCommit(store, step, retention=policy).run(txn.committed_url)
            secs = time.perf_counter() - started
            payload_puts = sum(1 for m, u in sent if m == "PUT" and "/attempt-" in u)
            per_save.append({"save": k, "requests": len(sent), "payload_puts": payload_puts,
                             "beyond_payloads": len(sent) - payload_puts, "secs": secs})
        rows.append({"kept": kept, "saves": per_save, "steps_after": len(store.steps())})
        log(f"bookkeeping: {kept} kept steps: {[s['beyond_payloads'] for s in per_save]} requests beyond payloads")
    pool.shutdown()
    return rows


# -- report -----------------------------------------------------------------------------------------


def report(args, rows: list[dict], books: list[dict], machine: list[tuple[str, str]]) -> list[str]:
    constants = fit(rows)
    lines = ["# Simulated ranks against S3's request-rate limits", "",
             f"`python -m bench.simulation {' '.join(sys.argv[1:])}` on {_dt.date.today().isoformat()}.", "",
             "| machine | |", "|---|---|", *(f"| {k} | {v} |" for k, v in machine), "",
             f"Scaled state: parts of {args.part_kib} KiB stand for {REAL_PART_MIB} MiB parts (the requests of a "
             f"rank are those of a real rank with as many 16 MiB parts); ranks as threads in "
             f"{args.processes} processes (8 ranks: 1); moto behind the rate-limit proxy, each in a process of its "
             f"own. Limits: {args.prefix_writes:g} writes/s per partition (burst {args.burst_secs:g} s), "
             f"{args.prefixes} partitioned prefixes for the spread layout, reads "
             f"{'unlimited' if args.prefix_reads is None else f'{args.prefix_reads:g}/s'}, bucket "
             f"{'unlimited' if args.bucket_writes is None else f'{args.bucket_writes:g} writes/s'}.", ""]
    if rows:
        lines += ["| ranks | scenario | parts/rank | requests (refused) | writes admitted | commit s | "
                  "model s | throttled answers | retries | busiest partition writes | manifest KiB | "
                  "manifest create s | latest_step s | verify s | load |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            model = predict(r, args, constants)
            lines.append(
                f"| {r['ranks']} | {r['scenario']} | {r['parts_per_rank']} | {r['requests']} ({r['throttled']}) | "
                f"{r['admitted_writes']} | {r['commit_secs']:.2f} | {model:.2f} | {r['throttled_answers']} | "
                f"{r['retries']} | {r['busiest_partition_writes']} | "
                f"{r.get('manifest_bytes', 0) / 1024:.1f} | {r.get('manifest_create_secs', float('nan')):.3f} | "
                f"{r.get('latest_step_secs', float('nan')):.2f} | {r.get('verify_secs', float('nan')):.2f} | "
                f"{r['load_1min_before']:.1f} |" + (f" {r['errors']} ranks failed: {r['first_error']}" if r["errors"] else ""))
        errors = [abs(predict(r, args, constants) - r["commit_secs"]) / r["commit_secs"] for r in rows
                  if not r["errors"]]
        lines += ["", f"Model constants fitted on the `free` saves: t0 = {constants['t0']:.2f} s, machine capacity = "
                  f"{constants['capacity']:.0f} admitted writes/s. Model against every measured point: median error "
                  f"{100 * sorted(errors)[len(errors) // 2]:.0f}%, largest {100 * max(errors):.0f}%.", ""]
        lines += ["Largest state that commits in time (parts of 16 MiB per rank; in total), by the model:", "",
                  "| ranks | rates | layout | write rate/s | 30 s | 120 s |", "|---|---|---|---|---|---|"]
        for ranks in sorted({r["ranks"] for r in rows}):
            for label, prefix_writes, capacity in (("measured here", args.prefix_writes, constants["capacity"]),
                                                   ("S3 (3,500/s per prefix)", AWS_PREFIX_WRITES, float("inf"))):
                for scenario in ("one-prefix", "spread"):
                    rate = write_rate(scenario, args, {**constants, "capacity": capacity}, prefix_writes=prefix_writes)
                    cells = []
                    for budget in BUDGETS_SECS:
                        parts = largest_parts(ranks, budget, rate, constants["t0"])
                        cells.append(f"{parts} parts = {parts * REAL_PART_MIB / 1024:.2f} GiB/rank, "
                                     f"{ranks * parts * REAL_PART_MIB / 1024:.0f} GiB")
                    lines.append(f"| {ranks} | {label} | {scenario} | {rate:.0f} | {cells[0]} | {cells[1]} |")
    if books:
        lines += ["", "Requests of a save of 8 payloads beyond its payloads, `keep_last=3, keep_every=10`, after the "
                  "kept steps (saves 1-5 of one store instance; save 4 and 5 delete the step leaving the window):", "",
                  "| kept steps | save 1 (new instance) | saves 2-5 |", "|---|---|---|"]
        for b in books:
            beyond = [s["beyond_payloads"] for s in b["saves"]]
            lines.append(f"| {b['kept']} | {beyond[0]} | {', '.join(map(str, beyond[1:]))} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.simulation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,64,256,512", help="comma-separated world sizes")
    parser.add_argument("--scenarios", default=",".join(ALL_SCENARIOS))
    parser.add_argument("--parts-per-rank", type=int, default=4)
    parser.add_argument("--part-kib", type=int, default=64)
    parser.add_argument("--parts-in-flight", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-writes", type=float, default=20.0, help="writes/s per partition")
    parser.add_argument("--prefix-reads", type=float, default=None, help="reads/s per partition (default: none)")
    parser.add_argument("--bucket-writes", type=float, default=None)
    parser.add_argument("--burst-secs", type=float, default=0.5)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--bookkeeping", action="store_true", help="also measure requests per save at 10/100/1,000 kept steps")
    parser.add_argument("--bookkeeping-only", action="store_true")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H%M")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_path = out / f"simulation-{stamp}-runs.jsonl"
    machine = machine_description()
    os.environ.update(moto_min_part_env(args.part_kib * 1024))
    moto = MotoProcess()
    moto.create_bucket("sim")
    proxy = RateLimitProxyProcess(moto.endpoint_url, RateLimits(prefix_writes_per_sec=None, prefix_reads_per_sec=None))
    rows: list[dict] = []
    books: list[dict] = []
    try:
        if not args.bookkeeping_only:
            step = 0
            for ranks in [int(n) for n in args.ranks.split(",")]:
                for scenario in args.scenarios.split(","):
                    step += 1
                    log(f"simulation: {ranks} ranks, {scenario}")
                    row = run_save(args, moto, proxy, ranks, scenario, step, args.parts_per_rank)
                    log(f"  commit {row['commit_secs']:.2f} s, {row['requests']} requests ({row['throttled']} refused), "
                        f"{row['retries']} retries, errors {row['errors']}")
                    rows.append(row)
                    with runs_path.open("a") as handle:
                        handle.write(json.dumps(row) + "\n")
        if args.bookkeeping or args.bookkeeping_only:
            books = bookkeeping(moto)
            with runs_path.open("a") as handle:
                handle.write(json.dumps({"bookkeeping": books}) + "\n")
    finally:
        proxy.stop()
        moto.stop()
    lines = report(args, rows, books, machine)
    text = "\n".join(lines) + "\n"
    (out / f"simulation-{stamp}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
