"""A "fresh machine" for a process start, a process's CPU time, torch's thread count for a block,
a bounded poll for processes to end, and the end of a server process.

The demo, the soak and the spot tests must prove that only the store carries state between
starts: each start gets ``machine-XXXX/`` with empty ``home/``, ``tmp/`` and ``work/``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# Set for every start: no model is downloaded (models are built from configs) and transformers'
# warnings would interleave with the job's events.
MACHINE_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def fresh_machine(base: str | os.PathLike, extra_env: dict[str, str] | None = None, *,
                  pythonpath: list[str] | None = None) -> tuple[dict[str, str], Path]:
    """Create a fresh machine under ``base``; return ``(environment, working directory)``.

    The environment is this process's without ``HF_*``, ``TRANSFORMERS_*`` and ``PYTEST_*``, plus
    ``extra_env`` (credentials, emulator switches), :data:`MACHINE_ENV` (offline, unbuffered), the new
    ``HOME``/``TMPDIR`` and ``pythonpath`` first on ``PYTHONPATH``.
    """
    machine = Path(tempfile.mkdtemp(prefix="machine-", dir=base))
    for sub in ("home", "tmp", "work"):
        (machine / sub).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "PYTEST_"))}
    env.update(extra_env or {})
    env.update(MACHINE_ENV, HOME=str(machine / "home"), TMPDIR=str(machine / "tmp"))
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env, machine / "work"


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(count)``; the previous count is restored after."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def process_cpu_secs(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) a process has used: this one by default, else
    ``pid``'s from ``/proc/PID/stat`` (Linux)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie counts as gone on Linux, read from
    ``/proc/PID/stat``; elsewhere as running).
    """
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def wait_until_gone(pids: list[int], timeout_secs: float, poll_secs: float = 0.05) -> list[int]:
    """Poll until none of ``pids`` runs (:func:`process_running`) or ``timeout_secs`` passed;
    returns the pids still running (empty once all are gone)."""
    deadline = time.monotonic() + timeout_secs
    while True:
        running = [pid for pid in pids if process_running(pid)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(poll_secs)


def end_process(process: subprocess.Popen, timeout_secs: float) -> None:
    """Terminate ``process`` (SIGTERM), wait up to ``timeout_secs``, then kill it and reap it."""
    process.terminate()
    try:
        process.wait(timeout=timeout_secs)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


__all__ = ["MACHINE_ENV", "end_process", "fresh_machine", "process_cpu_secs", "process_running", "torch_threads",
           "wait_until_gone"]
