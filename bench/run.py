"""opd_store against the raw backend (the limit) and the alternatives, in one run.

    .venv/bin/python -m bench [--sizes 256,1024] [--backends local,s3] [--repeats 3]
                              [--sections speed,crc,requests] [--methods raw,torch.save,...]
                              [--cold-load]

Speed: for every state size (64 float32 tensors plus an SGD-momentum state of the same shapes,
``--sizes`` MiB in all) and backend (local disk; moto S3 over loopback in its own process), every
method of :mod:`bench.methods` saves the state and loads it back, each (method, backend, size, run)
in a fresh process forked from the benchmark (``bench/_method_child.py``), so the peak RSS of that save and load is measured
alone. Runs rotate the method order (run k starts at method k) so drift on a shared machine hits
every method alike. Reported per method: median seconds of ``--repeats`` runs, MiB/s of tensor
data, the ratio to ``raw`` (the backend's limit) and to ``torch.save`` (the baseline, no store) by
median, by min-of-runs and by CPU seconds, and peak RSS over the state. Local loads read from the
page cache (they follow their save), or from disk with ``--cold-load`` (every file of the method
dropped from the page cache first). Beside the methods: the fixed cost of a store save (``begin``,
one empty payload, commit; with its S3 requests), which is all the store adds to a raw write but
the CRC pass.

Then the CRC32C cost (:mod:`bench.checksum_cost`) at the largest size, the request counts of
``latest_step()`` and ``steps()`` at 10/100/1,000 steps on moto (:mod:`bench.request_counts`), a
throughput chart (``bench/results/bench-<date>.png``) and the report
(``bench/results/bench-<date>.md``), with the machine and library versions.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opd_testkit.s3 import MotoProcess, S3RequestCounter  # noqa: E402

from bench._common import (  # noqa: E402
    MIB,
    REPO_ROOT,
    _version,
    machine_description,
    median,
    now_stamp,
    run_forked,
    timed,
)
from bench.methods import LOCAL_ONLY, METHODS  # noqa: E402

TARGET_RATIO = 1.10
ASYNC_BLOCKED_RATIO = 0.10  # the spot-saves target: blocked time of an async save against the sync save
RSS_HEADROOM_MIB = 256
SPEED_OPS = ("save", "load")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ================================================================================================
# speed and memory
# ================================================================================================
def preload() -> None:
    """Import everything a measurement needs, once, before the first fork (no threads started)."""
    import s3fs  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed.checkpoint import _fsspec_filesystem  # noqa: F401

    import opd_store  # noqa: F401
    import opd_store.format._torch_io  # noqa: F401


def run_child(args, method: str, backend: str, size_mib: int, tag: int, root: str, options: dict,
              moto: MotoProcess | None) -> dict:
    """:func:`bench._method_child.measure_one` in a process forked from this one.

    A fork, not a new interpreter: on the loaded shared machine a fresh ``import torch`` took over a
    minute. This process never runs torch operators or starts threads before forking, so the child
    starts clean; its RSS readings are taken relative to its own state (VmHWM reset per phase).
    """
    from bench._method_child import measure_one

    row = run_forked(measure_one, method, backend, size_mib, root, tag, options, moto.pid if moto else None, True,
                     args.cold_load)
    if "error" in row:
        raise RuntimeError(f"{method}/{backend}/{size_mib} MiB failed:\n{row['error'][-4000:]}")
    if not row.get("verified"):
        raise RuntimeError(f"{method}/{backend}/{size_mib} MiB: the loaded state differs from the saved one")
    return row


def run_speed(args, moto: MotoProcess | None, tmp_root: str, runs_log: Path | None) -> dict:
    """{(size, backend, method): [child rows]}; each row is also appended to ``runs_log`` (JSON lines)
    as soon as it is measured, so an interrupted run can still be reported (``--report-only``)."""
    results: dict[tuple[int, str, str], list[dict]] = {}
    preload()
    options = {}
    if moto is not None:
        moto.new_bucket("bench-run")
        options = moto.storage_options()
        options["max_concurrency"] = 1  # one GET per object: moto builds the object per ranged GET
    for size_mib in args.sizes:
        for backend in args.backends:
            methods = [m for m in args.methods if backend == "local" or m not in LOCAL_ONLY]
            # Warm-up: one small run per method (imports, page cache of the code, moto's code paths).
            for method in methods:
                root = os.path.join(tmp_root, "warm") if backend == "local" else "s3://bench-run/warm"
                run_child(args, method, backend, 8, 999_999, root, options if backend == "s3" else {},
                          moto if backend == "s3" else None)
            log(f"speed {size_mib} MiB {backend}: warmed up {', '.join(methods)}")
            for rep in range(args.repeats):
                order = methods[rep % len(methods):] + methods[: rep % len(methods)]
                for method in order:
                    tag = 1000 * size_mib + rep
                    root = os.path.join(tmp_root, "local") if backend == "local" else "s3://bench-run/run"
                    row = run_child(args, method, backend, size_mib, tag, root,
                                    options if backend == "s3" else {}, moto if backend == "s3" else None)
                    results.setdefault((size_mib, backend, method), []).append(row)
                    if runs_log is not None:
                        with open(runs_log, "a") as handle:
                            handle.write(json.dumps(row) + "\n")
                    log(
                        f"speed {size_mib} MiB {backend} rep {rep}: {method:17s} save {row['save']['wall']:6.2f}s "
                        f"(cpu {row['save']['cpu']:.2f}) load {row['load']['wall']:6.2f}s (cpu {row['load']['cpu']:.2f})"
                    )
    return results


def fixed_store_cost(store, counter: S3RequestCounter | None, repeats: int = 5) -> dict[str, Any]:
    """Median wall seconds (and S3 requests) of a save's fixed part: ``begin`` + one empty payload +
    commit. With the CRC pass this is all the store adds to a raw write."""
    times = []
    counts: tuple[int, dict] | None = None
    for i in range(repeats):
        tag = 800_000 + i
        if counter is not None:
            counter.reset()

        def save() -> None:
            with store.begin(tag) as txn:
                txn.write_bytes("empty", b"")

        times.append(timed(save)[0])
        if counter is not None:
            counts = (counter.total, dict(counter.by_op))
        store.delete(tag)
    out: dict[str, Any] = {"secs": median(times)}
    if counts is not None:
        out["requests"], out["by_op"] = counts
    return out


def fixed_cost_lines(args, moto: MotoProcess | None, tmp_root: str) -> list[str]:
    """The fixed cost of a store save per backend, as a markdown table."""
    from opd_store import CheckpointStore

    lines = ["#### Fixed cost of a store save", "",
             "`begin` + one empty payload + commit (median of 5): with the CRC pass, all the store adds to a "
             "raw write of the same bytes.", "", "| backend | seconds | requests |", "|---|---|---|"]
    for backend in args.backends:
        counter = None
        if backend == "local":
            store = CheckpointStore(os.path.join(tmp_root, "fixed"))
        else:
            store = CheckpointStore("s3://bench-run/fixed", storage_options=moto.storage_options())
            counter = S3RequestCounter()
            counter.attach(store.storage.fs)
        result = fixed_store_cost(store, counter)
        requests = "-"
        if "requests" in result:
            requests = f"{result['requests']} (" + ", ".join(f"{k} {v}" for k, v in sorted(result["by_op"].items())) + ")"
        lines.append(f"| {backend} | {result['secs']:.3f} | {requests} |")
    return lines + [""]


def _med(rows: list[dict], op: str, key: str) -> float:
    return median([r[op][key] for r in rows])


def _min(rows: list[dict], op: str) -> float:
    return min(r[op]["wall"] for r in rows)


def _peak_over_mib(row: dict, op: str) -> float:
    base = row["with_state_kib"] if op == "save" else row[op]["rss_before_kib"]
    return (row[op]["peak_kib"] - base) / 1024


def speed_tables(args, results: dict) -> tuple[list[str], list[dict]]:
    """Markdown tables and one summary dict per (size, backend, method, op) for the chart."""
    lines: list[str] = []
    summary: list[dict] = []
    for size_mib in args.sizes:
        for op in SPEED_OPS:
            lines += [
                f"### {op.capitalize()}, {size_mib} MiB state",
                "",
                "| backend | method | median s | MiB/s | x raw (median) | x raw (min-of-runs) | x raw (CPU) | "
                "x torch.save (median) | CPU s | moto CPU s | peak RSS over " + ("state" if op == "save" else "pre-load")
                + " MiB (max of runs) | runs (s) |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for backend in args.backends:
                raw = results.get((size_mib, backend, "raw"))
                base = results.get((size_mib, backend, "torch.save"))
                for method in args.methods:
                    rows = results.get((size_mib, backend, method))
                    if not rows:
                        continue
                    wall = _med(rows, op, "wall")
                    cpu = _med(rows, op, "cpu")
                    server = _med(rows, op, "server")
                    mibs = rows[0]["state_bytes"] / MIB / wall
                    peak = max(_peak_over_mib(r, op) for r in rows)
                    entry = {"size_mib": size_mib, "backend": backend, "method": method, "op": op, "wall": wall,
                             "mib_s": mibs, "cpu": cpu, "peak_over_mib": peak, "min": _min(rows, op)}
                    cells = ["-", "-", "-", "-"]
                    if raw:
                        entry["x_raw"] = wall / _med(raw, op, "wall")
                        entry["x_raw_min"] = _min(rows, op) / _min(raw, op)
                        entry["x_raw_cpu"] = cpu / _med(raw, op, "cpu")
                        cells[:3] = [f"{entry['x_raw']:.2f}x", f"{entry['x_raw_min']:.2f}x", f"{entry['x_raw_cpu']:.2f}x"]
                    if base:
                        entry["x_torch_save"] = wall / _med(base, op, "wall")
                        entry["x_torch_save_min"] = _min(rows, op) / _min(base, op)
                        entry["x_torch_save_cpu"] = cpu / _med(base, op, "cpu")
                        cells[3] = f"{entry['x_torch_save']:.3f}x"
                    if op == "save" and all("save_total" in r for r in rows):
                        entry["save_total"] = median(r["save_total"] for r in rows)
                    summary.append(entry)
                    runs = ", ".join(f"{r[op]['wall']:.2f}" for r in rows)
                    lines.append(
                        f"| {backend} | {method} | {wall:.2f} | {mibs:.0f} | {' | '.join(cells)} | {cpu:.2f} | "
                        f"{server:.2f} | {peak:.0f} | {runs} |" if backend == "s3" else
                        f"| {backend} | {method} | {wall:.2f} | {mibs:.0f} | {' | '.join(cells)} | {cpu:.2f} | - | "
                        f"{peak:.0f} | {runs} |"
                    )
            lines.append("")
    return lines, summary


def target_lines(args, summary: list[dict]) -> list[str]:
    """Every speed/memory target of ``docs/performance.md`` that this run measures, PASS/MISS, with
    the margin."""
    def find(size, backend, method, op):
        for e in summary:
            if (e["size_mib"], e["backend"], e["method"], e["op"]) == (size, backend, method, op):
                return e
        return None

    def verdict(value: float, limit: float) -> str:
        return f"PASS ({value:.3f}x <= {limit:.2f}x)" if value <= limit else f"MISS by {100 * (value / limit - 1):.1f}% ({value:.3f}x > {limit:.2f}x)"

    lines = [
        "| size | backend | op | target | median | min-of-runs | CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in args.sizes:
        for backend in args.backends:
            for op in SPEED_OPS:
                store = find(size, backend, "opd_store", op)
                if store is None:
                    continue
                for label, key, limit in (
                    ("<= 1.10x raw bytes", "x_raw", TARGET_RATIO),
                    ("<= 1.10x raw torch.save", "x_torch_save", TARGET_RATIO),
                ):
                    if key in store:
                        lines.append(
                            f"| {size} MiB | {backend} | {op} | {label} | {verdict(store[key], limit)} | "
                            f"{store[key + '_min']:.3f}x | {store[key + '_cpu']:.3f}x |"
                        )
                other = find(size, backend, "seed" if backend == "local" else "dcp", op)
                if other is not None:
                    if backend == "local":
                        ratio = store["wall"] / other["wall"]
                        lines.append(
                            f"| {size} MiB | {backend} | {op} | <= 1.10x the seed's method | {verdict(ratio, TARGET_RATIO)} | "
                            f"{store['min'] / other['min']:.3f}x | {store['cpu'] / other['cpu']:.3f}x |"
                        )
                    else:
                        ratio = store["wall"] / other["wall"]
                        lines.append(
                            f"| {size} MiB | {backend} | {op} | faster than dcp | "
                            f"{'PASS' if ratio < 1 else 'MISS'} ({ratio:.3f}x dcp) | "
                            f"{store['min'] / other['min']:.3f}x | {store['cpu'] / other['cpu']:.3f}x |"
                        )
                if op == "load" and backend == "local":
                    mapped = find(size, backend, "opd_store-mmap", "load")
                    raw = find(size, backend, "raw", "load")
                    if mapped is not None and raw is not None:
                        lines.append(
                            f"| {size} MiB | {backend} | load | opd_store-mmap <= 1.10x raw bytes | "
                            f"{verdict(mapped['x_raw'], TARGET_RATIO)} | {mapped['x_raw_min']:.3f}x | {mapped['x_raw_cpu']:.3f}x |"
                        )
                if op == "save":
                    blocked = find(size, backend, "opd_store-async", "save")
                    if blocked is not None:
                        ratio = blocked["wall"] / store["wall"]
                        total = blocked.get("save_total")
                        lines.append(
                            f"| {size} MiB | {backend} | save | async blocked <= 10% of the sync save | "
                            f"{'PASS' if ratio <= ASYNC_BLOCKED_RATIO else 'MISS'} ({100 * ratio:.1f}%"
                            + (f"; save to commit {total:.2f} s" if total is not None else "") + ") | "
                            f"{100 * blocked['min'] / store['min']:.1f}% | {100 * blocked['cpu'] / store['cpu']:.1f}% |"
                        )
                    peak = store["peak_over_mib"]
                    lines.append(
                        f"| {size} MiB | {backend} | save | peak RSS <= state + {RSS_HEADROOM_MIB} MiB | "
                        f"{'PASS' if peak <= RSS_HEADROOM_MIB else 'MISS'} (+{peak:.0f} MiB) | | |"
                    )
    return lines


# ================================================================================================
# chart
# ================================================================================================
def write_chart(args, summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.sizes), 2, figsize=(13, 4.2 * len(args.sizes)), squeeze=False)
    colors = {"raw": "#7f7f7f", "torch.save": "#bcbd22", "seed": "#9467bd", "dcp": "#1f77b4",
              "opd_store": "#d62728", "opd_store-zipcrc": "#ff9896",
              "opd_store-mmap": "#e377c2", "opd_store-async": "#2ca02c"}
    for row, size in enumerate(args.sizes):
        for col, op in enumerate(SPEED_OPS):
            ax = axes[row][col]
            backends = [b for b in args.backends if any(e["backend"] == b and e["size_mib"] == size for e in summary)]
            width = 0.8 / max(1, len(args.methods))
            for i, method in enumerate(args.methods):
                xs, ys = [], []
                for j, backend in enumerate(backends):
                    for e in summary:
                        if (e["size_mib"], e["backend"], e["method"], e["op"]) == (size, backend, method, op):
                            xs.append(j + (i - (len(args.methods) - 1) / 2) * width)
                            ys.append(e["mib_s"])
                if xs:
                    bars = ax.bar(xs, ys, width, label=method, color=colors.get(method))
                    ax.bar_label(bars, fmt="%.0f", fontsize=7)
            ax.set_xticks(range(len(backends)))
            ax.set_xticklabels(backends)
            ax.set_ylabel("MiB/s (median of runs)")
            ax.set_title(f"{op}, {size} MiB state")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ================================================================================================
# main
# ================================================================================================
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256,1024", help="state sizes in MiB (default 256,1024)")
    parser.add_argument("--backends", default="local,s3")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default="speed,crc,requests")
    parser.add_argument("--steps", default="10,100,1000", help="committed step counts for the requests section")
    parser.add_argument("--tmp-dir", default=tempfile.gettempdir())
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--cold-load", action="store_true",
                        help="local loads read from disk (the method's files dropped from the page cache first)")
    parser.add_argument("--report-only", metavar="JSONL", default=None,
                        help="no measurement: rebuild the speed tables and chart from a runs log of an earlier run")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    args.backends = [s.strip() for s in args.backends.split(",") if s.strip()]
    args.methods = [s.strip() for s in args.methods.split(",") if s.strip()]
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.steps = [int(s) for s in args.steps.split(",") if s.strip()]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")

    need_bytes = 3 * max(args.sizes) * MIB + 2 * 2**30
    if shutil.disk_usage(args.tmp_dir).free < need_bytes:
        print(f"not enough free disk in {args.tmp_dir}", file=sys.stderr)
        return 2
    tmp_root = tempfile.mkdtemp(prefix="opd-bench-run-", dir=args.tmp_dir)
    stamp = time.strftime("%Y-%m-%d") + (f"-{args.tag}" if args.tag else "")
    runs_log = None if args.no_write or args.report_only else Path(args.out_dir) / f"bench-{stamp}-runs.jsonl"
    if runs_log is not None:
        os.makedirs(args.out_dir, exist_ok=True)
        runs_log.write_text("")
    if args.report_only:
        args.sections = [s for s in args.sections if s == "speed"]
    started = now_stamp()
    command = " ".join([Path(sys.executable).name, "-m", "bench"] + (argv if argv is not None else sys.argv[1:]))
    machine = machine_description(args.tmp_dir) + [
        ("matplotlib", _version("matplotlib")),
    ]
    out = [f"# opd_store against the raw backend and the alternatives, {started}", "", f"Command: `{command}`", ""]
    out += ["## Machine", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in machine] + [""]
    out += [
        "Shared, noisy machine (other engineers' jobs run beside this one): compare ratios measured in "
        "this run, and read the median, min-of-runs and CPU-time ratios side by side. moto runs in its own "
        "process (its CPU competes with the client for the cores, for every method alike).",
        "",
    ]
    moto = None
    summary: list[dict] = []
    results: dict = {}
    try:
        if not args.report_only and ("s3" in args.backends or "requests" in args.sections):
            moto = MotoProcess()
            log(f"moto server pid {moto.pid} at {moto.endpoint_url}")

        def section(title: str, fn: Callable[[], list[str]]) -> None:
            out.extend([title, ""])
            try:
                out.extend(fn())
            except Exception as exc:  # noqa: BLE001 - report and go on
                import traceback

                log(f"{title}: FAILED\n{traceback.format_exc()}")
                out.append(f"**Section failed**: `{exc!r}`"[:3000])
            out.append("")

        if "speed" in args.sections:
            def speed() -> list[str]:
                if args.report_only:
                    results.update(load_runs(args.report_only))
                else:
                    results.update(run_speed(args, moto, tmp_root, runs_log))
                tables, rows = speed_tables(args, results)
                summary.extend(rows)
                fixed = [] if args.report_only else fixed_cost_lines(args, moto, tmp_root)
                return _speed_intro(args) + tables + ["#### Targets", ""] + target_lines(args, summary) + fixed

            section("## 1. Save and load: methods side by side", speed)
        if "crc" in args.sections:
            section("## 2. Checksum cost", lambda: crc_section(args, results))
        if "requests" in args.sections:
            from bench.request_counts import run_requests

            ns = SimpleNamespace(steps=args.steps, checkpoints_info=True)
            section("## 3. Backend requests on moto", lambda: run_requests(ns, moto))
        out.append(f"Finished {now_stamp()}; load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(tmp_root, ignore_errors=True)

    chart_path = Path(args.out_dir) / f"bench-{stamp}.png"
    if summary and not args.no_write:
        os.makedirs(args.out_dir, exist_ok=True)
        write_chart(args, summary, chart_path, f"opd_store bench {started} ({command})")
        out.insert(4, f"Chart: [{chart_path.name}]({chart_path.name})\n")
    text = "\n".join(out) + "\n"
    print(text)
    if not args.no_write:
        os.makedirs(args.out_dir, exist_ok=True)
        path = Path(args.out_dir) / f"bench-{stamp}.md"
        path.write_text(text)
        (Path(args.out_dir) / f"bench-{stamp}.json").write_text(json.dumps(summary, indent=1))
        log(f"wrote {path}" + (f" and {chart_path}" if summary else ""))
    return 0


def load_runs(path: str) -> dict:
    """Rows of a runs log (``bench-<date>-runs.jsonl``), keyed like :func:`run_speed`'s result."""
    results: dict = {}
    with open(path) as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                results.setdefault((row["size_mib"], row["backend"], row["method"]), []).append(row)
    return results


def _speed_intro(args) -> list[str]:
    from bench.methods import __doc__ as methods_doc

    table = methods_doc.split("\n\n", 2)[2]
    return [
        f"State: 64 float32 tensors plus an SGD-momentum state of the same shapes ({', '.join(f'{s} MiB' for s in args.sizes)} "
        f"of tensor data in all). Each (method, backend, size, run) runs in a fresh process forked from the benchmark: save, then load of what it "
        f"saved. {args.repeats} runs; run k starts the method rotation at method k. *x raw*: against the backend's "
        "limit (the tensors' bytes written/read with no serialisation); *x torch.save*: against plain `torch.save`. "
        "*CPU s*: CPU seconds of the benchmark process (all threads), the steadiest signal on a shared machine. "
        "*peak RSS over state*: VmHWM during the save minus RSS with the state built; for loads, VmHWM minus "
        "RSS before the load (the loaded state itself counts). "
        + ("Local loads read from disk: every file of the method is dropped from the page cache first (`--cold-load`). "
           if args.cold_load else
           "Local loads follow their save at once, so they read from the page cache for every method alike (this "
           "VM's DAMON page-out may evict some pages; `--cold-load` reads from disk). ")
        + "S3 uses s3fs with `max_concurrency=1` for every method (moto builds the whole object for every ranged GET).",
        "",
        "Methods:",
        "",
        "```",
        table.strip("\n"),
        "```",
        "",
    ]


def crc_section(args, results: dict) -> list[str]:
    """The checksum section at the largest size, against the opd_store save medians of this run."""
    from bench.checksum_cost import run_crc
    from bench.methods import flat_tensors, make_training_state

    size = max(args.sizes)
    state = {f"t{i:03d}": t for i, t in enumerate(flat_tensors(make_training_state(size)))}
    speed_results = {}
    for backend in args.backends:
        rows = results.get((size, backend, "opd_store"))
        if rows:
            speed_results[backend] = {"runs": {"store_save": [{"wall": r["save"]["wall"]} for r in rows]}}
    try:
        return [f"State of {size} MiB ({len(state)} tensors)."] + run_crc(SimpleNamespace(repeats=args.repeats), state, speed_results)
    finally:
        del state
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
