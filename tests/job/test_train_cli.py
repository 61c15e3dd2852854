"""``opd-store train``: bad input is refused with one line and the documented exit code, before
any training starts; a short run checkpoints and resumes from its store."""

from __future__ import annotations

import json
import sys

import pytest
from opd_testkit import forkserver

from opd_store import CheckpointStore
from opd_store.cli import main


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_missing_bucket_exits_2_naming_url_and_cause(moto_s3, capsys):
    code = main(["train", "--store", "s3://no-such-bucket/run", "--s3-endpoint-url", moto_s3.endpoint_url,
                 "--updates", "2"])
    assert code == 2
    lines = _stderr_lines(capsys)
    assert lines == ["opd-store train: error: s3://no-such-bucket/run: bucket 'no-such-bucket' does not exist"]


def test_unreachable_endpoint_exits_2(capsys):
    # No retry settings: the check's own (one retry) answer at once for a refused connection.
    code = main(["train", "--store", "s3://bucket/run", "--s3-endpoint-url", "http://127.0.0.1:9", "--updates", "2"])
    assert code == 2
    assert _stderr_lines(capsys) == [
        "opd-store train: error: s3://bucket/run: cannot list the store: endpoint http://127.0.0.1:9 refused the connection"]


def test_missing_credentials_exits_2(moto_s3, capsys, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    moto_s3.new_backend()
    code = main(["train", "--store", "s3://opd-test/run", "--s3-endpoint-url", moto_s3.endpoint_url, "--updates", "2"])
    assert code == 2
    assert _stderr_lines(capsys) == [
        "opd-store train: error: s3://opd-test/run: cannot list the store: no credentials found (AWS_ACCESS_KEY_ID "
        "and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws, instance role)"]


def test_storage_option_without_equals_exits_2(tmp_path, capsys):
    code = main(["train", "--store", str(tmp_path), "--updates", "2", "--storage-option", "endpoint_url"])
    assert code == 2
    assert _stderr_lines(capsys) == ["opd-store train: error: --storage-option expects KEY=VALUE, got 'endpoint_url'"]


def test_train_then_resume_step_that_is_not_complete(tmp_path, capsys):
    store_dir = tmp_path / "store"
    log = tmp_path / "log.jsonl"
    assert main(["train", "--store", str(store_dir), "--updates", "4", "--checkpoint-every", "2",
                 "--log", str(log), "--events", str(tmp_path / "events.jsonl")]) == 0
    store = CheckpointStore(store_dir)
    assert store.steps() == [2, 4]
    assert [store.status(step) for step in (2, 4)] == ["complete", "complete"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[-1]["step"] == 4
    assert len(records) == records[-1]["attempted_update"] >= 4
    manifest = store.manifest(4)
    assert manifest.metadata["successful_updates"] == 4
    assert manifest.metadata["attempted_updates"] == records[-1]["attempted_update"]
    capsys.readouterr()

    code = main(["train", "--store", str(store_dir), "--updates", "4", "--resume", "3"])
    assert code == 3
    (line,) = _stderr_lines(capsys)
    assert line == (f"opd-store train: error: --resume 3: step 3 is not a complete checkpoint in {store_dir}; "
                    "complete steps: [2, 4]")

    # Resuming from step 2 redoes updates 3-4 exactly: the same losses as the first run.
    log2 = tmp_path / "log2.jsonl"
    other = tmp_path / "other"
    store_copy = CheckpointStore(other)
    # copy step 2 through the store API into a fresh store, then resume there
    with store_copy.begin(2, metadata=dict(store.manifest(2).metadata)) as txn:
        for name in store.names(2):
            txn.write_bytes(name, store.read(2, name))
    assert main(["train", "--store", str(other), "--updates", "4", "--checkpoint-every", "2",
                 "--log", str(log2), "--events", str(tmp_path / "events2.jsonl")]) == 0
    resumed = [json.loads(line) for line in log2.read_text().splitlines()]
    by_update = {r["attempted_update"]: r for r in records}
    assert resumed, "the resumed run did no update"
    for record in resumed:
        assert record == by_update[record["attempted_update"]]
    assert resumed[-1] == records[-1]
    events = [json.loads(line) for line in (tmp_path / "events2.jsonl").read_text().splitlines()]
    assert events[0] == {"event": "resumed", "url": f"{other}/step-000002", "step": 2}


def test_resume_with_changed_updates_is_refused_exit_5(tmp_path, capsys):
    store_dir = tmp_path / "store"
    assert main(["train", "--store", str(store_dir), "--updates", "2", "--checkpoint-every", "2",
                 "--log", str(tmp_path / "log"), "--events", str(tmp_path / "ev")]) == 0
    capsys.readouterr()
    code = main(["train", "--store", str(store_dir), "--updates", "3", "--log", str(tmp_path / "log2"),
                 "--events", str(tmp_path / "ev2")])
    assert code == 5
    text = capsys.readouterr().err
    assert text.startswith(f"opd-store train: error: cannot resume OPD checkpoint {store_dir}/step-000002")
    assert "training.total_updates: saved 2, current 3" in text


def _committed_step(store_dir, step: int, **metadata) -> None:
    """A committed step whose manifest says how it was saved (the job refuses the wrong kind
    before it reads any payload or builds a model)."""
    with CheckpointStore(store_dir).begin(step, metadata=metadata) as txn:
        with txn.open("payload.bin") as handle:
            handle.write(b"not read")


def test_sharded_checkpoint_without_shard_names_the_flag_exit_5(tmp_path, capsys):
    store_dir = tmp_path / "store"
    _committed_step(store_dir, 20, opd_schema="opd_sharded_v1")
    code = main(["train", "--store", str(store_dir), "--updates", "40", "--log", str(tmp_path / "log")])
    assert code == 5
    assert _stderr_lines(capsys) == [
        f"opd-store train: error: step 20 at {store_dir}/step-000020 is a sharded checkpoint (saved with --shard, "
        "world size 1); pass --shard to resume it"]


def test_replicated_checkpoint_with_shard_names_the_flag_exit_5(tmp_path):
    store_dir = tmp_path / "store"
    _committed_step(store_dir, 20, opd_schema="opd_checkpoint_v1")
    result = forkserver.run([sys.executable, "-m", "opd_store", "train", "--store", str(store_dir), "--updates", "40",
                             "--shard", "--start-method", "fork", "--log", str(tmp_path / "log")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 5, result.stderr[-4000:]
    assert (f"opd-store train: error: rank 0: step 20 at {store_dir}/step-000020 is a replicated checkpoint "
            "(saved without --shard); resume it without --shard\n") in result.stderr
    assert "load_opd_checkpoint" not in result.stderr



@pytest.mark.parametrize("extra", [["--nproc", "2", "--async-save"], ["--shard", "--local-tier", "LOCAL"],
                                   ["--nproc", "2", "--shard", "--async-save"]])
def test_several_ranks_refuse_async_save_and_local_tier_exit_2(tmp_path, capsys, extra):
    extra = [str(tmp_path / "local") if arg == "LOCAL" else arg for arg in extra]
    assert main(["train", "--store", str(tmp_path / "store"), "--updates", "2", *extra]) == 2
    assert _stderr_lines(capsys) == [
        "opd-store train: error: --nproc > 1 and --shard cannot be combined with --async-save or --local-tier"]
    assert not (tmp_path / "store").exists() and not (tmp_path / "local").exists()  # refused before anything ran
