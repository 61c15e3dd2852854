"""The main job on a preemption notice: SIGTERM mid-training, or the AWS/GCE notice
of a fake metadata server, makes ``opd-store train`` finish the update in progress, commit a
checkpoint, print what it saved and exit 0; resuming afterwards ends bit-identical to an
uninterrupted run (compared as in tests/job/test_train_cli.py: final adapter, optimizer state and
per-update losses). The uninterrupted reference saves with ``--async-save``."""

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
import torch
from opd_testkit import forkserver

from opd_store import CheckpointStore

pytestmark = pytest.mark.timeout(2400)  # several job processes; each imports torch/transformers/peft

UPDATES = 6
# A notice from the metadata server reaches the job through a poller thread (every 0.1 s here); on
# a loaded machine the training thread finished the 3 updates left of a 6-update run before the
# poller's request came back, and the job ran to its end. These runs are long enough that only the
# notice can end them (they stop a few updates after it, so they cost no more).
NOTICE_RUN_UPDATES = 40
DEADLINE_SECS = 600
ROOT = Path(__file__).resolve().parents[2]


def _train_cmd(store: Path, workdir: Path, *extra: str, updates: int = UPDATES) -> list[str]:
    return [sys.executable, "-m", "opd_store", "train", "--store", str(store), "--updates", str(updates),
            "--checkpoint-every", "2", "--log", str(workdir / "log.jsonl"), "--events", str(workdir / "events.jsonl"),
            "--final-state", str(workdir / "final.pt"), *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_update(proc: subprocess.Popen, events: Path, attempted: int) -> None:
    deadline = time.monotonic() + DEADLINE_SECS
    while not any(r.get("event") == "update" and r["attempted_update"] >= attempted for r in _records(events)):
        assert proc.poll() is None, f"the job exited early: {proc.communicate()}"
        assert time.monotonic() < deadline, "the job never reached the update"
        threading.Event().wait(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run with asynchronous periodic saves."""
    workdir = tmp_path_factory.mktemp("reference")
    done = forkserver.run(_train_cmd(workdir / "store", workdir, "--async-save"), env=_env(), capture_output=True,
                          text=True, timeout=DEADLINE_SECS)
    assert done.returncode == 0, done.stderr
    saved = [r for r in _records(workdir / "events.jsonl") if r["event"] == "saved"]
    assert [r["step"] for r in saved] == [2, 4, 6]
    assert all(r["blocked_seconds"] < r["seconds"] for r in saved)
    return workdir


def _losses(workdir: Path) -> dict[int, float]:
    return {r["attempted_update"]: r["loss"] for r in _records(workdir / "log.jsonl")}


def _assert_same_final(a: Path, b: Path) -> None:
    left, right = torch.load(a / "final.pt", weights_only=True), torch.load(b / "final.pt", weights_only=True)
    assert left["trainer"] == right["trainer"]
    assert left["adapter"].keys() == right["adapter"].keys()
    for name in left["adapter"]:
        assert torch.equal(left["adapter"][name], right["adapter"][name]), name
    for key, state in left["optimizer"]["state"].items():
        for field, value in state.items():
            assert torch.equal(value, right["optimizer"]["state"][key][field]), (key, field)


def _interrupt(tmp_path: Path, notify, *extra: str, updates: int = UPDATES) -> tuple[Path, dict, str]:
    """Start the job, call ``notify(proc)`` once update 3 is done, return (store, preempted event, stderr)."""
    store = tmp_path / "store"
    proc = forkserver.popen(_train_cmd(store, tmp_path, *extra, updates=updates), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_update(proc, tmp_path / "events.jsonl", attempted=3)
        notify(proc)
        _out, err = proc.communicate(timeout=DEADLINE_SECS)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert not (tmp_path / "final.pt").exists()  # it stopped early
    (event,) = [r for r in _records(tmp_path / "events.jsonl") if r["event"] == "preempted"]
    lines = [line for line in err.splitlines() if line.startswith("opd-store train: preempted")]
    assert lines == [f"opd-store train: preempted ({event['source']}): step {event['step']} {event['action']} at "
                     f"{event['url']} in {event['seconds']:.2f} s; exiting 0"]
    checkpoints = CheckpointStore(store)
    assert checkpoints.latest_step() == event["step"] >= 1
    assert event["url"] == checkpoints.step_url(event["step"])
    updates = [r for r in _records(tmp_path / "events.jsonl") if r["event"] == "update"]
    assert event["attempted_updates"] == updates[-1]["attempted_update"] >= 3  # the update in progress finished
    if event["action"] == "committed":
        assert checkpoints.manifest(event["step"]).metadata["attempted_updates"] == event["attempted_updates"]
    return store, event, err


def test_sigterm_mid_training_commits_exits_0_and_resume_is_bit_exact(tmp_path, reference):
    store, event, _err = _interrupt(tmp_path, lambda proc: proc.send_signal(signal.SIGTERM))
    assert (event["source"], event["deadline_secs_left"]) == ("SIGTERM", None)

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    done = forkserver.run(_train_cmd(store, resumed), env=_env(), capture_output=True, text=True,
                          timeout=DEADLINE_SECS)
    assert done.returncode == 0, done.stderr
    (resume_event,) = [r for r in _records(resumed / "events.jsonl") if r["event"] == "resumed"]
    assert resume_event["step"] == event["step"]
    _assert_same_final(reference, resumed)
    # Every update after the resume has exactly the loss the uninterrupted run had.
    expected = _losses(reference)
    after = _losses(resumed)
    assert after and all(after[update] == expected[update] for update in after)


@pytest.mark.parametrize("cloud", ["aws", "gce"])
def test_a_spot_notice_from_the_metadata_server_takes_the_same_path(tmp_path, metadata_server, cloud):
    post = metadata_server.post_aws_notice if cloud == "aws" else metadata_server.post_gce_notice
    _store, event, _err = _interrupt(tmp_path, lambda proc: post(), "--spot-notice", cloud, "--metadata-endpoint",
                                     metadata_server.endpoint, "--notice-poll-secs", "0.1", "--async-save",
                                     updates=NOTICE_RUN_UPDATES)
    assert event["source"] == ("aws-spot" if cloud == "aws" else "gce")
    assert event["deadline_secs_left"] > 0  # exited before the platform's deadline
