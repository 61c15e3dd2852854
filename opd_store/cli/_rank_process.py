"""What every rank process of ``opd-store train --nproc N`` does before it trains.

A rank is a child of the launcher (``--start-method spawn`` or ``fork``). What a rank must not do:

* **Outlive the launcher.** A launcher killed with SIGKILL (an operator's ``kill -9``, an OOM
  kill, a container runtime stopping the job's first process) runs no handler, so it cannot stop
  its ranks; they would go on training and committing steps into the store while the rerun of the
  job starts its own ranks there, and one of the two runs' commits then fails with
  ``CommitConflictError``. :func:`tie_to_launcher` makes the kernel kill the rank when the
  launcher dies. torch's launcher asks for ``SIGINT`` (``torch.multiprocessing.spawn``), which is
  not enough: a job started in the background by a shell (``opd-store train ... &``) ignores
  SIGINT, its ranks inherit that, and a rank raises ``KeyboardInterrupt`` only between bytecodes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

from ._common import EXIT_RANK_LOST

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_SECS = 0.5  # the parent-pid watch's period where prctl(2) is not available


def tie_to_launcher(launcher_pid: int, rank: int) -> None:
    """Make this process die when the launcher ``launcher_pid`` does.

    On Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel sends SIGKILL to this process when
    the thread that forked it exits (prctl(2); the launcher forks its ranks from its main thread,
    which lives as long as the launcher). A launcher that died between the fork and the prctl call
    sends no signal (this process was already re-parented), so the parent pid is checked right
    after: when it is no longer the launcher, the rank exits at once. Elsewhere, or when prctl
    fails, a daemon thread checks the parent pid every :data:`PARENT_POLL_SECS` seconds.

    Args:
        launcher_pid (int): the pid of the process that started this rank.
        rank (int): this rank, named in the message of a rank that finds its launcher gone.

    Exits the process (``os._exit``, code :data:`~opd_store.cli._common.EXIT_RANK_LOST`) when the
    launcher is already gone; nothing of this rank is committed then.
    """
    tied = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        tied = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != launcher_pid:
        _launcher_gone(launcher_pid, rank)
    if not tied:
        threading.Thread(target=_watch_parent, args=(launcher_pid, rank), name="opd-store-launcher-watch",
                         daemon=True).start()


def _watch_parent(launcher_pid: int, rank: int) -> None:
    while os.getppid() == launcher_pid:
        threading.Event().wait(PARENT_POLL_SECS)
    _launcher_gone(launcher_pid, rank)


def _launcher_gone(launcher_pid: int, rank: int) -> None:
    print(f"opd-store train: rank {rank}: the launcher (pid {launcher_pid}) is gone; this rank stops and commits "
          "nothing", file=sys.stderr, flush=True)
    os._exit(EXIT_RANK_LOST)


__all__ = ["PARENT_POLL_SECS", "tie_to_launcher"]
