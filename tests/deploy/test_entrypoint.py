"""deploy/entrypoint.sh, the image's entrypoint, run for real on a local store: it trains with
``--resume auto`` from environment variables, exits 143 after a SIGTERM (so a scheduler starts it
again even when the job stopped cleanly), and the next start resumes from the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opd_testkit import forkserver

from opd_store import CheckpointStore

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "deploy/entrypoint.sh"

pytestmark = pytest.mark.timeout(1500)  # real training runs (~40 s each alone) on a shared CPU


def _env(store: Path, updates: int) -> dict[str, str]:
    env = dict(os.environ)
    # The entrypoint's `opd-store` runs through the worker's fork server: the job's imports are paid
    # once per worker; the command forwards the entrypoint's SIGTERM to the job and its exit status back.
    shim = forkserver.default_server().shim_dir()
    env["PATH"] = os.pathsep.join([shim, str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(OPD_STORE_URL=str(store), OPD_UPDATES=str(updates), OPD_CHECKPOINT_EVERY="1")
    return env


def _start(store: Path, updates: int, events: Path, cwd: Path, **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen(["sh", str(ENTRYPOINT), "--events", str(events), "--log", str(cwd / "log.jsonl")],
                            env={**_env(store, updates), **extra_env}, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def test_entrypoint_requires_the_store_url(tmp_path):
    env = _env(tmp_path / "store", 2)
    del env["OPD_STORE_URL"]
    result = subprocess.run(["sh", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "OPD_STORE_URL" in result.stderr
    assert not (tmp_path / "store").exists()


def test_entrypoint_runs_to_the_end_then_resumes_without_training(tmp_path):
    store = tmp_path / "store"
    first = _start(store, 2, tmp_path / "events-1.jsonl", tmp_path)
    out, err = first.communicate(timeout=900)
    assert first.returncode == 0, err[-3000:]
    assert CheckpointStore(store).steps() == [1, 2]
    assert [e["step"] for e in _events(tmp_path / "events-1.jsonl") if e["event"] == "saved"] == [1, 2]

    second = _start(store, 2, tmp_path / "events-2.jsonl", tmp_path)
    out, err = second.communicate(timeout=900)
    assert second.returncode == 0, err[-3000:]
    events = _events(tmp_path / "events-2.jsonl")
    assert [e for e in events if e["event"] == "resumed"] == [
        {"event": "resumed", "url": str(store / "step-000002"), "step": 2}]
    assert [e for e in events if e["event"] in ("saved", "update")] == []


def test_opd_keep_last_keeps_only_the_newest_checkpoints(tmp_path):
    store = tmp_path / "store"
    job = _start(store, 3, tmp_path / "events.jsonl", tmp_path, OPD_KEEP_LAST="1")
    out, err = job.communicate(timeout=900)
    assert job.returncode == 0, err[-3000:]
    assert [e["step"] for e in _events(tmp_path / "events.jsonl") if e["event"] == "saved"] == [1, 2, 3]
    assert CheckpointStore(store).steps() == [3]
    assert CheckpointStore(store).is_complete(3)


def test_sigterm_exits_143_and_the_next_start_resumes(tmp_path):
    store = tmp_path / "store"
    events = tmp_path / "events-1.jsonl"
    first = _start(store, 3, events, tmp_path)
    try:
        deadline = time.monotonic() + 900
        while not any(e["event"] == "saved" for e in _events(events)):
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint was saved"
            time.sleep(0.2)  # polling a real condition (the events file) with a deadline
        first.send_signal(signal.SIGTERM)  # what tini forwards on a preemption notice
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, err[-3000:]
    assert "exiting 143 so the run is started again" in err
    latest = CheckpointStore(store).latest_step()
    assert latest >= 1

    second = _start(store, 3, tmp_path / "events-2.jsonl", tmp_path)
    out, err = second.communicate(timeout=900)
    assert second.returncode == 0, err[-3000:]
    resumed = [e for e in _events(tmp_path / "events-2.jsonl") if e["event"] == "resumed"]
    assert resumed == [{"event": "resumed", "url": str(store / f"step-{latest:06d}"), "step": latest}]
    assert CheckpointStore(store).latest_step() == 3
