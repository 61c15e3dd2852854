"""The main job's run journal, end to end with real jobs (forked from the preloaded fork server):

* killed by its kill point between two updates on S3 (moto) and resumed: ``opd-store report`` says
  where it died (the step it reached, the step the next start resumed from, the updates redone),
  the resume journaled the same, and ``--checkpoint-every auto`` continued the journaled schedule;
* SIGTERM with ``--notice-deadline-secs`` on S3 behind a bandwidth-capped proxy (a save takes about
  2 s): a deadline the save fits commits within it, one it does not fit starts no save and exits
  at once with one line (the last committed step, the updates lost) and no orphan; both journaled.

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
    # auto: the resumed start's first save is where the journaled schedule of the step it resumed from puts it
    saves = [e for e in events if e.kind == "save"]
    first, second = report.starts[0].start_id, report.starts[1].start_id
    resumed_from = next(e for e in saves if e.start_id == first and e.step == resume["step"])
    after = [e for e in saves if e.start_id == second]
    assert after and after[0].step == resume["step"] + resumed_from.next_checkpoint_every
    for earlier, later in zip(after, after[1:]):
        assert later.step == earlier.step + earlier.next_checkpoint_every
    assert all(e.requests.get("put", 0) >= 8 for e in saves)  # every payload and the manifest, counted
    assert report.starts[1].first_update_secs is not None and report.restart_secs_worst > 0


@pytest.fixture
def capped_s3(s3_backend, moto_s3):
    """The S3 location behind a proxy capping each connection at 12 kB/s (4 KiB bursts): a save
    of the main job (about 60 kB over a few connections) takes about 2 s."""
    proxy = CappedProxy(moto_s3.endpoint_url, cap_bytes_per_sec=12_000, burst_bytes=4096)
    try:
        yield s3_backend, proxy
    finally:
        proxy.stop()


def _notice_run(backend, proxy, workdir: Path, deadline_secs: float, *extra: str
                ) -> tuple[subprocess.CompletedProcess, list]:
    """Start the job, SIGTERM it once its first save committed; return its result and events."""
    cmd = _train(backend.url, proxy.endpoint_url, workdir, "run", "--updates", "40", "--checkpoint-every", "2",
                 "--notice-deadline-secs", str(deadline_secs), *extra)
    proc = forkserver.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + DEADLINE_SECS
        while not any(e["event"] == "saved" for e in _records(workdir / "run.events")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no save committed"
            threading.Event().wait(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=DEADLINE_SECS)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), _records(workdir / "run.events")


def test_a_notice_deadline_the_save_fits_commits_within_it(capped_s3, tmp_path):
    backend, proxy = capped_s3
    metrics = tmp_path / "opd.prom"
    done, events = _notice_run(backend, proxy, tmp_path, 30.0, "--metrics-textfile", str(metrics))
    assert done.returncode == 0, done.stderr[-3000:]
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    assert preempted["action"] == "committed" and 0 < preempted["deadline_secs_left"] <= 30.0
    store = open_store(backend)
    assert store.latest_step() == preempted["step"]
    journal = read_journal(store).events
    (notice,) = [e for e in journal if e.kind == "notice"]
    (final,) = [e for e in journal if e.kind == "save" and e.reason == "notice"]
    first = next(e for e in journal if e.kind == "save")
    assert first.commit_secs > 1.0  # the cap makes a save take its bytes' time
    assert notice.decision == "save" and notice.estimate_secs == pytest.approx(first.commit_secs)
    assert final.step == notice.step == preempted["step"] and final.time_secs <= notice.time_secs + notice.deadline_secs
    assert report_store(store).preemptions == []  # the run was not followed by another start yet
    assert [s.outcome for s in report_store(store).starts] == ["preempted"]
    # the Prometheus textfile (node_exporter's collector) after the last event
    samples = dict(line.rsplit(" ", 1) for line in metrics.read_text().splitlines() if not line.startswith("#"))
    assert float(samples["opd_store_saves_total"]) == 2 and float(samples["opd_store_last_committed_step"]) == final.step
    assert float(samples["opd_store_saved_bytes_total"]) == first.size_bytes + final.size_bytes
    assert float(samples['opd_store_requests_total{kind="put"}']) >= 2 * 9


def test_a_notice_deadline_the_save_cannot_meet_starts_no_save(capped_s3, tmp_path):
    backend, proxy = capped_s3
    done, events = _notice_run(backend, proxy, tmp_path, 2.0)
    assert done.returncode == 0, done.stderr[-3000:]
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    assert preempted["action"] == "skipped", preempted
    store = open_store(backend)
    last = store.latest_step()
    assert (preempted["action"], preempted["last_committed_step"], preempted["updates_lost"]) == (
        "skipped", last, preempted["step"] - last)
    lines = [line for line in done.stderr.splitlines() if line.startswith("opd-store train: preempted")]
    assert lines == [f"opd-store train: preempted (SIGTERM): no save started at step {preempted['step']}: "
                     f"{preempted['reason']}; the last committed step is {last} ({store.step_url(last)}), "
                     f"{preempted['updates_lost']} updates lost; exiting 0"]
    assert "only" in preempted["reason"] and "s left" in preempted["reason"]
    # no attempt of a later step: nothing for gc
    assert [info.step for info in store.checkpoints()] == store.steps()
    journal = read_journal(store).events
    (notice,) = [e for e in journal if e.kind == "notice"]
    assert (notice.decision, notice.updates_lost, notice.last_committed_step) == (
        "skip", preempted["updates_lost"], last)
    assert notice.estimate_secs > 1.0 and [e.outcome for e in journal if e.kind == "exit"] == ["preempted"]
