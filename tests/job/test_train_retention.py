"""``opd-store train --keep-last/--keep-every``: the main job applies the config's retention."""

from __future__ import annotations

import io
import json

import pytest
import yaml

from opd_store import CheckpointStore
from opd_store.cli import main
from opd_store.job import train
from opd_store.retention import RetentionPolicy
from opd_store.tiered import TieredStore


def _config(store: CheckpointStore, step: int) -> dict:
    return yaml.safe_load(store.read(step, "config.yaml"))


def test_keep_last_and_keep_every_trim_the_store_and_are_recorded(tmp_path):
    store_dir = tmp_path / "store"
    assert main(["train", "--store", str(store_dir), "--updates", "10", "--checkpoint-every", "2",
                 "--keep-last", "2", "--keep-every", "4", "--log", str(tmp_path / "log.jsonl")]) == 0
    store = CheckpointStore(store_dir)
    assert store.steps() == [4, 8, 10]  # 8 and 10 newest, 4 and 8 multiples of 4; 2 and 6 deleted
    assert all(store.is_complete(step) for step in (4, 8, 10))
    checkpoint = _config(store, 10)["checkpoint"]
    assert (checkpoint["keep_last"], checkpoint["keep_every"], checkpoint["every_updates"]) == (2, 4, 2)


def test_without_retention_every_checkpoint_is_kept_and_the_config_says_so(tmp_path):
    store_dir = tmp_path / "store"
    assert main(["train", "--store", str(store_dir), "--updates", "6", "--checkpoint-every", "2",
                 "--log", str(tmp_path / "log.jsonl")]) == 0
    store = CheckpointStore(store_dir)
    assert store.steps() == [2, 4, 6]
    checkpoint = _config(store, 6)["checkpoint"]
    assert (checkpoint["keep_last"], checkpoint["keep_every"]) == (None, None)


def test_with_a_local_tier_keep_last_is_the_buckets_retention(tmp_path):
    bucket, local = tmp_path / "bucket", tmp_path / "local"
    assert main(["train", "--store", str(bucket), "--local-tier", str(local), "--updates", "8",
                 "--checkpoint-every", "2", "--keep-last", "3", "--log", str(tmp_path / "log.jsonl")]) == 0
    assert CheckpointStore(bucket).steps() == [4, 6, 8]
    assert CheckpointStore(local).steps() == [6, 8]  # the local tier's own default: newest two
    assert _config(CheckpointStore(bucket), 8)["checkpoint"]["keep_last"] == 3


class _StepsAtEachSave(io.StringIO):
    """An ``events`` stream that records the store's steps when each ``saved`` event is written."""

    def __init__(self, store: CheckpointStore) -> None:
        super().__init__()
        self.store = store
        self.steps_after: dict[int, list[int]] = {}

    def write(self, text: str) -> int:
        for line in text.splitlines():
            event = json.loads(line)
            if event["event"] == "saved":
                self.steps_after[event["step"]] = self.store.steps()
        return super().write(text)


def test_the_step_a_run_resumed_from_survives_keep_last_1_until_a_second_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    first = train(store=store, updates=6, checkpoint_every=2, log=io.StringIO())
    assert [save["step"] for save in first.saves] == [2, 4, 6]
    store.delete(6)
    store.delete(4)  # as if the first run had been killed after its save of step 2
    first_run_id = store.manifest(2).metadata["run_id"]
    assert store.manifest(2).metadata["parent_step"] is None
    events = _StepsAtEachSave(store)
    second = train(store=store, updates=6, checkpoint_every=2, log=io.StringIO(), events=events,
                   retention=RetentionPolicy(keep_last=1))
    assert second.resumed_step == 2
    assert events.steps_after == {4: [2, 4], 6: [6]}  # 2 is the parent until the run's second save
    metadata = store.manifest(6).metadata
    assert metadata["parent_step"] == 2
    assert len(metadata["run_id"]) == 32 and metadata["run_id"] != first_run_id


def test_async_saves_with_keep_last_1_report_every_save(tmp_path):
    store_dir = tmp_path / "store"
    events = tmp_path / "events.jsonl"
    assert main(["train", "--store", str(store_dir), "--updates", "4", "--checkpoint-every", "1", "--async-save",
                 "--keep-last", "1", "--log", str(tmp_path / "log.jsonl"), "--events", str(events)]) == 0
    saved = [json.loads(line) for line in events.read_text().splitlines() if '"saved"' in line]
    assert [event["step"] for event in saved] == [1, 2, 3, 4]
    assert saved[-1]["size_bytes"] == CheckpointStore(store_dir).manifest(4).total_size_bytes
    assert CheckpointStore(store_dir).steps() == [4]


def test_retention_for_a_tiered_store_that_has_a_bucket_hook_is_refused_before_training(tmp_path):
    store = TieredStore(tmp_path / "local", tmp_path / "bucket", bucket_retention=RetentionPolicy(keep_last=1))
    with store, pytest.raises(ValueError, match="already has bucket retention RetentionPolicy\\(keep_last=1"):
        train(store=store, updates=2, checkpoint_every=1, retention=RetentionPolicy(keep_last=2))
    assert store.local_steps() == [] and store.durable_steps() == []


def test_keep_last_zero_is_refused_with_exit_2(tmp_path, capsys):
    assert main(["train", "--store", str(tmp_path / "store"), "--updates", "2", "--keep-last", "0"]) == 2
    assert "--keep-last: must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()
