"""Multi-rank OPD checkpoints with real processes in a gloo process group: every rank gets its own
RNG state back, one rank's failure or kill commits nothing and fails every rank without a hang, and
a world-size change is refused on every rank naming both sizes.

Every rank is its own ``python tests/distributed/rank_worker.py`` process rendezvousing over TCP
on 127.0.0.1; S3 runs against the session's moto server. Each test waits for its processes with a
deadline, and the process group has a timeout, so a hang fails the test instead of stalling it.
The local stores of 2 and 4 ranks saving steps 2 and 4 are launched once per module
(``local_saves``) and shared by the tests that read them or refuse a save into a copy of them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from opd_testkit import forkserver
from opd_testkit.stores import Backend

from opd_store import CheckpointStore

WORKER = Path(__file__).with_name("rank_worker.py")
ROOT = Path(__file__).resolve().parents[2]
# Generous: on a loaded 2-core host four ranks importing torch take minutes; a hang still fails.
DEADLINE_SECS = 900
pytestmark = pytest.mark.timeout(2 * DEADLINE_SECS)


def launch(backend, world_size: int, scenario: str, out: Path, **extra) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    # A rendezvous file of this launch (no port to choose: parallel tests cannot collide on one).
    init_method = f"file://{out / f'rendezvous-{uuid.uuid4().hex}'}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = []
    for rank in range(world_size):
        spec = dict(rank=rank, world_size=world_size, init_method=init_method, url=backend.url,
                    storage_options=backend.storage_options, scenario=scenario, out=str(out), **extra)
        procs.append(forkserver.popen([sys.executable, str(WORKER), json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs: list[subprocess.Popen], out: Path) -> list[dict]:
    """Wait for every rank (deadline), then return each rank's report, index = rank."""
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=DEADLINE_SECS)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"a rank hung past {DEADLINE_SECS} s")
    reports = []
    for rank, log in enumerate(logs):
        path = out / f"rank-{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report; output:\n{log[-4000:]}"
        reports.append(json.loads(path.read_text()))
    return reports


def run_ranks(backend, world_size: int, scenario: str, out: Path, **extra) -> list[dict]:
    return finish(launch(backend, world_size, scenario, out, **extra), out)


def objects_under(backend, rel: str) -> list[str]:
    fs, root = backend.raw_fs(), backend.raw_root()
    try:
        return sorted(fs.find(f"{root}/{rel}"))
    except FileNotFoundError:
        return []


@pytest.fixture(params=["local", "s3"])
def mr_backend(request, tmp_path):
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture(scope="module")
def local_saves(tmp_path_factory):
    """``saved(world_size) -> (Backend, reports)``: a local store where ``world_size`` ranks saved
    steps 2 and 4 and resumed (scenario ``save_load``), launched at the first request of that size.
    Readers share it as is; a test that writes copies it (:func:`copied`)."""
    launched: dict[int, tuple[Backend, list[dict]]] = {}

    def saved(world_size: int) -> tuple[Backend, list[dict]]:
        if world_size not in launched:
            base = tmp_path_factory.mktemp(f"saved-by-{world_size}")
            backend = Backend("local", str(base / "store"), {})
            launched[world_size] = backend, run_ranks(backend, world_size, "save_load", base / "run", steps=[2, 4])
        return launched[world_size]

    return saved


def copied(backend: Backend, tmp_path: Path) -> Backend:
    """A copy of the local store ``backend`` under ``tmp_path``."""
    shutil.copytree(backend.url, tmp_path / "store")
    return Backend("local", str(tmp_path / "store"), {})


# the tests of the module's local stores share a worker, so each store is launched once
SHARES_LOCAL_SAVES = pytest.mark.xdist_group("multirank-local-saves")


@SHARES_LOCAL_SAVES
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_saves_its_part_and_gets_its_own_rng_back(mr_backend, world_size, local_saves, tmp_path):
    if mr_backend.name == "local":
        mr_backend, reports = local_saves(world_size)
    else:
        reports = run_ranks(mr_backend, world_size, "save_load", tmp_path / "run", steps=[2, 4])
    assert all("fatal" not in report for report in reports), [r.get("traceback") for r in reports]
    store = CheckpointStore(mr_backend.url, storage_options=mr_backend.storage_options)
    assert store.steps() == [2, 4]
    assert [store.status(step) for step in (2, 4)] == ["complete", "complete"]
    manifest = store.manifest(4)
    assert manifest.world_size == world_size
    names = [entry.name for entry in manifest.payloads]
    assert [name for name in names if name.startswith("rng")] == [f"rng-rank-{r:02d}.pt" for r in range(world_size)]
    assert {"training_state.pt", "config.yaml", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= set(names)
    # One attempt holds every rank's part.
    assert {entry.path.split("/")[0] for entry in manifest.payloads} == {manifest.attempt_id}
    for rank, report in enumerate(reports):
        assert [save["url"] for save in report["saves"]] == [store.step_url(2), store.step_url(4)]
        assert report["latest"] == store.step_url(4)
        assert report["resumed_step"] == 4
        # The state each rank had when step 4 was saved comes back to that rank.
        assert report["draws_after_load"] == report["saves"][1]["draws"]
    assert len({tuple(report["draws_after_load"]) for report in reports}) == world_size  # all differ


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_rank_fails_the_save_everywhere(mr_backend, fail_rank, tmp_path):
    reports = run_ranks(mr_backend, 2, "save_fail", tmp_path / "run", steps=[2, 4], fail_rank=fail_rank)
    assert all("fatal" not in report for report in reports), [r.get("traceback") for r in reports]
    store = CheckpointStore(mr_backend.url, storage_options=mr_backend.storage_options)
    errors = [report["saves"][-1]["error"] for report in reports]
    victim = "training_state.pt" if fail_rank == 0 else f"rng-rank-{fail_rank:02d}.pt"
    expected = (f"{store.step_url(4)}: step 4 was not committed: rank {fail_rank} failed: OSError: "
                f"injected write failure on rank {fail_rank} ({victim})")
    for report, error in zip(reports, errors):
        assert report["saves"][0] == {"step": 2, "url": store.step_url(2), "draws": report["saves"][0]["draws"]}
        assert error["type"] == "DistributedSaveError"
        assert error["message"] == expected
        assert error["failures"] == {str(fail_rank): f"OSError: injected write failure on rank {fail_rank} ({victim})"}
        assert {"CommitError", "OSError"} <= set(error["bases"])
    assert store.steps() == [2]
    assert store.latest_step() == 2
    assert store.status(2) == "complete"
    assert objects_under(mr_backend, "step-000004") == []  # every rank's part was discarded


def test_a_wrong_rank_argument_on_one_rank_fails_every_rank_without_a_hang(local_backend, tmp_path):
    """Rank 1 passes ``rank=0``: the check runs inside the first collective, so both ranks get the
    same error at once instead of rank 0 waiting on the collective until the group's timeout."""
    reports = run_ranks(local_backend, 2, "save_fail", tmp_path / "run", steps=[2], rank_args={"1": 0})
    store = CheckpointStore(local_backend.url)
    cause = "ValueError: rank 0 differs from the process group's rank 1"
    for report in reports:
        assert "fatal" not in report, report.get("traceback")
        error = report["saves"][0]["error"]
        assert error["type"] == "DistributedSaveError"
        assert error["message"] == f"{store.step_url(2)}: step 2 was not committed: rank 1 failed: {cause}"
        assert error["failures"] == {"1": cause}
    assert store.steps() == []
    assert objects_under(local_backend, "step-000002") == []


@SHARES_LOCAL_SAVES
def test_a_committed_step_is_refused_on_every_rank(local_saves, tmp_path):
    local_backend = copied(local_saves(2)[0], tmp_path)  # steps 2 and 4 committed by 2 ranks
    reports = run_ranks(local_backend, 2, "save_fail", tmp_path / "again", steps=[2])
    store = CheckpointStore(local_backend.url)
    for report in reports:
        error = report["saves"][0]["error"]
        assert error["type"] == "DistributedCommitConflictError"
        assert "FileExistsError" in error["bases"]
        assert error["message"].startswith(f"{store.step_url(2)}: step 2 was not committed: rank 0 failed: "
                                           "CommitConflictError: checkpoint already exists")


def test_a_killed_rank_commits_nothing_and_the_restarted_job_resumes(mr_backend, tmp_path):
    out = tmp_path / "run"
    procs = launch(mr_backend, 2, "save_block", out, steps=[2, 4], fail_rank=1)
    marker = out / "blocked"
    deadline = time.monotonic() + DEADLINE_SECS
    while not marker.exists():
        assert time.monotonic() < deadline, "rank 1 never reached the middle of its write"
        assert all(proc.poll() is None for proc in procs), "a rank exited before the kill"
        time.sleep(0.05)
    store = CheckpointStore(mr_backend.url, storage_options=mr_backend.storage_options)
    assert store.steps() == [2]
    os.kill(int(marker.read_text()), signal.SIGKILL)
    assert procs[1].wait(timeout=DEADLINE_SECS) == -signal.SIGKILL
    rank0_log = procs[0].communicate(timeout=DEADLINE_SECS)[0]
    report0 = json.loads((out / "rank-0.json").read_text())
    # Rank 0 learnt of the death through the collective and committed nothing.
    assert report0["saves"][-1]["step"] == 4 and "error" in report0["saves"][-1], rank0_log[-3000:]
    assert store.steps() == [2] and store.latest_step() == 2
    assert "manifest.json" not in " ".join(objects_under(mr_backend, "step-000004"))

    # The job restarted with the full world size resumes from step 2, each rank with its own RNG.
    first = {0: report0}
    resumed = run_ranks(mr_backend, 2, "resume", tmp_path / "resume")
    for rank, report in enumerate(resumed):
        assert "fatal" not in report, report.get("traceback")
        assert report["latest"] == store.step_url(2)
        assert report["resumed_step"] == 2
    assert resumed[0]["draws_after_load"] == first[0]["saves"][0]["draws"]
    assert resumed[0]["draws_after_load"] != resumed[1]["draws_after_load"]


@SHARES_LOCAL_SAVES
def test_world_size_change_is_refused_on_every_rank_naming_both_sizes(local_saves, tmp_path):
    local_backend = local_saves(4)[0]  # steps 2 and 4 saved by 4 ranks; only read here
    store = CheckpointStore(local_backend.url)
    reports = run_ranks(local_backend, 2, "load", tmp_path / "two", load_url=store.step_url(2))
    messages = set()
    for report in reports:
        error = report["load"]["error"]
        assert error["type"] == "ResumeMismatchError"
        messages.add(error["message"])
    (message,) = messages
    assert "saved with world_size 4 and this run has world_size 2" in message
