"""The soak: kill points that fire exactly where armed, the planner, the verdict, and the short form
(``--n 10``: every phase once) on a local store and on SeaweedFS."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from opd_testkit.soak import Soak
from opd_testkit.soak_phases import Reference, plan_start, reachable_phases, verdict
from opd_testkit.soak_report import render

from opd_store import CheckpointStore
from opd_store.job._machines import fresh_machine
from opd_store.runtime._kill_points import ENV_VAR, PHASES

# -- kill points ----------------------------------------------------------------------------------

_SAVE = """
import sys
from opd_store import CheckpointStore
store = CheckpointStore(sys.argv[1])
with store.begin(1) as txn:
    for name in ("a.bin", "blob.bin"):
        with txn.open(name) as writer:
            data = bytes(range(256)) * 40  # 10240 bytes, written in 1000-byte calls
            for offset in range(0, len(data), 1000):
                writer.write(data[offset:offset + 1000])
print("committed", flush=True)
"""
DATA = bytes(range(256)) * 40


def _killed_save(fork_server, tmp_path: Path, plan: dict) -> tuple[CheckpointStore, list[dict]]:
    report = tmp_path / "kill.jsonl"
    env, cwd = fresh_machine(tmp_path, {ENV_VAR: json.dumps({**plan, "report": str(report)})})
    store_dir = tmp_path / "store"
    result = fork_server.run([sys.executable, "-c", _SAVE, str(store_dir)], env=env, cwd=cwd, capture_output=True,
                             text=True, timeout=120)
    assert result.returncode == -9, result.stdout + result.stderr
    assert "committed" not in result.stdout
    return CheckpointStore(store_dir), [json.loads(line) for line in report.read_text().splitlines()]


def test_payload_kill_point_dies_after_exactly_the_armed_byte(fork_server, tmp_path):
    store, reports = _killed_save(fork_server, tmp_path, {"phase": "payload_stream", "step": 1, "name": "blob.bin",
                                                          "byte": 4321})
    assert reports == [{"phase": "payload_stream", "thread": "MainThread", "pid": reports[0]["pid"], "step": 1,
                        "name": "blob.bin", "byte": 4321}]
    assert not store.is_complete(1) and store.steps() == []
    files = sorted((p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()), key=len)
    # a.bin was published whole; blob.bin died with the 321 bytes of its fifth write() handed to the
    # backend's file object: what reached the file is what a SIGKILL there leaves (the four whole
    # writes at least; the process's own buffer dies with it)
    assert len(files) == 2 and files[1] == DATA
    assert 4000 <= len(files[0]) <= 4321 and DATA.startswith(files[0])


@pytest.mark.parametrize("phase, complete", [("before_manifest", False), ("after_commit", True)])
def test_commit_kill_points_die_on_either_side_of_the_manifest_create(fork_server, tmp_path, phase, complete):
    store, reports = _killed_save(fork_server, tmp_path, {"phase": phase, "step": 1})
    assert [r["phase"] for r in reports] == [phase]
    assert store.is_complete(1) is complete
    if complete:
        assert store.read(1, "blob.bin") == DATA and store.read(1, "a.bin") == DATA


def test_a_kill_point_armed_elsewhere_does_not_fire(fork_server, tmp_path):
    env, cwd = fresh_machine(tmp_path, {ENV_VAR: json.dumps({"phase": "payload_stream", "step": 2,
                                                              "name": "blob.bin", "byte": 1})})
    result = fork_server.run([sys.executable, "-c", _SAVE, str(tmp_path / "store")], env=env, cwd=cwd,
                             capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "committed" in result.stdout, result.stderr
    assert CheckpointStore(tmp_path / "store").read(1, "blob.bin") == DATA


# -- the planner and the verdict -------------------------------------------------------------------

REF = Reference(
    log={a: {"attempted_update": a, "step": s, "ok": ok} for a, s, ok in
         [(1, 1, True), (2, 1, False), (3, 2, True), (4, 3, True), (5, 4, True)]},
    payloads={2: {"training_state.pt": 100, "rng.pt": 50, "empty": 0}, 4: {"training_state.pt": 100, "rng.pt": 50}},
)


def test_planner_draws_only_phases_the_start_still_reaches():
    assert reachable_phases(REF, 4, True, 1) == []  # resumed from the last checkpoint: nothing to kill
    assert plan_start(REF, 4, True, {}, random.Random(0)) is None
    fresh = reachable_phases(REF, None, False, 1)
    assert "retention_delete" not in fresh and set(fresh) == set(PHASES) - {"retention_delete"}
    # resumed from step 2 with no older step: one save left (4), and the resume parent stays
    # protected until a second one, so retention deletes nothing; with an older step it does
    assert "retention_delete" not in reachable_phases(REF, 2, False, 1)
    assert "retention_delete" in reachable_phases(REF, 2, True, 1)
    assert set(reachable_phases(REF, 2, True, 2)) == set(PHASES) - {"tier_upload", "async_write"}
    counts = {p: 1 for p in PHASES} | {"async_write": 0}
    plan = plan_start(REF, 2, True, counts, random.Random(0))
    assert plan.phase == "async_write" and plan.flags == ["--async-save"] and plan.kill["step"] == 4
    assert plan.kill["name"] in ("training_state.pt", "rng.pt") and 0 <= plan.kill["byte"] < 100
    for seed in range(20):  # a payload byte is always inside a non-empty payload of a later save
        plan = plan_start(REF, None, False, {p: 1 for p in PHASES} | {"payload_stream": 0}, random.Random(seed))
        assert plan.phase == "payload_stream" and plan.kill["byte"] < REF.payloads[plan.kill["step"]][plan.kill["name"]]


def _kills(phases: list[str]) -> list[dict]:
    return [{"phase": p, "where": "-", "tag": f"{i:03d}", "resume_problems": []} for i, p in enumerate(phases)]


def test_a_run_whose_kills_all_land_after_the_last_checkpoint_fails():
    kills = _kills(["after the last checkpoint"] * 50)
    text, problems = render(kills=kills, n=50, header=["# soak"])
    assert problems and "phases below the floor of 4 kills" in problems[0]
    assert "**FAILED**" in text and "PASSED" not in text
    assert "| `forward` |" in text and "| 0 | 0 of 0 |" in text


def test_the_verdict_passes_only_with_every_floor_and_every_resume_exact():
    balanced = _kills([PHASES[i % len(PHASES)] for i in range(50)])
    text, problems = render(kills=balanced, n=50, header=["# soak"])
    assert problems == [] and "**PASSED**: 50 kills, every phase at least 4, resumes bit-exact: 50 of 50" in text
    short = balanced[:-10] + _kills(["forward"] * 10)  # async_write keeps 4, but ...
    short = [k for k in short if k["phase"] != "tier_upload"] + _kills(["tier_upload"] * 3)
    assert verdict(short, 50) == [f"{len(short)} kills, 50 asked for", "phases below the floor of 4 kills: tier_upload (3)"]
    inexact = _kills([PHASES[i % len(PHASES)] for i in range(50)])
    inexact[7]["resume_problems"] = ["attempted update 5 differs from the reference's"]
    assert verdict(inexact, 50) == ["1 of 50 resumes not bit-exact"]


# -- the short form ---------------------------------------------------------------------------------

# One kill per phase: the floor of :func:`~opd_testkit.soak_phases.floor_for` is then 1, and the
# planner arms the least-killed phase a start reaches, so every phase is killed once. Each start is
# a forked ``opd-store train`` (0.5-1.5 s); more kills only repeat phases already proven.
KILLS = len(PHASES)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("where", ["local", "seaweed"])
def test_soak_short_form_reaches_every_phase_and_resumes_bit_exactly(where, request, fork_server, tmp_path):
    storage_env, store_args, options = {}, [], {}
    if where == "local":
        store_url = str(tmp_path / "store")
    else:
        server = request.getfixturevalue("seaweed_s3")
        backend = server.new_backend()
        store_url, options, storage_env = backend.url, server.storage_options(), server.environment()
        store_args = ["--s3-endpoint-url", server.endpoint_url]
    soak = Soak(store_url=store_url, storage_options=options, storage_env=storage_env, store_args=store_args,
                workdir=tmp_path, popen=fork_server.popen, timeout_secs=300)
    soak.run(KILLS, seed=5)
    text, problems = render(kills=soak.kills, n=KILLS, header=["# soak"], starts=soak.starts,
                            extra_problems=soak.start_problems + soak.report_problems)
    assert problems == [], text
    assert soak.report_problems == []  # opd-store report says where each start was killed and resumed
    assert len(soak.kills) == KILLS and {k["phase"] for k in soak.kills} == set(PHASES)
    assert all(k["resume_problems"] == [] for k in soak.kills)
    killed = [s for s in soak.starts if s.killed is not None]
    assert [s.killed["phase"] for s in killed] == [s.plan.phase for s in killed]  # each died where armed
