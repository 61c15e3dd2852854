"""``opd-store train`` on a store whose newest committed step is damaged after its commit.

A truncated payload and a flipped byte are the same fault and get the same answer: the damaged
step is skipped with a warning naming the step and the file, and because the run would have to
save that step again (a committed step is never replaced), it stops before any update with one
line naming the step, the damage and the command that removes it (exit 4), instead of redoing
updates and dying at the commit on every restart. After ``opd-store delete`` (which refuses an
intact step) the same command resumes from the step before and runs to the end. Nothing committed
is changed by any of these runs. Local store and S3 (moto).
"""

from __future__ import annotations

import json

import pytest
from opd_testkit.damage import damage_payload
from opd_testkit.stores import Backend

from opd_store import CheckpointStore
from opd_store.cli import main

UPDATES = ["--updates", "4", "--checkpoint-every", "2"]


def _objects(backend, step: int) -> dict[str, bytes]:
    """Every object of ``step`` (path relative to the store root) with its bytes, read raw."""
    fs, root = backend.raw_fs(), backend.raw_root()
    prefix = f"{root}/step-{step:06d}"
    return {path[len(root) + 1:]: fs.cat_file(path) for path in fs.find(prefix)}


def _damage(backend, kind: str) -> str:
    """Truncate, or flip one byte of, step 4's ``training_state.pt``; its path in the store."""
    return damage_payload(backend, 4, "training_state.pt", kind)


def _cli_options(backend) -> list[str]:
    return ["--s3-endpoint-url", backend.storage_options["endpoint_url"]] if backend.name == "s3" else []


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.parametrize(("backend_name", "kind"), [("local", "truncate"), ("local", "flip"), ("s3", "flip")])
def test_damaged_newest_step_stops_before_training_then_resumes_after_delete(backend_name, kind, request, tmp_path,
                                                                              capsys, caplog):
    # opd_s3_backend: the raw reads of _objects and the damage share this process's botocore session
    # (a client of a new session parses botocore's S3 model again: 0.2-0.3 CPU-s each)
    backend = (request.getfixturevalue("opd_s3_backend") if backend_name == "s3"
               else Backend("local", str(tmp_path / "store"), {}))
    opts = _cli_options(backend)
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    assert main(["train", "--store", backend.url, *opts, *UPDATES, "--log", str(tmp_path / "ref.log")]) == 0
    assert store.steps() == [2, 4]
    damaged_file = _damage(backend, kind)
    step2, step4 = _objects(backend, 2), _objects(backend, 4)
    capsys.readouterr()

    for attempt in range(2):  # every restart gives the same answer, and trains nothing
        log = tmp_path / f"refused{attempt}.log"
        caplog.clear()
        assert main(["train", "--store", backend.url, *opts, *UPDATES, "--log", str(log)]) == 4
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert not _records(log)
        skipped = [r.getMessage() for r in caplog.records if "skipped step 4" in r.getMessage()]
        assert len(skipped) == 1 and damaged_file.split("/", 1)[1] in skipped[0]
        assert ("corrupt: " if kind == "flip" else "incomplete: ") in skipped[0]
        error = lines[-1]
        assert error.startswith(f"opd-store train: error: {store.step_url(4)}: step 4 is damaged (")
        assert damaged_file.split("/", 1)[1] in error
        assert error.endswith(f"this run (resuming from step 2, --updates 4) would save step 4 again, which a "
                              f"committed step never allows; training did not start: keep what you need of it, "
                              f"remove it with `opd-store delete {store.url} 4`, then rerun the same command")
        assert _objects(backend, 2) == step2 and _objects(backend, 4) == step4  # nothing committed changed

    # `delete` refuses an intact step, removes the damaged one.
    assert main(["delete", backend.url, "2", *opts]) == 6
    assert _objects(backend, 2) == step2
    assert main(["delete", backend.url, "4", *opts]) == 0
    assert store.steps() == [2]

    log = tmp_path / "resumed.log"
    events = tmp_path / "resumed.events"
    assert main(["train", "--store", backend.url, *opts, *UPDATES, "--log", str(log), "--events", str(events)]) == 0
    assert _records(events)[0] == {"event": "resumed", "url": store.step_url(2), "step": 2}
    assert store.steps() == [2, 4] and store.verify(4, deep=True).ok
    assert _objects(backend, 2) == step2
    reference = {r["attempted_update"]: r for r in _records(tmp_path / "ref.log")}
    resumed = _records(log)
    assert [r["step"] for r in resumed] == [3, 4]
    assert all(r == reference[r["attempted_update"]] for r in resumed)  # the exact same updates 3-4


def test_committed_step_ahead_of_explicit_resume_is_refused_before_training(tmp_path, capsys):
    store_dir = tmp_path / "store"
    assert main(["train", "--store", str(store_dir), *UPDATES, "--log", str(tmp_path / "ref.log")]) == 0
    capsys.readouterr()
    for resume, resuming in (("2", "resuming from step 2"), ("never", "starting from scratch")):
        log = tmp_path / f"{resume}.log"
        assert main(["train", "--store", str(store_dir), *UPDATES, "--resume", resume, "--log", str(log)]) == 6
        assert not _records(log)
        first = 2 if resume == "never" else 4
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"opd-store train: error: {store_dir}/step-{first:06d}: step {first} is already committed and this run "
            f"({resuming}, --updates 4) would save it again; training did not start: rerun with --resume auto to "
            "continue from it")
    # Only the steps the run's cadence saves count: every 3 to update 3 saves step 3 alone, so the
    # committed 2 and 4 are no obstacle (before, refused as "would save step 2 again"); with
    # --checkpoint-every auto the interval moves, so every committed step ahead still counts.
    def committed():
        return {path: path.read_bytes() for step in (2, 4) for path in (store_dir / f"step-{step:06d}").rglob("*")
                if path.is_file()}

    before = committed()
    log = tmp_path / "every3.log"
    assert main(["train", "--store", str(store_dir), "--updates", "3", "--checkpoint-every", "3", "--resume", "never",
                 "--log", str(log)]) == 0
    records = _records(log)
    assert (records[0]["attempted_update"], records[-1]["step"]) == (1, 3)  # from scratch to update 3
    store = CheckpointStore(store_dir)
    assert store.steps() == [2, 3, 4] and store.verify(3, deep=True).ok
    assert committed() == before and len(before) > 2
    capsys.readouterr()
    assert main(["train", "--store", str(store_dir), "--updates", "3", "--checkpoint-every", "auto:3",
                 "--resume", "never"]) == 6
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"opd-store train: error: {store_dir}/step-000002: step 2 is already committed and this run (starting from "
        "scratch, --updates 3) would save it again")
