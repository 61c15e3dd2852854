"""Local write throughput by ``write(2)`` size: why local payloads are written 512 KiB at a time.

    .venv/bin/python -m bench.write_size [--size-mib 1024] [--repeats 3] [--sizes-kib 128,256,512,1024,2048,8192]

The same bytes (a state of 64 float32 tensors, 8 MiB per tensor at 1 GiB) are written to a new
local file, then fsynced, with every ``write(2)`` call at most ``S`` KiB (zero-copy memoryview
slices), for each ``S``; each (size, run) runs in a process forked from this one, and the order of the sizes rotates between runs. Printed side by side: median wall
seconds of the writes, of the fsync, CPU seconds, MiB/s, and the ratio to the fastest size. Written
to ``bench/results/write-size-<date>.md`` with the kernel version.

Found while benchmarking the store against raw writes on this project's VMs (Linux 6.18, virtio-balloon free page
reporting on, see the machine line): whole-tensor writes (8 MiB, as ``torch.save`` hands its file)
cost 15-20x the CPU of the same bytes in 512 KiB writes, in the kernel (CPU time, no I/O wait).
Large writes make the page cache allocate large folios, which come from the high-order free blocks
that the guest has reported to the host and that fault back in on first touch. ``opd_store``'s
local backend (``LocalStorage.write_slice_bytes``) slices writes to 512 KiB.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench._common import REPO_ROOT, free_page_reporting, make_state, median, run_forked, tensor_views


def _cpu_secs() -> float:
    times = os.times()
    return times.user + times.system


def measure(size_mib: int, slice_kib: int, directory: str) -> dict:
    """One fresh-process measurement: build the state, write it in ``slice_kib`` pieces, fsync."""
    views = tensor_views(make_state(size_mib))
    step = slice_kib * 1024
    path = os.path.join(directory, f"write-{slice_kib}.bin")
    cpu0 = _cpu_secs()
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for view in views:
            for offset in range(0, view.nbytes, step):
                os.write(fd, view[offset : offset + step])
        written = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    synced = time.perf_counter()
    cpu = _cpu_secs() - cpu0
    os.unlink(path)
    return {"slice_kib": slice_kib, "write": written - started, "fsync": synced - written, "cpu": cpu}


def _in_child(size_mib: int, slice_kib: int, directory: str) -> dict:
    row = run_forked(measure, size_mib, slice_kib, directory)
    if "error" in row:
        raise RuntimeError(f"{slice_kib} KiB: {row['error']}")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes-kib", default="128,256,512,1024,2048,8192")
    parser.add_argument("--dir", default=None, help="directory to write in (default: a temp dir)")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    slices = [int(x) for x in args.sizes_kib.split(",") if x]
    import torch  # noqa: F401 - imported once here, before the forks

    rows: dict[int, list[dict]] = {s: [] for s in slices}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for rep in range(args.repeats):
            order = slices[rep % len(slices):] + slices[: rep % len(slices)]
            for slice_kib in order:
                row = _in_child(args.size_mib, slice_kib, directory)
                rows[slice_kib].append(row)
                print(f"run {rep}: {slice_kib:6d} KiB writes {row['write']:6.2f}s fsync {row['fsync']:5.2f}s "
                      f"cpu {row['cpu']:6.2f}s", file=sys.stderr, flush=True)
    best = min(median([r["write"] for r in rows[s]]) for s in slices)
    lines = [
        f"# Local write throughput by write(2) size, {args.size_mib} MiB, {args.repeats} runs "
        f"({_dt.datetime.now(_dt.timezone.utc):%Y-%m-%dT%H:%M:%SZ})",
        "",
        f"Command: `python -m bench.write_size --size-mib {args.size_mib} --repeats {args.repeats} "
        f"--sizes-kib {args.sizes_kib}`; kernel {platform.release()}, {os.cpu_count()} CPUs, "
        f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"free page reporting: {free_page_reporting() or 'not present'}.",
        "",
        "| write(2) size KiB | writes s (median) | fsync s (median) | CPU s (median) | MiB/s (writes) | x fastest | runs (writes s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for slice_kib in slices:
        writes = median([r["write"] for r in rows[slice_kib]])
        lines.append(
            f"| {slice_kib} | {writes:.2f} | {median([r['fsync'] for r in rows[slice_kib]]):.2f} | "
            f"{median([r['cpu'] for r in rows[slice_kib]]):.2f} | {args.size_mib / writes:.0f} | {writes / best:.2f}x | "
            + ", ".join(f"{r['write']:.2f}" for r in rows[slice_kib]) + " |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"write-size-{_dt.date.today():%Y-%m-%d}.md"
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
