"""Every way a process ends with a background save or upload in flight exits 0 with the step
committed: an asynchronous save at interpreter exit, a tier upload at interpreter exit, and SIGTERM
(handled by a PreemptionWatcher) during either, on a local store and on S3 (moto server).

Two faults of this kind were found: a process that ended while the writer thread still freed the
snapshot's tensors died with SIGABRT after the save had committed ("terminate called without an
active exception", exit -6, in about 1 of 6 runs; docs/spot.md, "Why the worker thread
is joined at exit", says why), and an S3 save whose first request came after ``main`` returned failed with "cannot
schedule new futures after interpreter shutdown" (``opd_store.runtime._exit_hooks``). Each run
checks the cause whatever the timing: no thread of opd_store is alive when the ``atexit`` hooks
run, just before the interpreter finalizes. The runs are repeated because the first fault is a
race (the writer thread's frees against finalization, whatever the backend): each path runs
:data:`RUNS` times on a local store and :data:`S3_RUNS` times on S3 (24 runs; a 1-in-6 failure
passes all of them with probability (5/6)**24 < 1.3 %). The S3 fault needs no luck: the gate puts
the save's first request after ``main`` returned in every run, and an S3 run costs half as much
again as a local one. Each run is a process forked from the preloaded fork server
(:mod:`opd_testkit.forkserver`) that ends through the interpreter's real exit (exit hooks,
``atexit`` hooks, finalization), as a training script does.

A third: an asynchronous save into a tiered store that commits while the interpreter exits queues
its upload then, so the store's upload worker must finish after the save's worker, whichever was
made first (4 more runs).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest
from opd_testkit.forkserver import QUICK_EXIT_ENV
from opd_testkit.stores import Backend, open_store

CHILD = Path(__file__).with_name("exit_child.py")
RUNS = 4  # per path on a local store
S3_RUNS = 2  # per path on S3 (moto)
PATHS = ("async-exit", "tier-exit", "async-sigterm", "tier-sigterm")
DEADLINE_SECS = 600
WATCHDOG_SECS = 180  # a child still running then is stuck: SIGABRT makes faulthandler print its threads


def _read_line(child, expected: str) -> None:
    line = child.stdout.readline()
    assert line.strip() == expected, f"{line!r}; stderr:\n{child.stderr.read() if not line else ''}"


def _run_to_exit(fork_server, backend: Backend, tier: Path, path: str, *extra: str) -> str:
    """Run the child of ``path`` to its end (sending SIGTERM on the ``-sigterm`` paths); assert it
    exited 0 with no thread of opd_store alive at its ``atexit`` hooks; return its stderr."""
    child = fork_server.popen([sys.executable, str(CHILD), backend.to_json(), str(tier), path, *extra],
                              stdout=fork_server.PIPE, stderr=fork_server.PIPE, text=True,
                              env=dict(os.environ, **{QUICK_EXIT_ENV: "0"}))  # the whole finalization
    watchdog = threading.Timer(WATCHDOG_SECS, child.send_signal, (signal.SIGABRT,))
    watchdog.start()
    try:
        if path.endswith("-sigterm"):
            _read_line(child, "in-flight")  # the save (or upload) waits at its commit until the notice
            child.send_signal(signal.SIGTERM)
            _read_line(child, "committed SIGTERM")
        else:
            _read_line(child, "returning")
        out, err = child.communicate(timeout=DEADLINE_SECS)
    finally:
        watchdog.cancel()
        child.kill()
    assert child.returncode == 0, f"exit status {child.returncode}:\n{err}"
    assert "terminate called" not in err
    # The cause, checked whatever the timing: no thread of opd_store outlives the exit hooks.
    assert out.splitlines() == ["threads at exit: []"]
    return err


@pytest.mark.timeout(DEADLINE_SECS)
@pytest.mark.parametrize(("backend_name", "run"),
                         [("local", run) for run in range(RUNS)] + [("s3", run) for run in range(S3_RUNS)])
@pytest.mark.parametrize("path", PATHS)
def test_the_process_exits_0_with_the_step_committed(request, tmp_path, fork_server, path, backend_name, run):
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    err = _run_to_exit(fork_server, backend, tmp_path / "tier", path)
    store = open_store(backend)
    assert store.status(2) == "complete" and store.steps() == [2]
    if path == "async-exit":
        assert f"opd_store: asynchronous save of step 2 committed: {store.step_url(2)}" in err.splitlines()
    if path.startswith("tier-"):  # durable in the bucket, and still in the local tier
        assert open_store(Backend("local", str(tmp_path / "tier"), {})).status(2) == "complete"


@pytest.mark.timeout(DEADLINE_SECS)
@pytest.mark.parametrize("backend_name", ["local", "s3"])
@pytest.mark.parametrize("order", ["checkpointer-first", "store-first"])
def test_an_async_save_into_a_tiered_store_at_exit_is_uploaded(request, tmp_path, fork_server, order,
                                                                 backend_name):
    """The save commits locally while the interpreter exits and queues its upload then: the exit
    routine finishes the save before the store's upload worker, whichever was made first."""
    backend: Backend = request.getfixturevalue(f"{backend_name}_backend")
    err = _run_to_exit(fork_server, backend, tmp_path / "tier", "async-tier-exit", order)
    local_tier = open_store(Backend("local", str(tmp_path / "tier"), {}))
    assert f"opd_store: asynchronous save of step 2 committed: {local_tier.step_url(2)}" in err.splitlines(), err
    assert local_tier.status(2) == "complete"
    bucket = open_store(backend)
    assert bucket.steps() == [2] and bucket.status(2) == "complete"
