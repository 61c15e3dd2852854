"""Racing writers of one step: exactly one commits, every other gets the conflict error, and the
committed checkpoint is wholly the winner's.

Threads (8 writers, each with its own store instance) run on every backend; separate processes
(4 writers, ``tests/proc_writer.py``) on local, S3 (moto) and GCS (``memory://`` is per process).
The threads' S3 race runs on moto and on SeaweedFS (a production S3 server, which enforces
``If-None-Match: *`` itself); the server decides a race the same way whether its writers are
threads or processes, so the processes' race runs on moto only. Every
writer streams its payloads first and then waits at a barrier (``threading.Barrier`` for threads,
a line over a pipe for processes), so the manifest creates really happen together.
"""

from __future__ import annotations

import threading

import pytest
from proc_writer import PAYLOAD_NAMES, payloads_for

from opd_store import CommitConflictError, OpdStoreError
from opd_store.storage import Meaning, classify

from .helpers import Proc, open_store

THREAD_WRITERS = 8
PROCESS_WRITERS = 4
STEP = 5


def _check_winner(backend, raw, winner_tag: str, winner_attempt: str) -> None:
    store = open_store(backend)
    manifest = store.manifest(STEP)
    assert manifest.attempt_id == winner_attempt
    assert manifest.metadata == {"tag": winner_tag}
    assert sorted(e.name for e in manifest.payloads) == sorted(PAYLOAD_NAMES)
    expected = payloads_for(winner_tag)
    for name, data in expected.items():
        assert store.read(STEP, name) == data
        assert raw.cat(f"step-{STEP:06d}/{winner_attempt}/{name}") == data
    assert store.is_complete(STEP) and store.latest_step() == STEP
    assert store.verify(STEP, deep=True).ok
    # The losers removed their own attempts; nothing else is under the step.
    assert set(raw.keys()) == {f"step-{STEP:06d}/manifest.json"} | {
        f"step-{STEP:06d}/{winner_attempt}/{name}" for name in PAYLOAD_NAMES
    }


@pytest.mark.parametrize("backend", ["local", "memory", "s3", "seaweed", "gcs"], indirect=True)
def test_thread_writers_of_one_step(backend, raw):
    stores = [open_store(backend) for _ in range(THREAD_WRITERS)]
    barrier = threading.Barrier(THREAD_WRITERS, timeout=120)
    outcomes: dict[int, tuple] = {}

    def writer(index: int) -> None:
        tag = f"thread-{index}"
        try:
            txn = stores[index].begin(STEP, metadata={"tag": tag})
            for name, data in payloads_for(tag).items():
                txn.write_bytes(name, data)
        except BaseException as exc:  # noqa: BLE001
            barrier.abort()
            outcomes[index] = ("setup-error", repr(exc), None)
            return
        barrier.wait()
        try:
            txn.commit()
            outcomes[index] = ("committed", tag, txn.attempt_id)
        except BaseException as exc:  # noqa: BLE001
            outcomes[index] = ("error", exc, txn.attempt_id)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(THREAD_WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(outcomes) == THREAD_WRITERS, outcomes
    winners = [o for o in outcomes.values() if o[0] == "committed"]
    losers = [o for o in outcomes.values() if o[0] != "committed"]
    assert len(winners) == 1, outcomes
    assert len(losers) == THREAD_WRITERS - 1
    _, winner_tag, winner_attempt = winners[0]
    for kind, exc, _attempt in losers:
        assert kind == "error", (kind, exc)
        assert isinstance(exc, CommitConflictError), repr(exc)
        assert isinstance(exc, FileExistsError) and isinstance(exc, OpdStoreError)
        assert f"committed by attempt {winner_attempt}" in str(exc)
        # The backend's refusal, kept: s3fs raises FileExistsError for a 412 that names its condition
        # (moto, AWS) and a plain OSError for SeaweedFS's 412 (no <Condition>); both mean a lost race.
        assert classify(exc.__cause__) is Meaning.LOST_RACE, repr(exc.__cause__)
    _check_winner(backend, raw, winner_tag, winner_attempt)


@pytest.mark.parametrize("backend", ["local", "s3", "gcs"], indirect=True)
def test_process_writers_of_one_step(backend, raw):
    procs = [Proc(backend, "save", str(STEP), f"proc-{i}", "--wait-before-commit") for i in range(PROCESS_WRITERS)]
    try:
        for proc in procs:
            proc.expect("ready")  # every writer has streamed its payloads and waits
        for proc in procs:
            proc.send("go")
        results = [proc.result() for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    committed = [(i, r) for i, r in enumerate(results) if r["outcome"] == "committed"]
    assert len(committed) == 1, results
    for i, result in enumerate(results):
        if result["outcome"] != "committed":
            assert result == {
                "outcome": "conflict", "attempt_id": result["attempt_id"], "error": "CommitConflictError",
                "at": "commit", "is_file_exists": True,
            }, result
    index, winner = committed[0]
    _check_winner(backend, raw, f"proc-{index}", winner["attempt_id"])
