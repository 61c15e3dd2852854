"""Local checkpoint directories in and out of a store (opd_store.integrations._files and hf_layout)."""

from __future__ import annotations

import os

import pytest

from opd_store import CheckpointStore, IncompleteCheckpointError, IntegrityError
from opd_store.integrations._files import directory_files, fetch_step, snapshot_files, upload_files
from opd_store.integrations._hf_layout import files_of_rank, missing_files, owner_rank


def _directory(tmp_path):
    root = tmp_path / "checkpoint-3"
    (root / "sub").mkdir(parents=True)
    (root / "optimizer.pt").write_bytes(b"o" * 5000)
    (root / "sub" / "shard.bin").write_bytes(b"s" * 300)
    return root


def test_hard_linked_snapshot_survives_deletion_and_commits_the_bytes_it_had(tmp_path):
    root = _directory(tmp_path)
    store = CheckpointStore(tmp_path / "store")
    snaps = snapshot_files(directory_files(root), tmp_path / "staging")
    assert os.stat(snaps["optimizer.pt"].path).st_ino == os.stat(root / "optimizer.pt").st_ino  # a link, no copy
    for path in root.rglob("*"):
        if path.is_file():
            path.unlink()  # what save_total_limit does before the next on_save
    with store.begin(3) as txn:
        assert upload_files(txn, snaps.values()) == 5300
    assert store.read(3, "optimizer.pt") == b"o" * 5000 and store.read(3, "sub/shard.bin") == b"s" * 300


def test_a_file_rewritten_in_place_is_not_committed(tmp_path):
    root = _directory(tmp_path)
    store = CheckpointStore(tmp_path / "store")
    snaps = snapshot_files(directory_files(root), tmp_path / "staging")
    with open(root / "optimizer.pt", "wb") as handle:  # truncates the shared inode, as torch.save does
        handle.write(b"n" * 10)
    with pytest.raises(IncompleteCheckpointError, match=r"'optimizer\.pt' of step 3 not uploaded"):
        with store.begin(3) as txn:
            upload_files(txn, snaps.values())
    assert store.steps() == [] and store.checkpoints() == []  # nothing committed, nothing left


def test_fetch_verifies_every_file_and_publishes_nothing_on_a_mismatch(tmp_path):
    root = _directory(tmp_path)
    store = CheckpointStore(tmp_path / "store")
    with store.begin(3) as txn:
        upload_files(txn, snapshot_files(directory_files(root), tmp_path / "staging").values())
    target = fetch_step(store, 3, tmp_path / "local" / "checkpoint-3")
    assert (target / "sub" / "shard.bin").read_bytes() == b"s" * 300
    payload = next((tmp_path / "store").glob("step-000003/attempt-*/optimizer.pt"))
    payload.write_bytes(b"x" * 5000)  # same size, other bytes
    with pytest.raises(IntegrityError, match="optimizer.pt"):
        fetch_step(store, 3, tmp_path / "other" / "checkpoint-3")
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == []


def test_rank_ownership_and_expected_files(tmp_path):
    assert owner_rank("rng_state_1.pth", 2) == 1 and owner_rank("rng_state.pth", 1) == 0
    assert owner_rank("pytorch_model_fsdp_0/__1_0.distcp", 2) == 1 and owner_rank("optimizer.pt", 2) == 0
    with pytest.raises(ValueError, match="belongs to rank 3"):
        owner_rank("rng_state_3.pth", 2)
    names = {name: tmp_path / name for name in ("rng_state_0.pth", "rng_state_1.pth", "optimizer.pt")}
    assert set(files_of_rank(names, 1, 2)) == {"rng_state_1.pth"}
    for path in names.values():
        path.write_bytes(b"x")
    problems = missing_files(files_of_rank(names, 0, 2), rank=0, world_size=2)
    assert "trainer_state.json is missing" in problems and "scheduler.pt is missing" in problems
    assert any(p.startswith("no model weights") for p in problems)
    assert missing_files(files_of_rank(names, 1, 2), rank=1, world_size=2) == []
