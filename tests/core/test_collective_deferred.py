"""The deferred commit of :func:`opd_store.pipeline.run_save_collective`: two ranks as two threads
of this process (a group of the same collectives over a barrier), rank 0 handing its own write,
the commit and the after-commit stage to a queue it runs afterwards, as a background owner does."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from opd_store import CheckpointStore
from opd_store.pipeline import AfterCommit, SaveRequest, run_save_collective


class ThreadGroup:
    """``world_size`` threads' collectives (``all_gather``, ``broadcast``), in call order."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._slots: list = [None] * world_size

    def member(self, rank: int) -> "ThreadGroup.Member":
        return ThreadGroup.Member(self, rank)

    class Member:
        def __init__(self, group: "ThreadGroup", rank: int) -> None:
            self.group, self.rank, self.world_size = group, rank, group.world_size

        def all_gather(self, obj):
            self.group._slots[self.rank] = obj
            self.group._barrier.wait(30)
            gathered = list(self.group._slots)
            self.group._barrier.wait(30)  # nobody overwrites a slot before every rank has read it
            return gathered

        def broadcast(self, obj):
            return self.all_gather(obj)[0]


def _save(store, group, deferred: list, released: list, *, fail_rank0_write: bool = False):
    def run(rank: int):
        def write(txn, shared: bool) -> None:
            if rank == 0 and fail_rank0_write:
                raise OSError("rank 0's payload could not be written")
            txn.write_bytes(f"part-{rank}.bin", bytes([rank]) * 8)

        def prepare() -> SaveRequest:
            return SaveRequest(AfterCommit(store, 2), world_size=2, metadata={"run": "a"}, write=write,
                               release=lambda: released.append(rank))

        return run_save_collective(group.member(rank), prepare, defer=deferred.append)

    with ThreadPoolExecutor(2) as pool:
        return [future.result(60) for future in [pool.submit(run, rank) for rank in (0, 1)]]


def test_every_rank_returns_before_the_commit_and_rank_0_commits_both_parts_later(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    deferred: list = []
    released: list[int] = []
    url0, url1 = _save(store, ThreadGroup(2), deferred, released)
    assert (url0, url1) == (None, None) and len(deferred) == 1
    # rank 1's part is sealed and its snapshot released; rank 0 has written nothing yet
    assert released == [1] and store.steps() == []
    assert [path.split("/")[-1] for path in store.storage.list_tree("step-000002")] == ["part-1.bin"]

    assert deferred[0]() == store.step_url(2)
    assert released == [1, 0] and store.steps() == [2]
    manifest = store.manifest(2)
    assert manifest.world_size == 2 and manifest.metadata == {"run": "a"}
    assert {entry.name: entry.size_bytes for entry in manifest.payloads} == {"part-0.bin": 8, "part-1.bin": 8}
    assert store.read(2, "part-1.bin") == b"\x01" * 8 and store.verify(2, deep=True).ok


def test_a_deferred_write_that_fails_deletes_the_attempt_with_every_part(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    deferred: list = []
    released: list[int] = []
    _save(store, ThreadGroup(2), deferred, released, fail_rank0_write=True)
    assert store.storage.list_tree("step-000002") != {}  # rank 1's part is there until the finish
    with pytest.raises(OSError, match="rank 0's payload could not be written"):
        deferred[0]()
    assert released == [1, 0] and store.steps() == [] and store.storage.list_tree("step-000002") == {}
