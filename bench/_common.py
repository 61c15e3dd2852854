"""Helpers shared by the benchmarks: the moto process, the state, RSS readings, the machine."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

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


# -- statistics ----------------------------------------------------------------------------------
def median(values: list[float]) -> float:
    return statistics.median(values)


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


def process_cpu_secs(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of a process (this one by default)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drop_file_cache(path: str) -> None:
    """Ask the kernel to drop ``path``'s pages from the page cache (clean pages only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_file_cache(path: str) -> None:
    """Read ``path`` once so its pages are in the page cache."""
    buffer = bytearray(16 * MIB)
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass


# -- moto in its own process ---------------------------------------------------------------------
class MotoProcess:
    """``python -m bench._moto_server`` on 127.0.0.1, port chosen by the OS, with a request counter."""

    def __init__(self, key_buffer_bytes: int | None = 4 * 2**30) -> None:
        self._log = open(os.devnull, "wb")  # noqa: SIM115
        env = dict(os.environ)
        if key_buffer_bytes:
            # moto keeps each object in a SpooledTemporaryFile that spills to disk above ~5 MiB by
            # default; the benchmark keeps objects in memory so disk noise stays out of the s3 runs.
            env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(key_buffer_bytes)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench._moto_server"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        line = self.process.stdout.readline()
        if not line.startswith("PORT "):
            self.process.kill()
            raise RuntimeError(f"moto server did not start: {line!r}")
        self.endpoint_url = f"http://127.0.0.1:{int(line.split()[1])}"
        self.pid = self.process.pid

    def _post(self, path: str) -> bytes:
        request = urllib.request.Request(f"{self.endpoint_url}{path}", method="POST", data=b"")
        return urllib.request.urlopen(request, timeout=120).read()

    def reset(self) -> None:
        self._post("/moto-api/reset")

    def requests(self) -> dict[str, Any]:
        return json.loads(urllib.request.urlopen(f"{self.endpoint_url}/__bench__/requests", timeout=30).read())

    def reset_requests(self) -> None:
        self._post("/__bench__/requests/reset")

    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint_url,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
            # moto completes a 1 GiB multipart upload slowly on a busy 2-core machine; botocore's
            # default 60 s read timeout then retries a completion moto already consumed (500).
            "config_kwargs": {"read_timeout": 1800, "connect_timeout": 60},
        }

    def cpu_secs(self) -> float:
        """CPU seconds (user + system) the moto process has used so far."""
        return process_cpu_secs(self.pid)

    def boto3_client(self, max_pool_connections: int = 10):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
            config=Config(max_pool_connections=max_pool_connections),
        )

    def new_bucket(self, bucket: str) -> None:
        self.boto3_client().create_bucket(Bucket=bucket)

    def rss_mib(self) -> float | None:
        try:
            with open(f"/proc/{self.pid}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


class S3RequestCounter:
    """Counts requests a botocore client sends (``before-send.s3``: once per HTTP attempt, retries included)."""

    def __init__(self) -> None:
        self.total = 0
        self.by_op: dict[str, int] = {}

    def __call__(self, request=None, **kwargs) -> None:  # noqa: ANN001 - botocore event signature
        self.total += 1
        name = kwargs.get("event_name", "")
        op = getattr(request, "context", {}).get("operation_name") if request is not None else None
        op = op or name.rpartition(".")[2]
        self.by_op[op] = self.by_op.get(op, 0) + 1

    def reset(self) -> None:
        self.total = 0
        self.by_op = {}

    def attach(self, fs) -> None:
        """Register on an s3fs filesystem's (aio)botocore client, creating the client first."""
        fs.connect()
        fs.s3.meta.events.register("before-send.s3", self)


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
