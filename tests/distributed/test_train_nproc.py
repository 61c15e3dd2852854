"""``opd-store train --nproc 2``: a rank killed mid-save, the job restarted, bit-exact.

The job runs as a real CLI process (a child of the preloaded fork server) that forks two gloo
ranks (``--start-method fork``: the spawned default, whose ranks each pay a fresh interpreter's
imports, is run by tests/distributed/test_launcher_killed.py). The kill lands while rank 1 is in
the middle of its RNG part of step 4 (tests/faulty_job.py blocks it there and names its pid), so
nothing can have committed step 4. The restarted job resumes from step 2
and must end bit-identical to an uninterrupted 2-rank run: adapter, optimizer, counters, losses;
it does so with a run journal damaged and partly lost before the restart (nothing resumes from the
journal), and ``opd-store report`` then says where the first run died (step 4 reached, step 2
resumed from, 2 updates redone), skipping the damaged events with a warning.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from opd_testkit import forkserver

from opd_store import CheckpointStore
from opd_store.format import JOURNAL_PREFIX
from opd_store.ledger import MAX_EVENT_BYTES, read_journal, report_store

ROOT = Path(__file__).resolve().parents[2]
FAULTY_JOB = ROOT / "tests" / "faulty_job.py"
DEADLINE_SECS = 1200
pytestmark = pytest.mark.timeout(3 * DEADLINE_SECS)


def _cmd(store: Path, tag: str, tmp_path: Path, *, faults: bool = False) -> list[str]:
    """The job's command line, its ranks forked from the (preloaded) launcher; ``faults``: through
    tests/faulty_job.py, which patches the launcher before its ranks are forked."""
    program = [str(FAULTY_JOB)] if faults else ["-m", "opd_store"]
    return [sys.executable, *program, "train", "--store", str(store), "--updates", "4",
            "--checkpoint-every", "2", "--nproc", "2", "--journal-progress-secs", "0", "--log", str(tmp_path / f"{tag}.log"),
            "--events", str(tmp_path / f"{tag}.events"), "--final-state", str(tmp_path / f"{tag}.pt"),
            "--start-method", "fork"]


def _env(**extra) -> dict:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **extra)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_nproc2_kill_mid_save_then_resume_is_bit_exact(tmp_path):
    reference = forkserver.run(_cmd(tmp_path / "ref", "ref", tmp_path), env=_env(), capture_output=True, text=True,
                               timeout=DEADLINE_SECS)
    assert reference.returncode == 0, reference.stderr[-4000:]
    ref_store = CheckpointStore(tmp_path / "ref")
    assert ref_store.steps() == [2, 4]
    manifest = ref_store.manifest(4)
    assert manifest.world_size == 2
    assert {"rng-rank-00.pt", "rng-rank-01.pt"} <= {entry.name for entry in manifest.payloads}

    marker = tmp_path / "blocked"
    killed = forkserver.popen(_cmd(tmp_path / "run", "run1", tmp_path, faults=True),
                              env=_env(OPD_TEST_BLOCK_SAVE=f"1:4:{marker}"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + DEADLINE_SECS
    while not marker.exists() or not marker.read_text():
        if killed.poll() is not None or time.monotonic() > deadline:
            killed.kill()
            pytest.fail(f"rank 1 never blocked mid-save; output:\n{killed.communicate()[0][-4000:]}")
        time.sleep(0.05)
    store = CheckpointStore(tmp_path / "run")
    assert store.steps() == [2]
    os.kill(int(marker.read_text()), signal.SIGKILL)
    output = killed.communicate(timeout=DEADLINE_SECS)[0]
    assert killed.returncode != 0, output[-4000:]
    assert store.steps() == [2] and store.latest_step() == 2  # step 4 never committed
    # The journal damaged and partly lost: the killed start's resume event deleted, its first-update
    # event overwritten, and an oversized and a newer-schema object beside them.
    journal = tmp_path / "run" / JOURNAL_PREFIX
    (journal / next(p.name for p in journal.iterdir() if "-resume-" in p.name)).unlink()
    (journal / next(p.name for p in journal.iterdir() if "-first_update-" in p.name)).write_bytes(b"\x00garbage")
    stamp = "20270101T000000.000000Z-" + "f" * 16
    (journal / f"{stamp}-000000-progress-s000009.json").write_bytes(b" " * (MAX_EVENT_BYTES + 1))
    (journal / f"{stamp}-000001-progress-s000009.json").write_text(json.dumps({"schema_version": 99}))

    resumed = forkserver.run(_cmd(tmp_path / "run", "run2", tmp_path), env=_env(), capture_output=True, text=True,
                             timeout=DEADLINE_SECS)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    events = _records(tmp_path / "run2.events")
    assert events[0] == {"event": "resumed", "url": f"{tmp_path / 'run'}/step-000002", "step": 2}
    assert store.steps() == [2, 4]

    expected = torch.load(tmp_path / "ref.pt", weights_only=True)
    actual = torch.load(tmp_path / "run2.pt", weights_only=True)
    assert actual["trainer"] == expected["trainer"]
    assert actual["adapter"].keys() == expected["adapter"].keys()
    for name, tensor in expected["adapter"].items():
        assert torch.equal(actual["adapter"][name], tensor), name
    assert actual["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for index, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(actual["optimizer"]["state"][index][key], value), (index, key)

    by_update = {record["attempted_update"]: record for record in _records(tmp_path / "ref.log")}
    for record in _records(tmp_path / "run1.log") + _records(tmp_path / "run2.log"):
        assert record == by_update[record["attempted_update"]]
    assert _records(tmp_path / "run2.log")[-1] == by_update[max(by_update)]
    report = report_store(store)
    assert [(row.outcome, row.world_size) for row in report.starts] == [("failed", 2), ("finished", 2)]  # rank 0 gave up
    assert [(p.how, p.last_step, p.resumed_step, p.updates_lost, p.exact) for p in report.preemptions] == [
        ("failed", 4, 2, 2, True)]
    assert len(report.skipped) == 3 and report.saves == 2  # step 2, then step 4 after the resume
    first_save = next(e for e in read_journal(store).events if e.kind == "save")
    assert first_save.step == 2 and first_save.requests["put"] >= 10  # rank 0's 8 payloads, its manifest, rank 1's part

    # One rank's RNG file of the reference's step 4 truncated after the commit: the job stops
    # before training, on every rank, with exit 4 and a final line that does not promise a resume
    # (a rerun would fail the same way); once the damaged step is deleted it resumes from step 2
    # and ends where the reference did.
    (damaged,) = (tmp_path / "ref" / "step-000004").glob("attempt-*/rng-rank-01.pt")
    damaged.write_bytes(damaged.read_bytes()[:-10])
    step2 = {p: p.read_bytes() for p in (tmp_path / "ref" / "step-000002").rglob("*") if p.is_file()}
    for attempt in range(2):
        refused = forkserver.run(_cmd(tmp_path / "ref", f"refused{attempt}", tmp_path), env=_env(),
                                 capture_output=True, text=True, timeout=DEADLINE_SECS)
        assert refused.returncode == 4, refused.stderr[-4000:]
        assert "skipped step 4 (incomplete: " in refused.stderr and "rng-rank-01.pt" in refused.stderr
        assert f"step 4 is damaged (incomplete: {damaged.parent.name}/rng-rank-01.pt: expected" in refused.stderr
        assert f"`opd-store delete {tmp_path / 'ref'} 4`" in refused.stderr
        last = refused.stderr.strip().splitlines()[-1]
        assert last.endswith("a rerun of the same command fails the same way: see the rank's error above"), last
        assert "resume from it" not in refused.stderr
        assert not (tmp_path / f"refused{attempt}.log").exists() or not _records(tmp_path / f"refused{attempt}.log")
    assert forkserver.run([sys.executable, "-m", "opd_store", "delete", str(tmp_path / "ref"), "4"],
                          env=_env(), capture_output=True, timeout=DEADLINE_SECS).returncode == 0
    redone = forkserver.run(_cmd(tmp_path / "ref", "redo", tmp_path), env=_env(), capture_output=True, text=True,
                            timeout=DEADLINE_SECS)
    assert redone.returncode == 0, redone.stderr[-4000:]
    assert _records(tmp_path / "redo.events")[0]["step"] == 2
    assert ref_store.steps() == [2, 4] and ref_store.verify(4, deep=True).ok
    assert {p: p.read_bytes() for p in (tmp_path / "ref" / "step-000002").rglob("*") if p.is_file()} == step2
    redo = torch.load(tmp_path / "redo.pt", weights_only=True)
    assert redo["trainer"] == expected["trainer"]
    for name, tensor in expected["adapter"].items():
        assert torch.equal(redo["adapter"][name], tensor), name


def test_elastic_replicated_resume_reports_world_sizes(tmp_path):
    """Saved by 2 replicated ranks, resumed by 1 under ``--resume-mode elastic``: the ``resumed``
    event names both world sizes and the saved rank whose RNG state no rank restores, as the
    ``--shard`` path does (docs/resume.md)."""
    store_dir = tmp_path / "store"
    common = ["--store", str(store_dir), "--updates", "4", "--checkpoint-every", "2", "--start-method", "fork"]
    saved = forkserver.run([sys.executable, "-m", "opd_store", "train", *common, "--nproc", "2",
                            "--log", str(tmp_path / "run1.log"), "--events", str(tmp_path / "run1.events")],
                           capture_output=True, text=True, timeout=DEADLINE_SECS)
    assert saved.returncode == 0, saved.stderr[-4000:]
    store = CheckpointStore(store_dir)
    assert store.steps() == [2, 4] and store.manifest(2).world_size == 2
    saved_at_2 = torch.load(io.BytesIO(store.read(2, "training_state.pt")), weights_only=True)["trainer"]
    shutil.rmtree(store_dir / "step-000004")  # the job resumes from step 2 and commits step 4 again
    resumed = forkserver.run([sys.executable, "-m", "opd_store", "train", *common, "--nproc", "1",
                              "--resume-mode", "elastic", "--log", str(tmp_path / "run2.log"),
                              "--events", str(tmp_path / "run2.events"), "--final-state", str(tmp_path / "run2.pt")],
                             capture_output=True, text=True, timeout=DEADLINE_SECS)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _records(tmp_path / "run2.events")[0] == {
        "event": "resumed", "url": f"{store_dir}/step-000002", "step": 2, "saved_world_size": 2, "world_size": 1,
        "unclaimed_ranks": [1]}
    assert store.steps() == [2, 4] and store.manifest(4).world_size == 1
    # More than the report: the run went on from the saved state. The global sample index continues
    # from the two ranks' (one rank now reads 2 prompts per attempted update), the scheduler gives the
    # first run's learning rate at every step, and the counters are the saved ones plus the updates run.
    attempted = _records(tmp_path / "run2.log")
    final = torch.load(tmp_path / "run2.pt", weights_only=True)["trainer"]
    assert final["samples_done"] == saved_at_2["samples_done"] + len(attempted) * 1 * 2
    assert final["attempted_updates"] == saved_at_2["attempted_updates"] + len(attempted)
    assert final["successful_updates"] == 4 and [r["step"] for r in attempted if r["ok"]] == [3, 4]
    first_lr = {r["step"]: r["lr"] for r in _records(tmp_path / "run1.log") if r["ok"]}
    assert all(r["lr"] == first_lr[r["step"]] and math.isfinite(r["loss"]) for r in attempted if r["ok"])
