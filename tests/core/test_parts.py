"""Parts of a multi-rank save: payloads under a shared attempt, one manifest.

``store.begin_part`` writes a rank's payloads under the committing rank's attempt and never a
manifest; the committing rank records the part's entries with ``add_entry`` and commits.
"""

from __future__ import annotations

import pytest

from opd_store import CheckpointStore
from opd_store.errors import CommitConflictError, IncompleteCheckpointError
from opd_store.format import crc32c_hex


def _store(backend) -> CheckpointStore:
    return CheckpointStore(backend.url, storage_options=backend.storage_options)


def test_parts_of_two_ranks_commit_under_one_manifest(backend):
    store = _store(backend)
    txn = store.begin(7, world_size=3)
    txn.write_bytes("shared.bin", b"shared" * 100)
    part_stores = [_store(backend), _store(backend)]  # each rank has its own client
    sealed = []
    for rank, part_store in enumerate(part_stores, start=1):
        with part_store.begin_part(7, attempt_id=txn.attempt_id, rank=rank, world_size=3) as part:
            part.write_bytes(f"rng-rank-{rank:02d}.pt", bytes([rank]) * (1000 * rank))
        sealed.append(part.entries)
    assert store.storage.size("step-000007/manifest.json") is None
    for entries in sealed:
        for entry in entries:
            txn.add_entry(entry)
    assert txn.commit() == store.step_url(7)

    manifest = store.manifest(7)
    assert manifest.world_size == 3
    assert [e.name for e in manifest.payloads] == ["shared.bin", "rng-rank-01.pt", "rng-rank-02.pt"]
    assert [e.size_bytes for e in manifest.payloads] == [600, 1000, 2000]
    assert manifest.entry("rng-rank-02.pt").crc32c == crc32c_hex(b"\x02" * 2000)
    assert store.read(7, "rng-rank-01.pt") == b"\x01" * 1000
    assert store.status(7) == "complete"


def test_a_failed_part_deletes_only_its_own_payloads(backend):
    store = _store(backend)
    txn = store.begin(3, world_size=3)
    with store.begin_part(3, attempt_id=txn.attempt_id, rank=1, world_size=3) as good:
        good.write_bytes("rng-rank-01.pt", b"one")
    with pytest.raises(OSError, match="disk full"):
        with _store(backend).begin_part(3, attempt_id=txn.attempt_id, rank=2, world_size=3) as bad:
            bad.write_bytes("rng-rank-02.pt", b"two")
            with bad.open("rank-02/extra.pt") as writer:
                writer.write(b"partial")
                raise OSError("disk full")
    listed = store.storage.list_tree(f"step-000003/{txn.attempt_id}")
    assert listed == {"rng-rank-01.pt": 3}
    txn.abort()  # the committing rank's abort removes every part
    assert store.storage.list_tree("step-000003") == {}
    assert store.steps() == []


def test_a_part_cannot_commit_or_start_on_a_committed_step(local_backend):
    store = _store(local_backend)
    txn = store.begin(5, world_size=2)
    part = store.begin_part(5, attempt_id=txn.attempt_id, rank=1, world_size=2)
    assert not hasattr(part, "commit")  # a part is no transaction: only the committing rank commits
    with store.begin(4) as done:
        done.write_bytes("a", b"a")
    with pytest.raises(CommitConflictError, match="step 4 is committed"):
        store.begin_part(4, attempt_id=txn.attempt_id, rank=1, world_size=2)
    with pytest.raises(ValueError, match="not of the form"):
        store.begin_part(5, attempt_id="attempt-x", rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        store.begin_part(5, attempt_id=txn.attempt_id, rank=2, world_size=2)


def test_sealing_with_an_open_writer_discards_the_part(local_backend):
    store = _store(local_backend)
    txn = store.begin(6, world_size=2)
    part = store.begin_part(6, attempt_id=txn.attempt_id, rank=1, world_size=2)
    part.write_bytes("rng-rank-01.pt", b"x" * 10)
    part.open("late.pt").write(b"y")
    with pytest.raises(IncompleteCheckpointError, match=r"rank 1 payloads \['late.pt'\]"):
        part.seal()
    assert store.storage.list_tree("step-000006") == {}
