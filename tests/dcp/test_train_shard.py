"""``opd-store train --nproc 4 --shard``: killed, resumed bit-exact on 4 ranks, resumed elastic on 2.

One test, five runs of the real CLI, each a child of the worker's preloaded fork server
(:mod:`opd_testkit.forkserver`) whose ranks are forked from it (``--start-method fork``), so
no run pays the imports. The two runs with a fault go through tests/faulty_job.py:

1. the uninterrupted reference on 4 ranks;
2. a run whose rank 1 blocks in the middle of writing its shard file of step 4 and is SIGKILLed
   there: the other ranks give up within the bound, nothing is
   committed past step 2, the job exits naming the step a rerun resumes from;
3. the same command again: resumes from step 2 and ends bit-identical to the reference (adapter,
   optimizer, counters, every logged loss);
4. on a copy of the killed run's store, ``--nproc 2 --resume-mode elastic``, preempted by a SIGTERM
   to its rank 1 alone: both ranks save the same step, it commits once, the job exits 0;
5. the same again: it runs to the end.
"""

from __future__ import annotations

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
from opd_store import dcp as store_dcp

FAULTY_JOB = Path(__file__).resolve().parents[1] / "faulty_job.py"
DEADLINE_SECS = 600
RANK_TIMEOUT_SECS = 10
pytestmark = pytest.mark.timeout(4 * DEADLINE_SECS)


def _cmd(store: Path, tag: str, tmp_path: Path, nproc: int, *extra: str, faults: bool = False) -> list[str]:
    program = [str(FAULTY_JOB)] if faults else ["-m", "opd_store"]
    return [sys.executable, *program, "train", "--store", str(store), "--updates", "4",
            "--checkpoint-every", "2", "--nproc", str(nproc), "--shard", "--start-method", "fork",
            "--rank-timeout-secs", str(RANK_TIMEOUT_SECS), "--log", str(tmp_path / f"{tag}.log"),
            "--events", str(tmp_path / f"{tag}.events"), "--final-state", str(tmp_path / f"{tag}.pt"), *extra]


def _env(**extra) -> dict:
    return dict(os.environ, **extra)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return forkserver.run(cmd, env=_env(), capture_output=True, text=True, timeout=DEADLINE_SECS)


def _wait_for(predicate, process: forkserver.ForkedProcess, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_SECS
    while not predicate():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"{what} never happened; output:\n{process.communicate()[0][-4000:]}")
        time.sleep(0.05)


def _assert_same_final(expected: dict, actual: dict) -> None:
    position, expected_position = actual["trainer"].pop("data_position"), expected["trainer"].pop("data_position")
    assert actual["trainer"] == expected["trainer"]
    assert position.keys() == expected_position.keys()
    assert all(torch.equal(torch.as_tensor(position[key]), torch.as_tensor(expected_position[key])) for key in position)
    assert actual["adapter"].keys() == expected["adapter"].keys() and expected["adapter"]
    for name, tensor in expected["adapter"].items():
        assert torch.equal(actual["adapter"][name], tensor), name
    assert actual["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for name, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(actual["optimizer"]["state"][name][key], value), (name, key)


def test_sharded_job_killed_resumed_exact_and_elastic(tmp_path):
    reference = _run(_cmd(tmp_path / "ref", "ref", tmp_path, 4))
    assert reference.returncode == 0, reference.stderr[-4000:]
    ref_store = CheckpointStore(tmp_path / "ref")
    assert ref_store.steps() == [2, 4]
    manifest = ref_store.manifest(4)
    assert manifest.world_size == 4 and manifest.metadata["mesh_shape"] == [4]
    assert manifest.metadata["opd_schema"] == "opd_sharded_v1"
    assert {f"__{rank}_0.distcp" for rank in range(4)} <= {entry.name for entry in manifest.payloads}

    # 2. rank 1 SIGKILLed in the middle of its shard of step 4
    marker, run = tmp_path / "blocked", tmp_path / "run"
    killed = forkserver.popen(_cmd(run, "run1", tmp_path, 4, faults=True),
                              env=_env(OPD_TEST_BLOCK_DCP_SAVE=f"1:4:{marker}"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: marker.exists() and marker.read_text(), killed, "rank 1 blocking mid-save")
    store = CheckpointStore(run)
    assert store.steps() == [2]
    os.kill(int(marker.read_text()), signal.SIGKILL)
    killed_at = time.monotonic()
    output = killed.communicate(timeout=DEADLINE_SECS)[0]
    gave_up_secs = time.monotonic() - killed_at
    assert killed.returncode == 128 + signal.SIGKILL, output[-4000:]
    assert "rank 1 was killed by SIGKILL; ranks [0, 2, 3] gave up" in output
    assert output.count("gave up: another rank is gone or stopped answering") == 3  # each survivor's own line
    assert "the latest complete checkpoint is step 2; rerun the same command to resume from it" in output
    assert gave_up_secs < 2 * RANK_TIMEOUT_SECS + 10, gave_up_secs  # bounded: not the 600 s group timeout
    assert store.steps() == [2] and store.latest_step() == 2  # step 4 never committed
    shutil.copytree(run, tmp_path / "elastic")

    # 3. the same command again: bit-exact with the reference
    resumed = _run(_cmd(run, "run2", tmp_path, 4))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _records(tmp_path / "run2.events")[0] == {"event": "resumed", "url": f"{run}/step-000002", "step": 2}
    assert store.steps() == [2, 4]
    _assert_same_final(torch.load(tmp_path / "ref.pt", weights_only=True),
                       torch.load(tmp_path / "run2.pt", weights_only=True))
    by_update = {record["attempted_update"]: record for record in _records(tmp_path / "ref.log")}
    for record in _records(tmp_path / "run1.log") + _records(tmp_path / "run2.log"):
        assert record == by_update[record["attempted_update"]]
    assert _records(tmp_path / "run2.log")[-1] == by_update[max(by_update)]

    # 4. elastic on 2 ranks, preempted by a SIGTERM to its rank 1 alone (rank 1 waits for it after
    # its first update, so the notice lands before the next boundary)
    elastic, paused = tmp_path / "elastic", tmp_path / "paused"
    events = tmp_path / "elastic1.events"
    first = forkserver.popen(_cmd(elastic, "elastic1", tmp_path, 2, "--resume-mode", "elastic",
                                  "--preemption-signal", "SIGTERM", faults=True),
                             env=_env(OPD_TEST_PAUSE_AFTER_UPDATE=f"1:1:{paused}"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: paused.exists() and paused.read_text(), first, "rank 1 after its first elastic update")
    started = next(e for e in _records(events) if e["event"] == "started")
    assert started["pids"][1] == int(paused.read_text())
    os.kill(started["pids"][1], signal.SIGTERM)
    output = first.communicate(timeout=DEADLINE_SECS)[0]
    assert first.returncode == 0, output[-4000:]
    records = _records(events)
    resumed_event = next(e for e in records if e["event"] == "resumed")
    assert resumed_event["step"] == 2 and resumed_event["saved_world_size"] == 4 and resumed_event["world_size"] == 2
    assert resumed_event["unclaimed_ranks"] == [2, 3]
    preempted = next(e for e in records if e["event"] == "preempted")
    assert preempted["source"] == "SIGTERM" and "seen by rank 1" in preempted["detail"]
    assert preempted["action"] == "committed"
    step = preempted["step"]
    elastic_store = CheckpointStore(elastic)
    assert elastic_store.latest_step() == step and elastic_store.manifest(step).world_size == 2
    assert [e["step"] for e in records if e["event"] == "saved"].count(step) == 1

    # 5. and again: it runs to the end. Not a replay of the reference (docs/resume.md, "Elastic
    # resume"), but every update after the resume is real and continues the saved state: the
    # reference's learning rate at every step (the scheduler went on from the checkpoint), finite
    # losses, AdamW's step count of 4 on every state, the reference's final param groups, finite
    # adapter tensors of the reference's shapes that moved away from the step-2 checkpoint's.
    finished = _run(_cmd(elastic, "elastic2", tmp_path, 2, "--resume-mode", "elastic"))
    assert finished.returncode == 0, finished.stderr[-4000:]
    final = torch.load(tmp_path / "elastic2.pt", weights_only=True)
    assert final["trainer"]["successful_updates"] == 4 and elastic_store.latest_step() == 4
    reference = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert {name: t.shape for name, t in final["adapter"].items()} == {
        name: t.shape for name, t in reference["adapter"].items()}
    assert all(torch.isfinite(t).all() for t in final["adapter"].values())
    reference_lr = {r["step"]: r["lr"] for r in _records(tmp_path / "ref.log") if r["ok"]}
    elastic_updates = [r for r in _records(tmp_path / "elastic1.log") + _records(tmp_path / "elastic2.log") if r["ok"]]
    assert sorted({r["step"] for r in elastic_updates}) == [3, 4]
    assert all(r["lr"] == reference_lr[r["step"]] and math.isfinite(r["loss"]) for r in elastic_updates)
    assert final["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]
    assert {float(state["step"]) for state in final["optimizer"]["state"].values()} == {4.0}
    step2 = {"model": {name: torch.empty_like(t) for name, t in final["adapter"].items()}}
    store_dcp.load(step2, elastic_store, 2)  # the checkpoint the elastic run resumed from, gathered whole
    assert all(not torch.equal(final["adapter"][name], t) for name, t in step2["model"].items())

    # 6. one byte of rank 1's shard file of the reference's step 4 flipped after the commit: the
    # step is skipped like a truncated one, and since the run would save step 4 again it stops
    # before training on every restart (exit 4) naming the file and `opd-store delete`; the last
    # line does not promise a resume. Nothing committed changes.
    (shard,) = (tmp_path / "ref" / "step-000004").glob("attempt-*/__1_0.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in (tmp_path / "ref").rglob("*") if p.is_file()}
    refused = _run(_cmd(tmp_path / "ref", "refused", tmp_path, 4))
    assert refused.returncode == 4, refused.stderr[-4000:]
    assert f"step 4 is damaged (corrupt: {shard.parent.name}/__1_0.distcp: expected crc32c" in refused.stderr
    assert f"`opd-store delete {tmp_path / 'ref'} 4`" in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.endswith("a rerun of the same command fails the same way: see the rank's error above"), last
    assert "resume from it" not in refused.stderr and not _records(tmp_path / "refused.log")
    assert {p: p.read_bytes() for p in (tmp_path / "ref").rglob("*") if p.is_file()} == before
