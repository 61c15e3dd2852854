"""``opd-store train --nproc 2`` whose launcher is SIGKILLed: its ranks die with it.

A launcher killed with SIGKILL runs no handler. Its ranks must not go on training and committing
beside the rerun of the job (whose commits would then conflict with theirs): the kernel kills each
rank when the launcher dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, :mod:`opd_store.cli._rank_process`).
torch's own launcher asks for SIGINT instead, which a rank ignores when the job was started in the
background by a shell (``opd-store train ... &`` ignores SIGINT, and children inherit that), so the
launcher here runs with SIGINT ignored, as such a job does.

Both ways ranks start are covered: forked (``--shard --start-method fork``) and spawned (the
replicated job run with no ``--start-method``: the default, spawn, whose fresh interpreters no
other test of ``train --nproc`` pays for). The launcher is a child of the preloaded fork server; the test waits for
the first committed step, SIGKILLs the launcher, then polls the ranks' pids (from the job's
``started`` event) with a bounded wait, and checks that the store did not change after the kill
and that the ranks printed nothing (no client library's warnings without ``-v``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from opd_testkit import forkserver

from opd_store import CheckpointStore
from opd_store.job._machines import wait_until_gone

DEADLINE_SECS = 300
RANKS_GONE_SECS = 20  # the kernel signals them as the launcher exits: far less in practice
pytestmark = pytest.mark.timeout(2 * DEADLINE_SECS)
# `python -m opd_store` started as a shell starts a background job: SIGINT ignored.
BACKGROUND_JOB = ("import runpy, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  "runpy.run_module('opd_store', run_name='__main__', alter_sys=True)")


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


@pytest.mark.parametrize("start", [("--shard", "--start-method", "fork"), ()],
                         ids=["shard-fork", "replicated-spawn"])
def test_sigkilled_launcher_takes_its_ranks_with_it(tmp_path, start):
    store_dir, events, output = tmp_path / "store", tmp_path / "events", tmp_path / "output"
    cmd = [sys.executable, "-c", BACKGROUND_JOB, "train", "--store", str(store_dir), "--updates", "1000",
           "--checkpoint-every", "1", "--nproc", "2", *start, "--log", str(tmp_path / "log"),
           "--events", str(events)]
    with open(output, "w") as out:
        launcher = forkserver.popen(cmd, stdout=out, stderr=out)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + DEADLINE_SECS
        while not any(e["event"] == "saved" for e in _events(events)):  # the ranks train and commit
            if launcher.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no step was committed; output:\n{output.read_text()[-4000:]}")
            time.sleep(0.05)
        pids = next(e["pids"] for e in _events(events) if e["event"] == "started")
        assert len(pids) == 2 and launcher.pid not in pids

        launcher.kill()
        assert launcher.wait(timeout=DEADLINE_SECS) == -9
        committed_at_kill = CheckpointStore(store_dir).steps()
        assert committed_at_kill and committed_at_kill[-1] < 1000

        running = wait_until_gone(pids, RANKS_GONE_SECS)
        assert running == [], f"ranks {running} outlived their SIGKILLed launcher"
        assert CheckpointStore(store_dir).steps() == committed_at_kill  # nothing committed after the kill
        # The ranks are as quiet as one process: client libraries' warnings (transformers'
        # FutureWarnings in a spawned rank, a fresh interpreter) only with -v; the launcher died
        # before its summary line.
        assert output.read_text() == ""
    finally:
        launcher.kill()
        for pid in wait_until_gone(pids, 0):  # a failed run: end what the launcher left
            os.kill(pid, 9)
