"""The main job's run journal, end to end with real jobs (forked from the preloaded fork server):

* killed by its kill point between two updates on S3 (moto) and resumed: ``opd-store report`` says
  where it died (the step it reached, the step the next start resumed from, the updates redone),
  the resume journaled the same, and ``--checkpoint-every auto`` continued the journaled schedule;
* SIGTERM with ``--notice-deadline-secs`` on S3 behind a bandwidth-capped proxy (a save takes about
  2 s, measured by an earlier start and read back from the journal): a deadline the save does not
  fit starts no save and exits at once with one line (the last committed step, the updates lost)
  and no orphan; one it fits commits within it; both journaled and reported.

The multi-rank run and a damaged journal are tests/distributed/test_train_nproc.py's; the demo's and
the soak's ground truth against the report are tests/job/test_demo.py's and test_soak.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opd_testkit import forkserver
from opd_testkit.stores import open_store
from opd_testkit.throttle import CappedProxy

from opd_store.ledger import read_journal, report_store
from opd_store.runtime import kill_points

pytestmark = pytest.mark.timeout(900)
DEADLINE_SECS = 600


def _train(store_url: str, endpoint: str, workdir: Path, tag: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "opd_store", "train", "--store", store_url, "--s3-endpoint-url", endpoint,
            "--log", str(workdir / f"{tag}.log"), "--events", str(workdir / f"{tag}.events"),
            "--journal-progress-secs", "0", *extra]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def test_a_killed_run_and_its_resume_are_reported_where_they_happened(s3_backend, moto_s3, tmp_path):
    store = open_store(s3_backend)
    env = dict(os.environ)
    env[kill_points.ENV_VAR] = json.dumps({"phase": "between_updates", "attempted": 5,
                                           "report": str(tmp_path / "kill.jsonl")})
    updates = ["--updates", "8", "--checkpoint-every", "auto:1"]
    killed = forkserver.run(_train(s3_backend.url, moto_s3.endpoint_url, tmp_path, "run1", *updates), env=env,
                            capture_output=True, text=True, timeout=DEADLINE_SECS)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    reached = _records(tmp_path / "run1.log")[-1]  # the last update the killed start logged
    assert reached["attempted_update"] == 4
    resumed = forkserver.run(_train(s3_backend.url, moto_s3.endpoint_url, tmp_path, "run2", *updates),
                             capture_output=True, text=True, timeout=DEADLINE_SECS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (resume,) = [e for e in _records(tmp_path / "run2.events") if e["event"] == "resumed"]

    report = report_store(store)
    assert [r.outcome for r in report.starts] == ["killed", "finished"]
    (row,) = report.preemptions
    assert (row.last_step, row.resumed_step, row.updates_lost, row.exact) == (
        reached["step"], resume["step"], reached["step"] - resume["step"], True)
    events = read_journal(store).events
    (resume_event,) = [e for e in events if e.kind == "resume" and e.resumed_step is not None]
    assert (resume_event.resumed_step, resume_event.updates_redone) == (resume["step"], row.updates_lost)
    # auto: the resumed start's first save is where the journaled schedule of the step it resumed
    # from puts it; that save's event is written in the background, and a kill right after the
    # commit can lose it: the resumed start then starts again from auto:1
    saves = [e for e in events if e.kind == "save"]
    first, second = report.starts[0].start_id, report.starts[1].start_id
    resumed_from = [e for e in saves if e.start_id == first and e.step == resume["step"]]
    every = resumed_from[0].next_checkpoint_every if resumed_from else 1
    after = [e for e in saves if e.start_id == second]
    assert after and after[0].step == resume["step"] + every
    for earlier, later in zip(after, after[1:]):
        assert later.step == earlier.step + earlier.next_checkpoint_every
    assert all(e.requests.get("put", 0) >= 8 for e in saves)  # every payload and the manifest, counted
    assert report.starts[1].first_update_secs is not None and report.restart_secs_worst > 0


@pytest.fixture
def capped_s3(s3_backend, moto_s3):
    """The S3 location behind a proxy capping what each connection uploads at 12 kB/s (4 KiB
    bursts): a save of the main job (about 60 kB over a few connections) takes about 2 s; reads
    (the resume) go at full speed."""
    proxy = CappedProxy(moto_s3.endpoint_url, cap_bytes_per_sec=12_000, burst_bytes=4096, uploads_only=True)
    try:
        yield s3_backend, proxy
    finally:
        proxy.stop()


def _start_noticed(backend, proxy, workdir: Path, tag: str, deadline_secs: float, *extra: str
                   ) -> tuple[subprocess.CompletedProcess, list]:
    """Resume the job with no periodic save due (so the step a notice finds is never committed),
    SIGTERM it once an update advanced the step; return its result and events."""
    cmd = _train(backend.url, proxy.endpoint_url, workdir, tag, *UPDATES, "--checkpoint-every", "1000",
                 "--notice-deadline-secs", str(deadline_secs), *extra)
    proc = forkserver.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + DEADLINE_SECS
        while not any(e["event"] == "update" and e["ok"] for e in _records(workdir / f"{tag}.events")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no update"
            threading.Event().wait(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=DEADLINE_SECS)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), _records(workdir / f"{tag}.events")


UPDATES = ("--updates", "40")


def test_notices_are_planned_against_their_deadline_on_a_bandwidth_capped_s3(capped_s3, tmp_path):
    """Start 1 saves step 2 (about 2 s through the proxy, journaled) and is killed two updates
    later; start 2 gets a notice whose 2 s deadline that save cannot meet: no save, one line, no
    orphan; start 3 gets one of 30 s: it saves and commits within it. The report says all of it."""
    backend, proxy = capped_s3
    store = open_store(backend)
    env = dict(os.environ, **{kill_points.ENV_VAR: json.dumps({"phase": "between_updates", "attempted": 5})})
    first = forkserver.run(_train(backend.url, proxy.endpoint_url, tmp_path, "run1", *UPDATES, "--checkpoint-every",
                                  "2"), env=env, capture_output=True, text=True, timeout=DEADLINE_SECS)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert store.steps() == [2]
    measured = next(e for e in read_journal(store).events if e.kind == "save")
    assert measured.step == 2 and measured.commit_secs > 1.0  # the cap makes a save take its bytes' time

    done, events = _start_noticed(backend, proxy, tmp_path, "run2", 2.0)
    assert done.returncode == 0, done.stderr[-3000:]
    (skipped,) = [e for e in events if e["event"] == "preempted"]
    assert (skipped["action"], skipped["last_committed_step"], skipped["updates_lost"]) == (
        "skipped", 2, skipped["step"] - 2)
    lines = [line for line in done.stderr.splitlines() if line.startswith("opd-store train: preempted")]
    assert lines == [f"opd-store train: preempted (SIGTERM): no save started at step {skipped['step']}: "
                     f"{skipped['reason']}; the last committed step is 2 ({store.step_url(2)}), "
                     f"{skipped['updates_lost']} updates lost; exiting 0"]
    assert skipped["reason"].startswith(f"a save takes ~{measured.commit_secs:.1f} s (x1.5 + 1 s margin), only ")
    assert [info.step for info in store.checkpoints()] == [2]  # no attempt of a later step: nothing for gc

    metrics = tmp_path / "opd.prom"
    done, events = _start_noticed(backend, proxy, tmp_path, "run3", 30.0, "--metrics-textfile", str(metrics))
    assert done.returncode == 0, done.stderr[-3000:]
    (committed,) = [e for e in events if e["event"] == "preempted"]
    assert committed["action"] == "committed" and 0 < committed["deadline_secs_left"] <= 30.0
    assert store.steps() == [2, committed["step"]]

    journal = read_journal(store).events
    notices = [e for e in journal if e.kind == "notice"]
    assert [(n.decision, n.step, n.last_committed_step, n.updates_lost) for n in notices] == [
        ("skip", skipped["step"], 2, skipped["step"] - 2), ("save", committed["step"], 2, 0)]
    assert all(n.estimate_secs == pytest.approx(measured.commit_secs) for n in notices)  # seeded from the journal
    (final,) = [e for e in journal if e.kind == "save" and e.reason == "notice"]
    assert final.time_secs <= notices[1].time_secs + notices[1].deadline_secs
    report = report_store(store)
    assert [s.outcome for s in report.starts] == ["killed", "preempted", "preempted"]
    assert [(p.how, p.last_step, p.resumed_step, p.updates_lost, p.notice_outcome) for p in report.preemptions] == [
        ("killed", 3, 2, 1, None), ("SIGTERM", skipped["step"], 2, skipped["step"] - 2, "skipped")]
    samples = dict(line.rsplit(" ", 1) for line in metrics.read_text().splitlines() if not line.startswith("#"))
    assert float(samples["opd_store_saves_total"]) == 1 and float(samples["opd_store_last_committed_step"]) == final.step
    assert float(samples["opd_store_saved_bytes_total"]) == final.size_bytes
    assert float(samples["opd_store_lost_updates_total"]) == skipped["step"] - 2  # redone after the resume


def test_auto_continues_a_journaled_interval_only_within_its_bound(capsys, caplog):
    """``--checkpoint-every auto`` resumes with the interval journaled beside the step it resumed
    from; one over ``MAX_AUTO_EVERY`` (only a damaged journal holds one) is ignored with a warning
    and the schedule starts again from K; ``auto:K`` over the bound is a usage error."""
    import logging

    from opd_store.cli import main
    from opd_store.job._ledger import JobLedger
    from opd_store.ledger import MAX_AUTO_EVERY, Journal

    from opd_store import CheckpointStore

    store = CheckpointStore("memory://opd-test/runs/auto-bound")
    for journaled, expected in ((MAX_AUTO_EVERY, MAX_AUTO_EVERY), (MAX_AUTO_EVERY + 1, 3), (10 ** 12, 3)):
        Journal(store).record("save", step=6, reason="periodic", size_bytes=64, blocking_secs=0.5, commit_secs=0.6,
                              next_checkpoint_every=journaled)
        ledger = JobLedger(store, group=None, updates=12, checkpoint_every=3, auto=True)
        with caplog.at_level(logging.WARNING, logger="opd_store.job"):
            caplog.clear()
            ledger.start(6)
        assert (ledger.every, ledger.next_save_step) == (expected, 6 + expected)
        assert [r.getMessage() for r in caplog.records if "over the bound" in r.getMessage()] == (
            [] if expected == journaled else
            [f"run journal: the save event of step 6 names an interval of {journaled} updates, over the bound of "
             f"{MAX_AUTO_EVERY} (a damaged journal); ignored: every 3 updates"])
        assert ledger.estimator.estimate(64) == 0.6  # the rest of the event is still read
    too_far = f"auto:{MAX_AUTO_EVERY + 1}"
    assert main(["train", "--store", store.url, "--updates", "4", "--checkpoint-every", too_far]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"opd-store train: error: argument --checkpoint-every: auto:K keeps the interval within 1 and 100,000 updates, "
        f"got 'auto:{MAX_AUTO_EVERY + 1}'")
