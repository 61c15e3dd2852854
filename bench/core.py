"""Core benchmarks of opd_store, measured side by side in one run (issue 2, "Speed and memory").

    .venv/bin/python -m bench.core [--size-mib 1024] [--repeats 3] [--sections speed,rss,crc,requests]

Sections:

1. speed: saving and loading a state of 64 float32 tensors (``--size-mib`` in all) through the
   store versus the same bytes written/read straight to the same backend:

   - local, raw save: ``torch.save(state, path)`` (PyTorch's own C++ file writer), then ``fsync``
     of the file; the store: ``store.begin`` / ``txn.open`` / ``torch.save(state, writer)`` /
     commit (CRC32C while streaming, ``fsync`` of payload, directories and manifest).
     Local raw load: ``torch.load(path)``; store: ``torch.load(store.open(step, name))``.
     Both write and read through the page cache: the reads run right after the writes, so they are
     warm-cache reads (memory copies and CPU, no disk); the writes include the ``fsync`` to disk.
     Local loads run twice: *cold* (the file dropped from the page cache first) and *warm* (read
     once just before).
   - s3 (moto, in its own process, objects kept in memory): raw save
     ``with fs.open(path, "wb") as f: torch.save(state, f)`` on an s3fs instance with the store's
     own options (so the same multipart block size); raw load
     ``torch.load(io.BytesIO(fs.cat_file(path)))`` (one GET: the fastest raw way, field notes).
     Both use ``max_concurrency=1`` (``--s3-max-concurrency``): moto materialises the whole object
     for every ranged GET, so s3fs's 10 concurrent ranged GETs of 1 GiB would need ~20 GiB there.

   Runs alternate (raw, store, then store, raw, ...) so drift on a shared machine hits both; the
   median of ``--repeats`` runs is reported, with the min-of-runs ratio, the client's CPU seconds
   and moto's CPU seconds beside it. Target: store <= 1.10x raw. Also printed: the store's fixed
   cost per save (begin + one empty payload + commit) and prototypes of proposed changes
   (``bench/prototypes.py``; ``--no-extras`` skips them).
2. rss: peak resident memory of one save in a fresh process (VmHWM reset after building the
   state), store vs raw. Target: peak <= state size + 256 MiB (process baseline excluded). With
   extras, also one single big tensor on S3 (fsspec buffers a whole ``write()``), and the
   sliced-writes prototype.
3. crc: CRC32C alone over the tensors' storage (memoryviews, no copies) versus the store's save
   time. Target: < 5 % of the save. The ``crc32c`` package's CRC32C (opd_store's checksum before
   2026-11-30) is timed beside it when installed (the ``bench`` extra).
4. requests: S3 requests (counted both by a botocore ``before-send.s3`` handler on the store's own
   client and at the moto server) of ``latest_step()`` and ``steps()`` with 10, 100 and 1,000
   committed steps of 10 objects each plus failed-attempt leftovers. Targets: ``latest_step()``
   <= 5 requests at 1,000 steps; ``steps()`` no request per step.

Results are printed as markdown and written to ``bench/results/core-<date>[-<size>mib].md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import gc
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # ``python bench/core.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import prototypes  # noqa: E402
from bench._common import (  # noqa: E402
    MIB,
    N_TENSORS,
    REPO_ROOT,
    MotoProcess,
    _version,
    drop_file_cache,
    process_cpu_secs,
    warm_file_cache,
    S3RequestCounter,
    machine_description,
    make_state,
    median,
    now_stamp,
    state_nbytes,
    tensor_views,
)

SAVE_TARGET = 1.10
LOAD_TARGET = 1.10
RSS_HEADROOM_MIB = 256
CRC_TARGET_PCT = 5.0
LATEST_TARGET_REQUESTS = 5
PAYLOAD = "state.pt"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def fmt_ratio(value: float, target: float) -> str:
    return f"{value:.3f}x {'PASS' if value <= target else 'MISS'}"


def s3_speed_options(args, moto: MotoProcess) -> dict:
    options = moto.storage_options()
    if args.s3_max_concurrency:
        options["max_concurrency"] = args.s3_max_concurrency
    return options


# ================================================================================================
# 1. speed
# ================================================================================================
class LocalCase:
    name = "local"

    def __init__(self, root: str) -> None:
        from opd_store import CheckpointStore

        self.root = root
        self.store = CheckpointStore(os.path.join(root, "store"))
        os.makedirs(os.path.join(root, "raw"), exist_ok=True)
        self.describe_raw_save = "torch.save(state, path) + fsync(file)"
        self.describe_raw_load = "torch.load(path)"

    def raw_path(self, tag: int) -> str:
        return os.path.join(self.root, "raw", f"raw-{tag}.pt")

    def raw_save(self, state, tag: int) -> int:
        import torch

        path = self.raw_path(tag)
        torch.save(state, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return os.path.getsize(path)

    def pyfile_save(self, state, tag: int) -> int:
        """Informational: torch.save into a Python file object (what the store's writer wraps)."""
        import torch

        path = self.raw_path(tag) + ".pyfile"
        with open(path, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        return os.path.getsize(path)

    def raw_load(self, tag: int):
        import torch

        return torch.load(self.raw_path(tag))

    def cleanup(self, tag: int) -> None:
        for path in (self.raw_path(tag), self.raw_path(tag) + ".pyfile"):
            if os.path.exists(path):
                os.unlink(path)
        self.store.delete(tag)


class S3Case:
    name = "s3"

    def __init__(self, moto: MotoProcess, bucket: str, options: dict) -> None:
        import s3fs

        from opd_store import CheckpointStore

        self.moto = moto
        self.bucket = bucket
        self.options = options
        self.store = CheckpointStore(f"s3://{bucket}/store", storage_options=options)
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        self.fs.connect()
        self.store.storage.fs.connect()
        self.block_size = self.fs.default_block_size
        store_block = self.store.storage.fs.default_block_size
        if store_block != self.block_size:
            raise RuntimeError(f"block sizes differ: raw {self.block_size}, store {store_block}")
        self.describe_raw_save = (
            f'fs.open(path, "wb") + torch.save (s3fs multipart, block {self.block_size // MIB} MiB, parts sent '
            "one at a time)"
        )
        self.describe_raw_load = (
            "torch.load(io.BytesIO(fs.cat_file(path))) (one GET with max_concurrency=1, else s3fs's "
            "HEAD + concurrent ranged GETs)"
        )
        self.describe_options = (
            f"s3fs options for raw and store alike: max_concurrency={self.fs.max_concurrency}, "
            f"default_block_size={self.block_size // MIB} MiB"
        )

    def raw_path(self, tag: int) -> str:
        return f"{self.bucket}/raw/raw-{tag}.pt"

    def raw_save(self, state, tag: int) -> int:
        import torch

        with self.fs.open(self.raw_path(tag), "wb") as handle:
            torch.save(state, handle)
        return handle.loc

    def raw_load(self, tag: int):
        import torch

        return torch.load(io.BytesIO(self.fs.cat_file(self.raw_path(tag))))

    def ranged_load(self, tag: int):
        """Informational: torch.load straight on an s3fs file (default readahead cache)."""
        import torch

        with self.fs.open(self.raw_path(tag), "rb") as handle:
            return torch.load(handle)

    def cleanup(self, tag: int) -> None:
        try:
            self.fs.rm_file(self.raw_path(tag))
        except FileNotFoundError:
            pass
        self.store.delete(tag)


def store_save(case, state, tag: int) -> int:
    import torch

    with case.store.begin(tag) as txn:
        with txn.open(PAYLOAD) as writer:
            torch.save(state, writer)
    return txn.entries[0].size_bytes


def store_load(case, tag: int):
    import torch

    with case.store.open(tag, PAYLOAD) as handle:
        return torch.load(handle)


def store_payload_path(case, tag: int) -> str:
    from opd_store.layout import step_dirname

    entry = case.store.manifest(tag).entry(PAYLOAD)
    return case.store.storage.path(f"{step_dirname(tag)}/{entry.path}")


def measure(fn: Callable[[], Any], moto: MotoProcess | None) -> tuple[dict[str, float], Any]:
    """Wall seconds, client CPU seconds (all threads) and moto CPU seconds of one call."""
    gc.collect()
    server0 = moto.cpu_secs() if moto is not None else 0.0
    cpu0 = process_cpu_secs()
    started = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - started
    cpu = process_cpu_secs() - cpu0
    server = (moto.cpu_secs() - server0) if moto is not None else 0.0
    return {"wall": wall, "cpu": cpu, "server": server}, result


def fixed_store_cost(case, repeats: int = 5) -> dict[str, Any]:
    """Median wall seconds (and S3 requests) of a save's fixed part: ``begin`` + one empty payload
    + commit. With the CRC pass this is all the store adds to a raw write."""
    counter = None
    if isinstance(case, S3Case):
        counter = S3RequestCounter()
        counter.attach(case.store.storage.fs)
    times = []
    counts: tuple[int, dict] | None = None
    for i in range(repeats):
        tag = 800_000 + i
        if counter is not None:
            counter.reset()

        def save() -> None:
            with case.store.begin(tag) as txn:
                txn.write_bytes("empty", b"")

        secs, _ = timed(save)
        times.append(secs)
        if counter is not None:
            counts = (counter.total, dict(counter.by_op))
        case.store.delete(tag)
    out: dict[str, Any] = {"secs": median(times)}
    if counts is not None:
        out["requests"], out["by_op"] = counts
    return out


def run_speed(args, state, cases: list, results: dict) -> list[str]:
    import torch

    size_bytes = state_nbytes(state)
    mib = size_bytes / MIB
    small = make_state(8, seed=1)
    results["_crc_gib_s"] = crc_speed_gib_s(state)
    for case in cases:
        log(f"speed/{case.name}: warm-up with an 8 MiB state")
        case.raw_save(small, 900_000)
        store_save(case, small, 900_000)
        case.raw_load(900_000)
        store_load(case, 900_000)
        case.cleanup(900_000)

    def prepare_load(case, who: str, tag: int, variant: str) -> None:
        if not isinstance(case, LocalCase):
            return
        path = case.raw_path(tag) if who == "raw" else store_payload_path(case, tag)
        if variant == "cold":
            drop_file_cache(path)
        else:
            warm_file_cache(path)

    def proto_loader(case, tag: int, who: str):
        crc = prototypes.crc_function(who.rpartition("-")[2])

        def load():
            with prototypes.verified_local_open(case.store, tag, PAYLOAD, crc) as handle:
                return torch.load(handle)

        return load

    for case in cases:
        moto = case.moto if isinstance(case, S3Case) else None
        protos: tuple[str, ...] = ()
        if isinstance(case, LocalCase) and args.extras:
            protos = ("proto-awscrt",) + (("proto-crc32c",) if prototypes.crc32c_package_available() else ())
        load_ops = ("load_cold", "load_warm") if isinstance(case, LocalCase) else ("load",)
        ops = ("save",) + load_ops
        runs: dict[str, list[dict]] = {f"{who}_{op}": [] for op in ops for who in ("raw", "store")}
        object_bytes = {}
        for rep in range(args.repeats):
            tag = rep + 1
            order = ("raw", "store") if rep % 2 == 0 else ("store", "raw")
            for who in order:
                fn = (lambda: case.raw_save(state, tag)) if who == "raw" else (lambda: store_save(case, state, tag))
                m, nbytes = measure(fn, moto)
                object_bytes[who] = nbytes
                runs[f"{who}_save"].append(m)
                log(f"speed/{case.name} rep {rep}: {who} save {m['wall']:.2f}s (cpu {m['cpu']:.2f}s, moto {m['server']:.2f}s)")
            for op in load_ops:
                for who in order + protos:
                    prepare_load(case, who, tag, op.rpartition("_")[2])
                    if who == "raw":
                        fn = lambda: case.raw_load(tag)  # noqa: E731
                    elif who == "store":
                        fn = lambda: store_load(case, tag)  # noqa: E731
                    else:
                        fn = proto_loader(case, tag, who)
                    m, loaded = measure(fn, moto)
                    runs.setdefault(f"{who}_{op}", []).append(m)
                    log(f"speed/{case.name} rep {rep}: {who} {op} {m['wall']:.2f}s (cpu {m['cpu']:.2f}s, moto {m['server']:.2f}s)")
                    if rep == 0:
                        key = next(iter(state))
                        if not torch.equal(loaded[key], state[key]) or len(loaded) != len(state):
                            raise RuntimeError(f"{case.name}/{who}: loaded state differs from the saved one")
                    del loaded
            if isinstance(case, LocalCase) and args.extras:
                m, _ = measure(lambda: case.pyfile_save(state, tag), None)
                runs.setdefault("python-file save", []).append(m)
                log(f"speed/{case.name} rep {rep}: python-file save {m['wall']:.2f}s (cpu {m['cpu']:.2f}s)")
            if isinstance(case, S3Case) and args.ranged_load and rep == 0:
                m, loaded = measure(lambda: case.ranged_load(tag), moto)
                del loaded
                runs.setdefault("s3fs ranged load", []).append(m)
                log(f"speed/{case.name} rep {rep}: ranged load {m['wall']:.2f}s (cpu {m['cpu']:.2f}s)")
            case.cleanup(tag)
        results[case.name] = {"runs": runs, "object_bytes": object_bytes, "ops": ops}
        results[case.name]["fixed"] = fixed_store_cost(case)

    def med(values: list[dict], key: str) -> float:
        return median([v[key] for v in values])

    def walls(values: list[dict]) -> str:
        return ", ".join(f"{v['wall']:.2f}" for v in values)

    lines = [
        f"State: {N_TENSORS} float32 tensors, {mib:.0f} MiB of tensor data. {args.repeats} runs each, raw and "
        "store alternating (raw first in even runs, store first in odd ones); medians, MiB/s of tensor data. "
        "*cpu* = CPU seconds of the benchmark process (all threads: s3fs's I/O thread included), the "
        "store's own work independent of other tenants; *moto* = CPU seconds of the moto server.",
        "",
        "| backend | op | raw s | raw MiB/s | store s | store MiB/s | store/raw (wall) | target | "
        "min-of-runs ratio | cpu raw / store s | cpu ratio | moto cpu raw / store s | runs raw / store (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        result = results[case.name]
        runs = result["runs"]
        for op in result["ops"]:
            raw_runs, sto_runs = runs[f"raw_{op}"], runs[f"store_{op}"]
            target = SAVE_TARGET if op == "save" else LOAD_TARGET
            raw, sto = med(raw_runs, "wall"), med(sto_runs, "wall")
            rmin, smin = min(v["wall"] for v in raw_runs), min(v["wall"] for v in sto_runs)
            craw, csto = med(raw_runs, "cpu"), med(sto_runs, "cpu")
            server = (
                f"{med(raw_runs, 'server'):.2f} / {med(sto_runs, 'server'):.2f}" if case.name == "s3" else "-"
            )
            lines.append(
                f"| {case.name} | {op.replace('_', ' ')} | {raw:.2f} | {mib / raw:.0f} | {sto:.2f} | {mib / sto:.0f} | "
                f"{fmt_ratio(sto / raw, target)} | <= {target:.2f}x | {smin / rmin:.3f}x | {craw:.2f} / {csto:.2f} | "
                f"{csto / craw:.2f}x | {server} | "
                f"{walls(raw_runs)} / {walls(sto_runs)} |"
            )
    lines.append("")
    for case in cases:
        lines.append(f"- **{case.name}** raw save: {case.describe_raw_save}; raw load: {case.describe_raw_load}.")
        ob = results[case.name]["object_bytes"]
        lines.append(f"  Object sizes: raw {ob.get('raw')} B, store payload {ob.get('store')} B.")
        if isinstance(case, S3Case):
            lines.append(
                f"  {case.describe_options}. moto builds the whole object in memory for every ranged GET, "
                "so s3fs's default 10 concurrent ranged GETs of a 1 GiB object would need ~20 GiB in moto."
            )
        if isinstance(case, LocalCase):
            lines.append(
                "  *load cold*: the file's pages dropped from the page cache first (fsync + "
                "posix_fadvise DONTNEED), so both read from disk; *load warm*: the file read once just "
                "before, so both copy from the page cache (the worst case for the store's extra work). "
                "This VM runs DAMON proactive page-out (kdamond, action pageout), so the page cache does "
                "not stay warm by itself."
            )
        runs = results[case.name]["runs"]
        for key in sorted(runs):
            who, _, op = key.partition("_")
            if not who.startswith("proto-"):
                continue
            raw = med(runs[f"raw_{op}"], "wall")
            sto = med(runs[f"store_{op}"], "wall")
            lines.append(
                f"  Prototype (bench/prototypes.py `verified_local_open`, CRC by {who[6:]}), {op.replace('_', ' ')}: "
                f"median {med(runs[key], 'wall'):.2f}s = {med(runs[key], 'wall') / raw:.3f}x raw "
                f"(store today {sto / raw:.3f}x); cpu {med(runs[key], 'cpu'):.2f}s; runs {walls(runs[key])}."
            )
        fixed = results[case.name].get("fixed")
        if fixed:
            raw_save = med(runs["raw_save"], "wall")
            crc_secs = size_bytes / 2**30 / results.get("_crc_gib_s", 3.2)
            reqs = (
                f" ({fixed['requests']} requests: "
                + ", ".join(f"{k} {v}" for k, v in sorted(fixed["by_op"].items())) + ")"
                if "requests" in fixed else ""
            )
            lines.append(
                f"  Structural overhead of a store save: begin + one empty payload + commit "
                f"{fixed['secs']:.2f}s{reqs}, plus the CRC pass ~{crc_secs:.2f}s; on the raw median "
                f"{raw_save:.2f}s that predicts {(raw_save + fixed['secs'] + crc_secs) / raw_save:.3f}x."
            )
        for label in ("python-file save", "s3fs ranged load"):
            if label not in runs:
                continue
            values = runs[label]
            raw_op = "save" if "save" in label else "load"
            raw = med(runs[f"raw_{raw_op}"], "wall")
            lines.append(
                f"  Informational, {label}: median {med(values, 'wall'):.2f}s over {len(values)} run(s) "
                f"({med(values, 'wall') / raw:.2f}x raw {raw_op}; cpu {med(values, 'cpu'):.2f}s)."
            )
    return lines


# ================================================================================================
# 2. rss
# ================================================================================================
def run_rss(args, moto: MotoProcess | None, tmp_root: str) -> list[str]:
    backends = [b for b in args.backends if b in ("local", "s3")]
    large_mib = min(args.size_mib, 256)
    scenarios = [(backend, mode, args.size_mib, N_TENSORS) for backend in backends for mode in ("raw", "store")]
    if "s3" in backends and args.extras:
        # One big tensor (an embedding matrix): fsspec buffers a whole write() before uploading.
        scenarios += [("s3", mode, large_mib, 1) for mode in ("raw", "store", "proto-sliced")]
    rows = []
    for backend, mode, size_mib, n_tensors in scenarios:
        if backend == "local":
            root = os.path.join(tmp_root, f"rss-{mode}")
            options = {}
        else:
            bucket = f"bench-rss-{mode}-{n_tensors}"
            moto.new_bucket(bucket)
            root = f"s3://{bucket}/run"
            options = s3_speed_options(args, moto)
        log(f"rss/{backend}/{mode}/{n_tensors} tensors: fresh process")
        proc = subprocess.run(
            [
                sys.executable, "-m", "bench._rss_child",
                "--backend", backend, "--mode", mode, "--size-mib", str(size_mib),
                "--n-tensors", str(n_tensors), "--root", root, "--storage-options", json.dumps(options),
            ],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"rss child failed: {proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["n_tensors"] = n_tensors
        rows.append(row)
        if backend == "local":
            shutil.rmtree(root, ignore_errors=True)
        else:
            client = moto.boto3_client()
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    lines = [
        "Fresh process per row. *baseline*: RSS after imports and client set-up; *state*: RSS growth from "
        "building the state; *save peak over state*: VmHWM during the save minus RSS with the state "
        "built (VmHWM reset just before the save). Target: peak <= state size + "
        f"{RSS_HEADROOM_MIB} MiB beyond the process baseline, i.e. save peak over state <= {RSS_HEADROOM_MIB} MiB.",
        "",
        "| backend | state | mode | baseline MiB | state MiB | save peak MiB (abs) | save peak over state MiB | target | "
        "load peak over pre-load MiB (info) | save s | load s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = row["baseline_kib"] / 1024
        with_state = row["with_state_kib"] / 1024
        peak = row["save_peak_kib"] / 1024
        over = peak - with_state
        load_over = row["load_peak_kib"] / 1024 - row["before_load_kib"] / 1024
        verdict = "PASS" if over <= RSS_HEADROOM_MIB else "MISS"
        mark = "(baseline)" if row["mode"] == "raw" else (verdict if row["mode"] == "store" else f"{verdict} (prototype)")
        state_desc = f"{row['n_tensors']} x {row['state_bytes'] / row['n_tensors'] / MIB:.0f} MiB"
        lines.append(
            f"| {row['backend']} | {state_desc} | {row['mode']} | {base:.0f} | {with_state - base:.0f} | {peak:.0f} | "
            f"{over:.0f} | {mark} | {load_over:.0f} | {row['save_secs']:.2f} | {row['load_secs']:.2f} |"
        )
    if rows and not all(row["hwm_reset"] for row in rows):
        lines.append("")
        lines.append("Warning: VmHWM could not be reset; save peaks include the state build.")
    if any(row["mode"] == "proto-sliced" for row in rows):
        lines.append("")
        lines.append(
            "*proto-sliced*: the store with `torch.save` writes passed on in 8 MiB memoryview slices "
            "(bench/prototypes.py `SlicedWrites`), bounding s3fs's buffer at one block plus one slice."
        )
    return lines


# ================================================================================================
# 3. crc
# ================================================================================================
def crc_speed_gib_s(state) -> float:
    """GiB/s of opd_store's Crc32c over the state's tensors (median of 3)."""
    from opd_store.checksum import Crc32c

    views = tensor_views(state)

    def run() -> None:
        hasher = Crc32c()
        for view in views:
            hasher.update(view)

    run()
    secs = median([timed(run)[0] for _ in range(3)])
    return sum(v.nbytes for v in views) / 2**30 / secs


class _SpyWriter:
    def __init__(self) -> None:
        self.calls = 0
        self.memoryviews = 0
        self.contiguous = 0
        self.other_types: set[str] = set()
        self.nbytes = 0

    def write(self, data) -> int:
        self.calls += 1
        if isinstance(data, memoryview):
            self.memoryviews += 1
            self.contiguous += int(data.c_contiguous)
        else:
            self.other_types.add(type(data).__name__)
        n = memoryview(data).nbytes
        self.nbytes += n
        return n

    def flush(self) -> None:
        pass


def run_crc(args, state, speed_results: dict) -> list[str]:
    import torch
    from awscrt import checksums

    from opd_store.checksum import Crc32c

    views = tensor_views(state)
    nbytes = sum(v.nbytes for v in views)

    def raw_crc() -> int:
        value = 0
        for view in views:
            value = checksums.crc32c(view, value)
        return value

    def store_crc() -> str:
        hasher = Crc32c()
        for view in views:
            hasher.update(view)
        return hasher.hexdigest()

    def package_crc() -> int:
        fn = prototypes.crc_function("crc32c")
        value = 0
        for view in views:
            value = fn(view, value)
        return value

    raw_crc()
    raw_times = [timed(raw_crc)[0] for _ in range(max(3, args.repeats))]
    store_times = [timed(store_crc)[0] for _ in range(max(3, args.repeats))]
    crc_secs = median(raw_times)
    wrapper_secs = median(store_times)
    package_secs = None
    if prototypes.crc32c_package_available():
        if package_crc() != raw_crc():
            raise RuntimeError("the crc32c package and awscrt disagree")
        package_secs = median([timed(package_crc)[0] for _ in range(max(3, args.repeats))])

    spy = _SpyWriter()
    torch.save(state, spy)

    # torch.save's own zip CRC-32 per record (torch >= 2.5 can turn it off), for scale.
    zip_crc = None
    try:
        from torch.utils.serialization import config as ser_config
    except ImportError:
        ser_config = None
    if ser_config is not None and hasattr(ser_config.save, "compute_crc32"):
        previous = ser_config.save.compute_crc32

        def save_to_null() -> None:
            with open(os.devnull, "wb") as handle:
                torch.save(state, handle)

        try:
            timings = {}
            for flag in (True, False):
                ser_config.save.compute_crc32 = flag
                timings[flag] = median([timed(save_to_null)[0] for _ in range(3)])
        finally:
            ser_config.save.compute_crc32 = previous
        zip_crc = timings

    lines = [
        f"Implementation: awscrt {_version('awscrt')} `checksums.crc32c` (AWS Common Runtime; hardware "
        "SSE4.2/PCLMULQDQ or ARMv8 CRC instructions, GIL released); it takes any buffer-protocol object, "
        "so memoryviews of tensor storage are checksummed in place.",
        f"torch.save handed the writer {spy.calls} write calls: {spy.memoryviews} memoryviews "
        f"({spy.contiguous} C-contiguous, so `Crc32c.update` never copies)"
        + (f", other types {sorted(spy.other_types)}" if spy.other_types else ", no other types")
        + f"; {spy.nbytes / MIB:.1f} MiB in all.",
        "",
        "| measurement | seconds | GiB/s |",
        "|---|---|---|",
        f"| awscrt checksums.crc32c over {len(views)} tensor memoryviews ({nbytes / MIB:.0f} MiB) | {crc_secs:.3f} | {nbytes / 2**30 / crc_secs:.1f} |",
        f"| opd_store.checksum.Crc32c.update over the same | {wrapper_secs:.3f} | {nbytes / 2**30 / wrapper_secs:.1f} |",
    ]
    if package_secs is not None:
        lines.append(
            f"| (alternative) `crc32c` package {_version('crc32c')} over the same | "
            f"{package_secs:.3f} | {nbytes / 2**30 / package_secs:.1f} |"
        )
    if zip_crc is not None:
        lines.append(
            f"| (for scale) torch.save to /dev/null, zip CRC-32 on (default) / off "
            f"(`torch.utils.serialization.config.save.compute_crc32`) | {zip_crc[True]:.3f} / {zip_crc[False]:.3f} | "
            f"torch's own CRC-32: ~{nbytes / 2**30 / max(zip_crc[True] - zip_crc[False], 1e-9):.1f} |"
        )
    lines += [
        "",
        "| backend | store save median (s) | crc share of save (Crc32c.update) | target | share with the crc32c package (info) |",
        "|---|---|---|---|---|",
    ]
    for name, result in speed_results.items():
        if name.startswith("_"):
            continue
        save = median([m["wall"] for m in result["runs"]["store_save"]])
        pct = 100 * wrapper_secs / save
        alternative = f"{100 * package_secs / save:.1f} %" if package_secs is not None else "-"
        lines.append(
            f"| {name} | {save:.2f} | {pct:.1f} % | {'PASS' if pct < CRC_TARGET_PCT else 'MISS'} "
            f"(< {CRC_TARGET_PCT:.0f} %) | {alternative} |"
        )
    if not speed_results:
        lines.append("| (speed section not run) | | | | |")
    lines.append("")
    lines.append(
        "The same CRC pass also runs on every verified read (`store.read`/`store.open` checksum the "
        "whole payload), where its share of a warm local load is far larger than of a save."
    )
    return lines


# ================================================================================================
# 4. requests
# ================================================================================================
class FixtureWriter:
    """Writes committed steps (10 objects + a valid manifest) and leftovers straight into moto."""

    OBJECTS_PER_STEP = 10

    def __init__(self, moto: MotoProcess, bucket: str, prefix: str, workers: int = 16) -> None:
        self.client = moto.boto3_client(max_pool_connections=workers)
        self.bucket = bucket
        self.prefix = prefix
        self.pool = concurrent.futures.ThreadPoolExecutor(workers)
        self.leftover_objects = 0

    @staticmethod
    def attempt_id() -> str:
        from opd_store.layout import new_attempt_id

        return new_attempt_id()

    def _put_many(self, items: list[tuple[str, bytes]]) -> None:
        futures = [self.pool.submit(self.client.put_object, Bucket=self.bucket, Key=key, Body=body) for key, body in items]
        for future in futures:
            future.result()

    def committed_step_objects(self, step: int) -> list[tuple[str, bytes]]:
        from opd_store.checksum import crc32c_hex
        from opd_store.layout import step_dirname
        from opd_store.manifest import Manifest, PayloadEntry, Writer

        attempt = self.attempt_id()
        sdir = f"{self.prefix}/{step_dirname(step)}"
        items = []
        entries = []
        for i in range(self.OBJECTS_PER_STEP):
            name = f"rank-{i:02d}/shard.pt"
            body = secrets.token_bytes(64 + i)
            items.append((f"{sdir}/{attempt}/{name}", body))
            entries.append(PayloadEntry(name=name, path=f"{attempt}/{name}", size_bytes=len(body), crc32c=crc32c_hex(body)))
        manifest = Manifest(
            step=step,
            attempt_id=attempt,
            writer=Writer(host="bench", pid=1, rank=0),
            created_at=_dt.datetime.now(_dt.timezone.utc),
            world_size=self.OBJECTS_PER_STEP,
            payloads=tuple(entries),
            metadata={"fixture": True},
        )
        items.append((f"{sdir}/manifest.json", manifest.to_json_bytes()))
        return items

    def failed_attempt_objects(self, step: int, n_objects: int = 3) -> list[tuple[str, bytes]]:
        from opd_store.layout import step_dirname

        attempt = self.attempt_id()
        sdir = f"{self.prefix}/{step_dirname(step)}"
        self.leftover_objects += n_objects
        return [(f"{sdir}/{attempt}/rank-{i:02d}/shard.pt", secrets.token_bytes(32)) for i in range(n_objects)]

    def write_steps(self, steps: list[int]) -> None:
        items: list[tuple[str, bytes]] = []
        for step in steps:
            items.extend(self.committed_step_objects(step))
        for start in range(0, len(items), 2000):
            self._put_many(items[start : start + 2000])

    def write_leftovers(self, steps: list[int]) -> None:
        items: list[tuple[str, bytes]] = []
        for step in steps:
            items.extend(self.failed_attempt_objects(step))
        self._put_many(items)

    def delete_prefix(self, rel: str) -> None:
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/{rel}"):
            keys.extend({"Key": o["Key"]} for o in page.get("Contents", []))
        if keys:
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

    def close(self) -> None:
        self.pool.shutdown()


def _count(moto: MotoProcess, counter: S3RequestCounter, fn: Callable[[], Any]) -> dict[str, Any]:
    moto.reset_requests()
    counter.reset()
    secs, value = timed(fn)
    server = moto.requests()
    return {
        "client": counter.total,
        "client_by_op": dict(counter.by_op),
        "server": server["total"],
        "server_by_kind": server["by_kind"],
        "secs": secs,
        "value": value,
    }


def run_requests(args, moto: MotoProcess) -> list[str]:
    from opd_store import CheckpointStore
    from opd_store.layout import step_dirname

    bucket = "bench-requests"
    moto.new_bucket(bucket)
    prefix = "runs/demo"
    writer = FixtureWriter(moto, bucket, prefix)
    # Steps are 10, 20, 30, ... (step 0 is skipped: trainers rarely save it).
    targets = sorted(args.steps)
    written = 0
    rows = []
    try:
        for n_steps in targets:
            new = [10 * (k + 1) for k in range(written, n_steps)]
            log(f"requests: writing {len(new)} committed steps ({len(new) * 11} objects) into moto")
            started = time.perf_counter()
            writer.write_steps(new)
            # Leftovers: a killed save (an uncommitted step prefix) between committed steps, and a
            # failed attempt beside the committed one inside a committed step -- including the newest.
            lo = 10 * (written + 1)
            hi = 10 * n_steps
            uncommitted = sorted({lo + 5, (lo + hi) // 2 // 10 * 10 + 5, hi - 5})
            uncommitted = [s for s in uncommitted if s < hi]
            failed_in_committed = sorted({lo, hi})
            writer.write_leftovers(uncommitted + failed_in_committed)
            log(f"requests: fixtures for {n_steps} steps written in {time.perf_counter() - started:.1f}s")
            written = n_steps
            newest = 10 * n_steps

            store = CheckpointStore(f"s3://{bucket}/{prefix}", storage_options=moto.storage_options())
            counter = S3RequestCounter()
            counter.attach(store.storage.fs)
            row: dict[str, Any] = {"steps": n_steps, "objects": n_steps * 11 + writer.leftover_objects,
                                   "leftover_objects": writer.leftover_objects}
            row["latest_step"] = _count(moto, counter, store.latest_step)
            assert row["latest_step"]["value"] == newest, row["latest_step"]["value"]
            row["steps_call"] = _count(moto, counter, store.steps)
            assert len(row["steps_call"]["value"]) == n_steps
            row["is_complete"] = _count(moto, counter, lambda: store.is_complete(newest))
            if args.checkpoints_info:
                row["checkpoints"] = _count(moto, counter, store.checkpoints)
            # Prototypes (bench/prototypes.py) on a second store instance.
            proto = CheckpointStore(f"s3://{bucket}/{prefix}", storage_options=moto.storage_options())
            proto_counter = S3RequestCounter()
            proto_counter.attach(proto.storage.fs)
            prototypes.patch_one_get_reads(proto)
            row["proto_latest"] = _count(moto, proto_counter, proto.latest_step)
            assert row["proto_latest"]["value"] == newest
            if args.checkpoints_info:
                row["proto_checkpoints"] = _count(moto, proto_counter, proto.checkpoints)
            # Informational: a killed save of a newer step sits above the newest complete one.
            killed = newest + 5
            writer.write_leftovers([killed])
            row["latest_behind_killed"] = _count(moto, counter, store.latest_step)
            assert row["latest_behind_killed"]["value"] == newest
            row["proto_behind_killed"] = _count(moto, proto_counter, proto.latest_step)
            row["proto2_behind_killed"] = _count(moto, proto_counter, lambda: prototypes.latest_step_one_listing(proto))
            assert row["proto2_behind_killed"]["value"] == newest
            writer.delete_prefix(step_dirname(killed))
            writer.leftover_objects -= 3
            rows.append(row)
    finally:
        writer.close()

    def cell(res: dict, extra: str = "") -> str:
        flag = "" if res["client"] == res["server"] else f" (server saw {res['server']})"
        return f"{res['client']}{flag}{extra}"

    def ops(res: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(res["client_by_op"].items()))

    lines = [
        "Fixtures written straight into moto with boto3 (16 threads); manifests built with "
        "`opd_store.manifest.Manifest`. Each committed step: 10 payload objects + manifest.json. "
        "Leftovers: uncommitted step prefixes (3 objects of a killed save) between committed steps, "
        "and a failed attempt (3 objects) beside the committed one in the oldest and newest step of each batch. "
        "Requests counted by a botocore `before-send.s3` handler on the store's own s3fs client "
        "(every HTTP attempt, retries included) and cross-checked at the moto server.",
        "",
        "| committed steps | objects in store | latest_step() requests | target | steps() requests | "
        "is_complete(newest) | checkpoints() (info) | latest_step() behind a killed newer save (info) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        latest = row["latest_step"]
        target = ""
        if row["steps"] >= 1000:
            target = "PASS" if latest["client"] <= LATEST_TARGET_REQUESTS else "MISS"
            target += f" (<= {LATEST_TARGET_REQUESTS})"
        per_step = row["steps_call"]["client"] / row["steps"]
        chk = cell(row["checkpoints"]) if "checkpoints" in row else "not run"
        lines.append(
            f"| {row['steps']} | {row['objects']} | {cell(latest)} ({latest['secs']:.2f}s) | {target or '-'} | "
            f"{cell(row['steps_call'])} ({row['steps_call']['secs']:.2f}s; {per_step:.3f}/step) | "
            f"{cell(row['is_complete'])} | {chk} | {cell(row['latest_behind_killed'])} |"
        )
    lines.append("")
    last = rows[-1]
    lines.append(f"Breakdown at {last['steps']} steps:")
    lines.append(f"- latest_step(): {ops(last['latest_step'])}")
    lines.append(f"- steps(): {ops(last['steps_call'])} (pagination: {last['objects']} objects / 1000 per page)")
    lines.append(f"- is_complete(newest): {ops(last['is_complete'])}")
    if "checkpoints" in last:
        lines.append(f"- checkpoints(): {ops(last['checkpoints'])}")
    lines.append(f"- latest_step() behind a killed newer save: {ops(last['latest_behind_killed'])}")
    lines.append("")
    lines.append(
        "Prototypes (bench/prototypes.py), same fixtures: (a) `read_bytes` of the manifest with one GET "
        "(`cat_file(path, max_concurrency=1)`: no s3fs size-probe HEAD; opd_store has since adopted this "
        "as `read_bytes(rel, small=True)`, so today = (a) on current code); (b) (a) plus `latest_step` "
        "deciding each candidate from one listing of its step prefix."
    )
    lines.append("")
    lines.append("| committed steps | latest_step() today / (a) | checkpoints() today / (a) | behind a killed save: today / (a) / (b) |")
    lines.append("|---|---|---|---|")
    for row in rows:
        chk = (
            f"{cell(row['checkpoints'])} / {cell(row['proto_checkpoints'])}" if "checkpoints" in row else "not run"
        )
        lines.append(
            f"| {row['steps']} | {cell(row['latest_step'])} / {cell(row['proto_latest'])} | {chk} | "
            f"{cell(row['latest_behind_killed'])} / {cell(row['proto_behind_killed'])} / {cell(row['proto2_behind_killed'])} |"
        )
    lines.append("")
    lines.append(f"- (a) latest_step() at {last['steps']} steps: {ops(last['proto_latest'])}")
    lines.append(f"- (b) behind a killed save at {last['steps']} steps: {ops(last['proto2_behind_killed'])}")
    steps_ok = all(r["steps_call"]["client"] <= r["objects"] / 1000 + 3 for r in rows)
    lines.append("")
    lines.append(
        f"steps() target (no per-step request): {'PASS' if steps_ok else 'MISS'} -- requests grow with "
        "listing pages (1 per 1,000 objects), not with steps."
    )
    return lines


# ================================================================================================
# main
# ================================================================================================
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="total state size (default 1024)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default="speed,rss,crc,requests")
    parser.add_argument("--backends", default="local,s3")
    parser.add_argument("--steps", default="10,100,1000", help="committed step counts for the requests section")
    parser.add_argument("--tmp-dir", default=tempfile.gettempdir(), help="where the local store and files go")
    parser.add_argument("--no-extras", dest="extras", action="store_false",
                        help="skip informational rows and prototypes (python-file save, s3fs ranged "
                             "load, verified local open, single-tensor RSS)")
    parser.add_argument("--no-checkpoints-info", dest="checkpoints_info", action="store_false",
                        help="skip counting checkpoints() requests (one manifest read per step)")
    parser.add_argument("--s3-max-concurrency", type=int, default=1,
                        help="s3fs max_concurrency for the speed and rss runs, raw and store alike "
                             "(default 1: one GET per object; 0 keeps s3fs's default of 10)")
    parser.add_argument("--ranged-load", action=argparse.BooleanOptionalAction, default=None,
                        help="also time torch.load on an s3fs file (readahead); default only at <= 256 MiB")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.backends = [s.strip() for s in args.backends.split(",") if s.strip()]
    args.steps = [int(s) for s in args.steps.split(",") if s.strip()]
    if args.ranged_load is None:
        args.ranged_load = args.extras and args.size_mib <= 256

    need_bytes = 3 * args.size_mib * MIB + 2 * 2**30
    free = shutil.disk_usage(args.tmp_dir).free
    if free < need_bytes:
        print(f"not enough free disk in {args.tmp_dir}: {free / 2**30:.1f} GiB free, need {need_bytes / 2**30:.1f}",
              file=sys.stderr)
        return 2
    tmp_root = tempfile.mkdtemp(prefix="opd-bench-", dir=args.tmp_dir)
    started = now_stamp()
    machine = machine_description(args.tmp_dir)
    out: list[str] = [f"# opd_store core benchmark, {started}", ""]
    out.append(f"Command: `{' '.join([Path(sys.executable).name, '-m', 'bench.core'] + (argv if argv is not None else sys.argv[1:]))}`")
    out.append("")
    out.append("## Machine")
    out.append("")
    out.append("| | |")
    out.append("|---|---|")
    out.extend(f"| {k} | {v} |" for k, v in machine)
    out.append("")
    out.append("Shared and noisy machine: compare ratios measured in this run, not absolute numbers across runs. "
               "moto runs in its own process (its CPU time competes with the client for the 2 cores; same for raw and store).")
    out.append("")

    moto = None
    need_moto = ("s3" in args.backends and any(s in args.sections for s in ("speed", "rss"))) or "requests" in args.sections
    try:
        if need_moto:
            moto = MotoProcess()
            log(f"moto server pid {moto.pid} at {moto.endpoint_url}")
        state = None
        speed_results: dict = {}
        if "speed" in args.sections or "crc" in args.sections:
            log(f"building the state: {N_TENSORS} tensors, {args.size_mib} MiB")
            state = make_state(args.size_mib)
        def section(title: str, fn: Callable[[], list[str]]) -> None:
            out.extend([title, ""])
            try:
                out.extend(fn())
            except Exception as exc:  # noqa: BLE001 - report and go on with the next section
                import traceback

                log(f"{title}: FAILED\n{traceback.format_exc()}")
                out.append(f"**Section failed**: `{exc!r}`"[:2000])
            out.append("")

        if "speed" in args.sections:
            cases = []
            if "local" in args.backends:
                cases.append(LocalCase(os.path.join(tmp_root, "speed")))
            if "s3" in args.backends:
                moto.new_bucket("bench-speed")
                cases.append(S3Case(moto, "bench-speed", s3_speed_options(args, moto)))
            section("## 1. Save and load: store vs raw", lambda: run_speed(args, state, cases, speed_results))
        if "rss" in args.sections:
            section("## 2. Peak RSS of one save (fresh process)", lambda: run_rss(args, moto, tmp_root))
        if "crc" in args.sections:
            section("## 3. Checksum cost", lambda: run_crc(args, state, speed_results))
        del state
        gc.collect()
        if "requests" in args.sections:
            section("## 4. Backend requests on moto", lambda: run_requests(args, moto))
        out.append(f"Finished {now_stamp()}; load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(tmp_root, ignore_errors=True)

    text = "\n".join(out) + "\n"
    print(text)
    if not args.no_write:
        os.makedirs(args.out_dir, exist_ok=True)
        suffix = "" if args.size_mib == 1024 else f"-{args.size_mib}mib"
        if set(args.sections) != {"speed", "rss", "crc", "requests"}:
            suffix += "-" + "-".join(args.sections)
        path = Path(args.out_dir) / f"core-{time.strftime('%Y-%m-%d')}{suffix}.md"
        path.write_text(text)
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
