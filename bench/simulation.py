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
import re
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


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped for a full accept queue (Linux ``TcpExt:
    ListenOverflows``; ``None`` elsewhere): a server that cannot accept the ranks' connections at
    once makes them wait seconds to connect."""
    try:
        lines = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()
                 if line.startswith("TcpExt:")]
        return int(dict(zip(lines[0], lines[1]))["ListenOverflows"])
    except (OSError, KeyError, IndexError, ValueError):
        return None


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
             step: int, parts: int, *, root: str | None = None) -> dict[str, Any]:
    bucket, root = "sim", root or f"n{ranks}-{scenario}-p{parts}"
    proxy.set_limits(_limits(scenario, args, bucket, root))
    proxy.reset()
    spec = SimSpec(world_size=ranks, step=step, state_bytes=parts * args.part_kib * 1024,
                   part_size_bytes=args.part_kib * 1024, parts_in_flight=args.parts_in_flight,
                   key_layout="step" if scenario.startswith("one-prefix") else "spread", key_prefixes=args.prefixes,
                   processes=1 if ranks <= 16 else args.processes, pacing=not scenario.endswith("-unpaced"))
    options = dict(moto.storage_options(), endpoint_url=proxy.endpoint_url)
    load = os.getloadavg()[0]
    overflows = listen_overflows()
    started = time.perf_counter()
    result = simulate(spec, f"s3://{bucket}/{root}", options)
    wall = time.perf_counter() - started
    overflows_after = listen_overflows()
    stats = proxy.stats()
    row: dict[str, Any] = {
        "ranks": ranks, "scenario": scenario, "parts_per_rank": parts, "part_kib": args.part_kib,
        "commit_secs": result.commit_secs, "setup_secs": result.setup_secs, "wall_secs": wall,
        "errors": len(result.errors), "error_by_rank": result.errors,
        "first_error": short_error(result.errors) if result.errors else None,
        "requests": stats["requests"], "throttled": stats["throttled"], "writes": stats["writes"],
        "throttled_writes": stats["throttled_writes"], "by_op": stats["by_op"],
        "throttled_by_op": stats["throttled_by_op"], "partitions_used": len([p for p in stats["by_partition"] if p]),
        "busiest_partition_writes": max(stats["by_partition"].values(), default=0),
        "throttled_answers": result.total("throttled_answers"), "retries": result.total("retries"),
        "throttled_secs_max": max(o.throttled_secs for o in result.ranks),
        "load_1min_before": load, "load_1min_after": os.getloadavg()[0],
        "listen_overflows": None if overflows is None or overflows_after is None else overflows_after - overflows, "limits": dataclasses.asdict(_limits(scenario, args, bucket, root)) | {
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
#
# A save's time to commit is a fixed time plus its writes at the rate it is served at:
#
#     T = t0 + max(W / capacity, (W - B) / (goodput x limit)),  B = limit x burst_secs
#
# W: the save's writes (writes_per_save); capacity: the writes per second this machine's moto,
# proxy and ranks serve; limit: the write rate the layout reaches (one partition's rate for
# one-prefix, the rate times the partitions for spread, capped by the bucket's; none for free,
# where only capacity counts); B: the writes the token buckets admit at once (each partition starts
# full, burst_secs of its rate); goodput: the share of the limit the paced ranks get (refusals and
# back-offs cost some). Whichever of the machine and the limit is slower decides. Fitted on every committed point (median of the repeats): t0, capacity and
# goodput, minimising the squared relative error. Assumptions: the ranks start together and the
# save is write-bound (reads: the commit's few listings and existence probes, in t0); a rank's
# writes are its create, parts and completion; throttling costs a constant share of the limit.


def writes_per_save(ranks: int, parts: int) -> int:
    """Writes of a save: per rank one upload created, ``parts`` parts, one completion (a rank's
    one-part state is one PutObject instead), and rank 0's shared file and manifest."""
    per_rank = 1 if parts <= 1 else parts + 2
    return ranks * per_rank + 2


def limit_of(scenario: str, args, *, prefix_writes: float | None = None) -> float | None:
    """The write rate a scenario's layout reaches (``None``: unlimited)."""
    if scenario == "free":
        return None
    prefix = args.prefix_writes if prefix_writes is None else prefix_writes
    limit = prefix * (1 if scenario.startswith("one-prefix") else args.prefixes)
    return min(limit, args.bucket_writes) if args.bucket_writes else limit


def write_rate(scenario: str, args, constants: dict[str, float], *, prefix_writes: float | None = None) -> float:
    """``R`` of the model: admitted writes per second a save gets."""
    limit = limit_of(scenario, args, prefix_writes=prefix_writes)
    return constants["capacity"] if limit is None else min(constants["capacity"], constants["goodput"] * limit)


def burst_of(scenario: str, args, *, prefix_writes: float | None = None) -> float:
    """``B`` of the model: the writes the full token buckets admit at once."""
    limit = limit_of(scenario, args, prefix_writes=prefix_writes)
    return 0.0 if limit is None else limit * args.burst_secs


def seconds_to_write(writes: float, scenario: str, args, constants: dict[str, float], *,
                     prefix_writes: float | None = None) -> float:
    """``max(W / capacity, (W - B) / (goodput x limit))`` of the model."""
    limit = limit_of(scenario, args, prefix_writes=prefix_writes)
    secs = writes / constants["capacity"]
    if limit is not None:
        burst = burst_of(scenario, args, prefix_writes=prefix_writes)
        secs = max(secs, max(0.0, writes - burst) / (constants["goodput"] * limit))
    return secs


def predict(point: dict, args, constants: dict[str, float]) -> float:
    writes = writes_per_save(point["ranks"], point["parts_per_rank"])
    return constants["t0"] + seconds_to_write(writes, point["scenario"], args, constants)


def points(rows: list[dict]) -> list[dict]:
    """One point per (ranks, scenario): the median commit time of its committed repeats (``None``
    when none committed), with the repeats' times and failures."""
    grouped: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["ranks"], row["scenario"]), []).append(row)
    out = []
    for (ranks, scenario), group in grouped.items():
        ok = sorted(r["commit_secs"] for r in group if not r["errors"])
        median = (ok[(len(ok) - 1) // 2] + ok[len(ok) // 2]) / 2 if ok else None
        out.append({"ranks": ranks, "scenario": scenario, "parts_per_rank": group[0]["parts_per_rank"],
                    "commit_secs": median, "repeats": [r["commit_secs"] for r in group],
                    "failed": sum(1 for r in group if r["errors"]), "rows": group})
    return out


def fit(pts: list[dict], args) -> dict[str, float]:
    """``t0``, ``capacity`` and ``goodput`` minimising the squared relative error over the committed
    points of paced saves: a grid over capacity and goodput, ``t0`` in closed form for each (weighted least squares)."""
    done = [p for p in pts if p["commit_secs"] is not None and not p["scenario"].endswith("-unpaced")]
    best = {"t0": 0.0, "capacity": float("inf"), "goodput": 1.0, "error": float("inf")}
    if not done:
        return best
    for capacity in [10 * 1.05 ** i for i in range(120)]:
        for goodput in [g / 100 for g in range(30, 101, 2)]:
            c = {"t0": 0.0, "capacity": capacity, "goodput": goodput}
            xs = [predict(p, args, c) for p in done]
            ys = [p["commit_secs"] for p in done]
            t0 = max(0.0, sum((y - x) / y ** 2 for x, y in zip(xs, ys)) / sum(1 / y ** 2 for y in ys))
            error = sum(((t0 + x - y) / y) ** 2 for x, y in zip(xs, ys))
            if error < best["error"]:
                best = {"t0": t0, "capacity": capacity, "goodput": goodput, "error": error}
    return best


def largest_parts(ranks: int, budget_secs: float, scenario: str, args, constants: dict[str, float], *,
                  prefix_writes: float | None = None) -> int:
    """The most parts per rank whose save commits within ``budget_secs`` by the model."""
    def fits(parts: int) -> bool:
        writes = writes_per_save(ranks, parts)
        return constants["t0"] + seconds_to_write(writes, scenario, args, constants,
                                                  prefix_writes=prefix_writes) <= budget_secs

    if not fits(2):
        return 0
    low, high = 2, 4
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def short_error(errors: dict[int, str], limit: int = 200) -> str:
    """One line for a failed save: how many ranks failed and the first failing rank's own error
    (rank 0's message lists every rank's: only the first is kept), cut to ``limit`` characters."""
    text = " ".join(errors[min(errors)].split())
    found = re.search(r"rank (\d+) failed: (.*?)(?=; rank \d+ failed: |$)", text)
    first = f"rank {found.group(1)} failed: {found.group(2)}" if found else text
    return f"{len(errors)} ranks failed; {first[:limit]}{'...' if len(first) > limit else ''}"


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


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(args, rows: list[dict], books: list[dict], machine: list[tuple[str, str]]) -> list[str]:
    pts = points(rows)
    constants = fit(pts, args)
    lines = ["# Simulated ranks against S3's request-rate limits", "",
             f"`python -m bench.simulation {' '.join(sys.argv[1:])}` on {_dt.date.today().isoformat()}.", "",
             "| machine | |", "|---|---|", *(f"| {k} | {v} |" for k, v in machine), "",
             f"Scaled state: parts of {args.part_kib} KiB stand for {REAL_PART_MIB} MiB parts (the requests of a "
             f"rank are those of a real rank with as many 16 MiB parts); ranks as threads in "
             f"{args.processes} processes (8 ranks: 1); moto behind the rate-limit proxy, each in a process of its "
             f"own. Limits: {args.prefix_writes:g} writes/s per partition (burst {args.burst_secs:g} s), "
             f"{args.prefixes} partitioned prefixes for the spread layout, reads "
             f"{'unlimited' if args.prefix_reads is None else f'{args.prefix_reads:g}/s'}, bucket "
             f"{'unlimited' if args.bucket_writes is None else f'{args.bucket_writes:g} writes/s'}. "
             f"Each point of {', '.join(args.repeat_scenarios.split(','))} saved {args.repeats} times, "
             f"interleaved (the median is the point); the others once. A warm-up save ran first.", ""]
    if rows:
        lines += ["| ranks | scenario | parts/rank | requests (refused) | writes admitted | commit s (median) | "
                  "repeats s | model s | throttled answers | retries | busiest partition writes | manifest KiB | "
                  "manifest create s | latest_step s | verify s | accept-queue drops | load | outcome |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in pts:
            r = p["rows"][0]  # the first repeat's counts (every repeat sends the same writes)
            ok = next((x for x in p["rows"] if not x["errors"]), r)
            model = predict(p, args, constants)
            failed = [x for x in p["rows"] if x["errors"]]
            drops = ", ".join("-" if x.get("listen_overflows") is None else str(x["listen_overflows"])
                              for x in p["rows"])
            loads = ", ".join(f"{x['load_1min_before']:.1f}" for x in p["rows"])
            lines.append(
                f"| {p['ranks']} | {p['scenario']} | {p['parts_per_rank']} | {r['requests']} ({r['throttled']}) | "
                f"{r['admitted_writes']} | {_cell(p['commit_secs'], '.2f')} | "
                f"{', '.join(f'{t:.1f}' + ('!' if x['errors'] else '') for t, x in zip(p['repeats'], p['rows']))} | "
                f"{model:.2f} | {r['throttled_answers']} | {r['retries']} | {r['busiest_partition_writes']} | "
                f"{ok.get('manifest_bytes', 0) / 1024:.1f} | {_cell(ok.get('manifest_create_secs'), '.3f')} | "
                f"{_cell(ok.get('latest_step_secs'), '.2f')} | {_cell(ok.get('verify_secs'), '.2f')} | {drops} | "
                f"{loads} |"
                + (f" {short_error(failed[0]['error_by_rank']).replace('|', '/')} |" if failed else " committed |"))
        errors = [(p, (predict(p, args, constants) - p["commit_secs"]) / p["commit_secs"]) for p in pts
                  if p["commit_secs"] is not None and not p["scenario"].endswith("-unpaced")]
        magnitudes = sorted(abs(e) for _, e in errors)
        each = ", ".join(f"{p['ranks']} {p['scenario']} {100 * e:+.0f}%" for p, e in errors)
        lines += ["", "`!`: that repeat failed (not in the median). Accept-queue drops: the kernel's `ListenOverflows` during the save (the whole machine's). Model (docs/performance.md): "
                  "T = t0 + max(W / capacity, (W - B) / (goodput x limit)), fitted on every committed point but the unpaced ones (their goodput is not the pacer's): "
                  f"t0 = {constants['t0']:.2f} s, capacity = {constants['capacity']:.0f} admitted writes/s, "
                  f"goodput = {constants['goodput']:.2f} of the limit. Model against the measured points: median "
                  f"error {100 * magnitudes[len(magnitudes) // 2]:.0f}%, largest {100 * magnitudes[-1]:.0f}% "
                  f"({each}).", ""]
        lines += ["Largest state that commits in time (parts of 16 MiB per rank; in total), by the model "
                  "(S3's rates: this machine's t0 and goodput, no machine capacity):", "",
                  "| ranks | rates | layout | write rate/s | 30 s | 120 s |", "|---|---|---|---|---|---|"]
        for ranks in sorted({p["ranks"] for p in pts}):
            for label, prefix_writes, capacity in (("measured here", args.prefix_writes, constants["capacity"]),
                                                   ("S3 (3,500/s per prefix)", AWS_PREFIX_WRITES, float("inf"))):
                for scenario in ("one-prefix", "spread"):
                    c = {**constants, "capacity": capacity}
                    rate = write_rate(scenario, args, c, prefix_writes=prefix_writes)
                    cells = []
                    for budget in BUDGETS_SECS:
                        parts = largest_parts(ranks, budget, scenario, args, c, prefix_writes=prefix_writes)
                        cells.append(f"{parts} parts = {parts * REAL_PART_MIB / 1024:.2f} GiB/rank, "
                                     f"{ranks * parts * REAL_PART_MIB / 1024:,.0f} GiB")
                    lines.append(f"| {ranks} | {label} | {scenario} | {rate:,.0f} | {cells[0]} | {cells[1]} |")
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
    parser.add_argument("--repeats", type=int, default=3, help="saves per point of --repeat-scenarios (median)")
    parser.add_argument("--repeat-scenarios", default="free,spread")
    parser.add_argument("--unpaced-max-ranks", type=int, default=256,
                        help="largest N of one-prefix-unpaced (it retries until throttle_timeout_secs)")
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
            scenarios = args.scenarios.split(",")
            repeated = set(args.repeat_scenarios.split(","))
            log("simulation: warm-up save (not reported)")
            run_save(args, moto, proxy, 8, "free", 0, args.parts_per_rank, root="warm-up")
            for ranks in [int(n) for n in args.ranks.split(",")]:
                # Interleaved: repeat k of every scenario, then repeat k + 1 (a passing load spike
                # lands on different scenarios, not on all repeats of one).
                for repeat in range(args.repeats):
                    for scenario in scenarios:
                        if (repeat and scenario not in repeated) or (
                                scenario == "one-prefix-unpaced" and ranks > args.unpaced_max_ranks):
                            continue
                        step += 1
                        log(f"simulation: {ranks} ranks, {scenario}, repeat {repeat + 1}, load {os.getloadavg()[0]:.1f}")
                        row = run_save(args, moto, proxy, ranks, scenario, step, args.parts_per_rank,
                                       root=f"n{ranks}-{scenario}-p{args.parts_per_rank}-r{repeat}")
                        row["repeat"] = repeat
                        log(f"  commit {row['commit_secs']:.2f} s, {row['requests']} requests ({row['throttled']} "
                            f"refused), {row['retries']} retries"
                            + (f", {short_error(row['error_by_rank'])}" if row["errors"] else ""))
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
