"""Helpers shared by the benchmarks: the state, timing, RSS readings, the machine. moto's server
process, request counters and fresh machines come from :mod:`opd_testkit`."""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from opd_testkit.stores import use_emulator_environment

use_emulator_environment()

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
N_TENSORS = 64


# -- state ---------------------------------------------------------------------------------------
def make_state(size_mib: int, n_tensors: int = N_TENSORS, seed: int = 0) -> dict:
    """``n_tensors`` float32 tensors of random values totalling ``size_mib`` MiB."""
    import torch

    numel = size_mib * MIB // n_tensors // 4
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i:02d}.weight": torch.rand(numel, generator=gen) for i in range(n_tensors)}


def state_nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def tensor_views(state: dict) -> list[memoryview]:
    """Byte memoryviews of every tensor's storage (no copies)."""
    return [memoryview(t.numpy()).cast("B") for t in state.values()]


# -- statistics and timing -----------------------------------------------------------------------
def median(values: list[float]) -> float:
    return statistics.median(values)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(wall seconds, result)`` of ``fn()``, after a garbage collection."""
    gc.collect()
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


# -- memory of this process ----------------------------------------------------------------------
def proc_status_kib(field: str) -> int | None:
    """A ``Vm*`` field of /proc/self/status in KiB (``VmRSS``, ``VmHWM``), or None."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def drop_file_cache(path: str) -> None:
    """Ask the kernel to drop ``path``'s pages from the page cache (clean pages only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- machine -------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001
        return "not installed"


def machine_description(tmp_dir: str | None = None) -> list[tuple[str, str]]:
    rows = [
        ("host", platform.node()),
        ("cpus (nproc / affinity)", f"{os.cpu_count()} / {len(os.sched_getaffinity(0))}"),
        ("cpu model", _cpu_model()),
        ("cpu has sse4_2", str("sse4_2" in Path("/proc/cpuinfo").read_text())),
        ("ram", f"{_mem_total_gib():.1f} GiB"),
        ("load average (1/5/15 min) at start", " ".join(f"{x:.2f}" for x in os.getloadavg())),
        ("kernel", platform.release()),
        ("python", sys.version.split()[0]),
        ("torch", _version("torch")),
        ("fsspec", _version("fsspec")),
        ("s3fs", _version("s3fs")),
        ("aiobotocore / botocore", f"{_version('aiobotocore')} / {_version('botocore')}"),
        ("moto", _version("moto")),
        ("awscrt (opd_store's CRC32C) / crc32c package (compared)", f"{_version('awscrt')} / {_version('crc32c')}"),
        ("opd_store", _version("opd_store")),
    ]
    reporting = free_page_reporting()
    if reporting:
        rows.append(("free page reporting (virtio-balloon)", reporting))
    if tmp_dir:
        usage = shutil.disk_usage(tmp_dir)
        rows.append(("local temp dir / free", f"{tmp_dir} / {usage.free / 2**30:.0f} GiB"))
    return rows


def free_page_reporting() -> str | None:
    """The guest's free page reporting settings, when the kernel has them (a VM), else None.

    With reporting on, memory a process frees is handed back to the hypervisor; touching such
    memory again faults it back in on the host, which this project's VMs charge at roughly
    10-20 s of guest CPU per GiB, to whichever operation touches it first (a save's page cache, a
    load's fresh tensors). Benchmark phases that allocate fresh memory carry that noise.
    """
    params = Path("/sys/module/page_reporting/parameters")
    if not params.is_dir():
        return None
    values = {}
    for name in ("page_reporting_order", "min_free_ms", "reported_kib"):
        try:
            values[name] = (params / name).read_text().strip()
        except OSError:
            values[name] = "?"
    reported = values["reported_kib"]
    reported_gib = f"{int(reported) / 2**20:.0f} GiB" if reported.isdigit() else reported
    return (f"on: page_reporting_order {values['page_reporting_order']}, min_free_ms {values['min_free_ms']}, "
            f"{reported_gib} reported to the host since boot")


def now_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_forked(fn, *args) -> dict:
    """``fn(*args)`` (which returns a JSON-able dict) in a process forked from this one.

    A fork, not a new interpreter: on the loaded shared machine a fresh ``import torch`` took over a
    minute. The caller must not have started threads or run torch operators before forking. The
    child is SIGTERMed if this process exits (Linux ``PR_SET_PDEATHSIG``). An exception in the child
    comes back as ``{"error": traceback}``; a child that dies without a report as
    ``{"error": "the child died without a report"}``.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        _die_with_parent()
        code = 0
        try:
            payload = json.dumps(fn(*args)).encode()
        except BaseException:  # noqa: BLE001 - reported to the parent
            import traceback

            payload = json.dumps({"error": traceback.format_exc()}).encode()
            code = 1
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(payload)
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data or b'{"error": "the child died without a report"}')


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent exits (no orphaned measurements)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
