"""Kills and partial writes: spot loss while a checkpoint was only partly
uploaded. The main job (``opd-store train``) dies by SIGKILL after some payloads of a save are in
the store; a new machine with an empty disk (a new process, new empty cwd, HOME and TMPDIR)
resumes from the newest step whose commit completed and redoes the lost updates bit for bit.

Backends: local, S3 (SeaweedFS) and GCS (fake-gcs-server). ``memory://`` lives inside one process, so
no second machine can see it: the scenario does not apply. S3 on moto's server is the demo's
(tests/job/test_demo.py: the job SIGKILLed inside a save on moto, resumed bit-exact), so this
scenario runs its S3 row on SeaweedFS only."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from opd_testkit import forkserver

from .helpers import PYTHON, fresh_machine, open_store, store_args

HERE = Path(__file__).resolve().parent
UPDATES, EVERY, KILL_STEP, KILL_AFTER_PAYLOADS = 4, 2, 4, 3


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["local", "seaweed", "gcs"], indirect=True)
def test_spot_loss_mid_upload_resumes_from_last_completed_commit(backend, tmp_path):
    """The job saves step 2, then dies after 3 payloads of step 4 were uploaded
    (adapter objects in the store, RNG, training state and manifest not). A new machine sees
    step 4 uncommitted, resumes from step 2 (the newest completed commit, named with the store's
    protocol), redoes updates 3-4 with losses and learning rates equal bit for bit to the lost
    run's, and commits step 4 from its own attempt."""
    train_args = ["--store", backend.url, "--updates", str(UPDATES), "--checkpoint-every", str(EVERY),
                  "--seed", "3", *store_args(backend)]

    env, cwd = fresh_machine(tmp_path)
    killed_log, killed_events = tmp_path / "killed-log.jsonl", tmp_path / "killed-events.jsonl"
    killed = forkserver.run(
        [PYTHON, str(HERE / "killed_train.py"), str(KILL_STEP), str(KILL_AFTER_PAYLOADS), "--", *train_args,
         "--log", str(killed_log), "--events", str(killed_events)],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert f"KILLING {KILL_STEP} {KILL_AFTER_PAYLOADS}" in killed.stderr
    events = _records(killed_events)
    assert [e["step"] for e in events if e["event"] == "saved"] == [2]
    assert [e["step"] for e in events if e["event"] == "save_begin"] == [2, 4]

    # What the bucket holds now: step 2 committed; step 4 partly uploaded, never committed.
    store = open_store(backend)
    infos = {info.step: info for info in store.checkpoints()}
    assert sorted(infos) == [2, 4]
    assert infos[2].status == "complete" and infos[4].status == "uncommitted"
    (attempt,) = infos[4].attempts
    uploaded = sorted(name.split(f"{attempt}/", 1)[1] for name in store.storage.list_tree("step-000004"))
    assert len(uploaded) == KILL_AFTER_PAYLOADS and all(name.startswith("adapter/") for name in uploaded)
    assert store.latest_step() == 2 and store.steps() == [2]

    env, cwd = fresh_machine(tmp_path)  # another machine: nothing of the first one's disk
    resumed_log, resumed_events = tmp_path / "resumed-log.jsonl", tmp_path / "resumed-events.jsonl"
    resumed = forkserver.run(
        [PYTHON, "-m", "opd_store", *["train", *train_args], "--log", str(resumed_log), "--events", str(resumed_events)],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = _records(resumed_events)
    assert events[0] == {"event": "resumed", "url": store.step_url(2), "step": 2}
    assert store.step_url(2).startswith(backend.url.rstrip("/"))
    assert [e["step"] for e in events if e["event"] == "saved"] == [4]

    # The lost machine had done every update up to step 4; the new one redoes those after step 2
    # (the same attempted updates) with the same losses, learning rates and verdicts.
    lost = _records(killed_log)
    attempted_at_2 = store.manifest(2).metadata["attempted_updates"]
    redone = _records(resumed_log)
    assert redone == [r for r in lost if r["attempted_update"] > attempted_at_2]
    assert redone[-1]["step"] == UPDATES and len(redone) >= 2

    fresh = open_store(backend)
    assert fresh.steps() == [2, 4] and fresh.latest_step() == 4
    manifest = fresh.manifest(4)
    assert manifest.attempt_id != attempt and manifest.metadata["successful_updates"] == 4
    assert fresh.verify(4, deep=True).ok
