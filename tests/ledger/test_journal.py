"""The run journal on real stores: create-only event objects outside every step prefix, read back
in order, never seen as steps by listings, ``ls``, ``verify`` or ``gc``; one extra request per
save (counted against botocore's own count on moto); bounded by ``gc``; damaged events skipped
with a warning by the reader; price files refused naming the file and the field."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from opd_testkit.s3 import S3RequestCounter
from opd_testkit.stores import open_store, raw_put

from opd_store.cli import main
from opd_store.errors import JournalEventError, PriceTableError
from opd_store.format import JOURNAL_PREFIX
from opd_store.ledger import (
    MAX_EVENT_BYTES,
    SCHEMA_VERSION,
    Journal,
    list_journal,
    load_price_file,
    parse_event,
    read_journal,
    report_store,
)
from opd_store.retention import RetentionPolicy, collect_garbage, survey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_helpers import cli_store_args  # noqa: E402


def _commit(store, step: int) -> None:
    with store.begin(step, metadata={"successful_updates": step}) as txn:
        txn.write_bytes("model.bin", bytes([step]) * 64)


def _save_fields(step: int, **extra) -> dict:
    return dict(step=step, reason="periodic", size_bytes=64, blocking_secs=0.5, commit_secs=0.6,
                requests={"put": 2, "list": 1}, attempted_updates=step, update_secs=float(step),
                next_checkpoint_every=2, **extra)


def _run(journal: Journal, t0: float, steps: list[int], *, exit_outcome: str | None = "finished") -> None:
    """A start's events at times t0, t0 + 1, ... (the writer's clock, given)."""
    times = iter(t0 + i for i in range(100))
    journal.record("start", clock=lambda: next(times), process_started_secs=t0 - 1, updates=4, checkpoint_every=2,
                   progress_every_secs=0, store_url="x", version="0")
    journal.record("resume", clock=lambda: next(times), resumed_step=None, checkpoint_every=2)
    for step in steps:
        journal.record("save", clock=lambda: next(times), **_save_fields(step))
    if exit_outcome is not None:
        journal.record("exit", clock=lambda: next(times), outcome=exit_outcome, step=steps[-1],
                       attempted_updates=steps[-1], update_secs=float(steps[-1]), wall_secs=5.0, requests={"put": 9})


def test_events_are_objects_outside_every_step_that_nothing_takes_for_a_step(backend, capsys):
    store = open_store(backend)
    _commit(store, 2)
    journal = Journal(store)
    before = store.storage.requests.snapshot()
    _run(journal, 1_800_000_000.0, [2])
    after = store.storage.requests.snapshot()
    assert {kind: after[kind] - before[kind] for kind in after} == {**dict.fromkeys(after, 0), "put": 4}
    names, strangers = list_journal(store)
    assert strangers == [] and journal.written == 4 and journal.failed == 0
    assert [(n.kind, n.seq, n.step) for n in names] == [("start", 0, None), ("resume", 1, None), ("save", 2, 2),
                                                         ("exit", 3, 2)]
    assert [n.rel for n in names] == sorted(n.rel for n in names)  # names sort by time
    assert names[0].rel == f"{JOURNAL_PREFIX}/20270115T080000.000000Z-{journal.start_id}-000000-start-s-.json"
    contents = read_journal(store)
    assert contents.skipped == [] and [e.kind for e in contents.events] == ["start", "resume", "save", "exit"]
    assert contents.events[2].requests == {"put": 2, "list": 1} and contents.events[2].blocking_secs == 0.5
    assert contents.size_bytes == sum(n.size_bytes for n in names) > 0
    # Not a step anywhere: listings, checkpoints, the orphan survey, ls and verify of every step.
    assert store.steps() == [2] and [i.step for i in store.checkpoints()] == [2]
    found = survey(store, older_than_secs=0)
    assert found.orphans == [] and found.live == []
    if backend.name != "gcs":  # the CLI's GCS client looks for credentials (the CLI tests run local and S3)
        args = cli_store_args(backend)
        assert main(["ls", store.url, "--all", "--json", *args]) == 0
        assert [row["step"] for row in json.loads(capsys.readouterr().out)["steps"]] == [2]
        assert main(["verify", store.url, "--json", *args]) == 0
        assert [row["step"] for row in json.loads(capsys.readouterr().out)["steps"]] == [2]
    report = collect_garbage(store, RetentionPolicy(keep_last=1), orphans_older_than_secs=0, dry_run=False)
    assert report.deleted_steps == [] and report.orphans == [] and report.journal_events == []
    assert len(list_journal(store)[0]) == 4


def test_a_save_costs_one_request_more_with_the_journal(s3_backend):
    """The store's own request count (by kind) agrees with botocore's count of HTTP requests, and a
    save event is exactly one PutObject."""
    store = open_store(s3_backend)
    counter = S3RequestCounter()
    counter.attach(store.storage.fs)
    journal = Journal(store)
    before = store.storage.requests.snapshot()
    _commit(store, 2)
    save = {kind: n - before[kind] for kind, n in store.storage.requests.snapshot().items() if n != before[kind]}
    # begin: a HEAD and, finding nothing, a LIST (s3fs) for each of the manifest and COMPLETE; the
    # payload; the listing of the attempt; the manifest (docs/operations.md, "Costs")
    assert counter.by_op == {"HeadObject": 2, "ListObjectsV2": 3, "PutObject": 2}
    assert save == {"head": 2, "list": 3, "put": 2}
    counter.reset()
    journal.record("save", **_save_fields(2))
    assert counter.by_op == {"PutObject": 1}
    assert store.storage.requests.snapshot()["put"] == before["put"] + 3


def test_the_reader_skips_malformed_oversized_newer_and_out_of_bounds_events_with_a_warning(memory_backend, caplog):
    store = open_store(memory_backend)
    journal = Journal(store)
    _run(journal, 1_800_000_000.0, [2, 4])
    names, _ = list_journal(store)
    stamp = f"20270115T090000.000000Z-{'ab' * 8}"
    future = json.loads(store.storage.read_bytes(names[2].rel))
    future["schema_version"] = SCHEMA_VERSION + 1
    saved = {**json.loads(store.storage.read_bytes(names[2].rel)), "start_id": "ab" * 8}
    exit_ = {**json.loads(store.storage.read_bytes(names[-1].rel)), "start_id": "ab" * 8, "seq": 4}
    bad = {
        f"{stamp}-000000-save-s000006.json": json.dumps(future).encode(),
        f"{stamp}-000001-save-s000008.json": b"{not json",
        f"{stamp}-000002-progress-s000009.json": b"{" + b" " * MAX_EVENT_BYTES + b"}",
        f"{stamp}-000003-progress-s000009.json": json.dumps({"kind": "progress", "step": -1}).encode(),
        # numbers json.dumps writes but no event holds: they must not overflow the report's sums
        f"{stamp}-000004-exit-s000004.json": json.dumps({**exit_, "time_secs": float("inf")}).encode(),
        f"{stamp}-000005-save-s000004.json": json.dumps({**saved, "blocking_secs": 1e308}).encode(),
        f"{stamp}-000006-save-s000004.json": json.dumps({**saved, "size_bytes": 10 ** 400}).encode(),
        f"{stamp}-000007-save-s{10 ** 17}.json": json.dumps({**saved, "step": 10 ** 17}).encode(),  # its name too
        "notes.txt": b"hello",
    }
    for name, data in bad.items():
        raw_put(memory_backend, f"{JOURNAL_PREFIX}/{name}", data)
    with caplog.at_level(logging.WARNING, logger="opd_store.ledger"):
        contents = read_journal(store)
    url = store.storage.url(JOURNAL_PREFIX)
    assert [e.kind for e in contents.events] == ["start", "resume", "save", "save", "exit"]
    assert sorted(contents.skipped) == sorted([
        f"{url}/{stamp}-000000-save-s000006.json: journal event of schema {SCHEMA_VERSION + 1}, newer than this "
        f"opd_store's {SCHEMA_VERSION} (upgrade opd_store to read it)",
        f"{url}/{stamp}-000001-save-s000008.json: journal event is not JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))",
        f"{url}/{stamp}-000002-progress-s000009.json: journal event of {MAX_EVENT_BYTES + 2} bytes is over "
        f"{MAX_EVENT_BYTES} bytes",
        f"{url}/{stamp}-000003-progress-s000009.json: journal event field progress.time_secs: Field required",
        f"{url}/{stamp}-000004-exit-s000004.json: journal event field exit.time_secs: Input should be a finite number",
        f"{url}/{stamp}-000005-save-s000004.json: journal event field save.blocking_secs: Input should be less than "
        "or equal to 1000000000",
        f"{url}/{stamp}-000006-save-s000004.json: journal event field save.size_bytes: Input should be less than or "
        f"equal to {1 << 60}",
        f"{url}/{stamp}-000007-save-s{10 ** 17}.json: not a journal event name",
        f"{url}/notes.txt: not a journal event name",
    ])
    assert sorted(r.getMessage() for r in caplog.records) == sorted(f"run journal: skipped {s}" for s in contents.skipped)
    report = report_store(store)  # what was skipped is named, the rest reported
    assert report.skipped == contents.skipped and report.saves == 2 and report.blocking_secs_total == 1.0
    with pytest.raises(JournalEventError, match="^u: journal event is not a JSON object$"):
        parse_event(b"[1]", "u")
    assert isinstance(JournalEventError("x"), ValueError)


def test_gc_bounds_the_journal_oldest_starts_first_whole(local_backend, capsys):
    store = open_store(local_backend)
    starts = [Journal(store) for _ in range(3)]
    for index, journal in enumerate(starts):  # 4 events each, oldest first
        _run(journal, 1_800_000_000.0 + 100 * index, [2 * index + 2])
    report = collect_garbage(store, RetentionPolicy(), journal_keep_events=5)
    assert report.dry_run and len(report.journal_events) == 8  # two whole starts: 12 - 8 = 4 <= 5
    sizes = {n.rel: n.size_bytes for n in list_journal(store)[0]}
    assert len(sizes) == 12 and report.journal_bytes == sum(sizes[rel] for rel in report.journal_events) > 0
    assert report.freed_bytes == report.journal_bytes  # no step or orphan to delete: the events' bytes
    assert main(["gc", store.url, "--journal-keep", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        f"would delete 12 run-journal events ({sum(sizes.values())} bytes) beyond the journal's bound (oldest starts "
        "first)", f"would free {sum(sizes.values())} bytes (dry run: pass --yes to delete)"]
    assert main(["gc", store.url, "--journal-keep", "5", "--yes", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["journal_events"]) == 8 and all(rel.startswith(f"{JOURNAL_PREFIX}/") for rel in out["journal_events"])
    assert {n.start_id for n in list_journal(store)[0]} == {starts[2].start_id}
    assert main(["gc", store.url, "--journal-keep", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "opd-store gc: error: --journal-keep must be >= 0, got -1"


def test_a_journal_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path, caplog, capsys):
    from opd_store import CheckpointStore

    blocker = tmp_path / "store"
    blocker.mkdir()
    (blocker / JOURNAL_PREFIX).write_text("a file where the journal's directory would be")
    journal = Journal(CheckpointStore(blocker))
    with caplog.at_level(logging.WARNING, logger="opd_store.ledger"):
        event = journal.record("progress", step=3, attempted_updates=3, update_secs=1.5)
    assert event.step == 3 and (journal.written, journal.failed) == (0, 1)
    (record,) = caplog.records
    assert record.getMessage().startswith(f"run journal: could not write {blocker}/{JOURNAL_PREFIX}/")
    assert record.getMessage().endswith("training goes on without it")
    # an event out of the schema's bounds (a clock set past 2100) is a warning too, never raised
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="opd_store.ledger"):
        assert journal.record("progress", clock=lambda: 5e9, step=4, attempted_updates=4, update_secs=1.0) is None
    (record,) = caplog.records
    assert record.getMessage().startswith("run journal: a progress event out of the schema's bounds was not written")
    assert (journal.written, journal.failed) == (0, 1)
    # what reads it says so, rather than reporting an empty journal; --html naming a directory is refused
    report = report_store(journal_store := CheckpointStore(blocker))
    assert (report.starts, report.skipped) == ([], [
        f"{journal_store.storage.url(JOURNAL_PREFIX)}: an object where the journal's folder should be (no event can be "
        "written or read under it)"])
    assert main(["report", str(blocker), "--html", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"opd-store report: error: --html {tmp_path}: is a directory (name the page's file)"]


@pytest.mark.parametrize("text, message", [
    ("name: mine\nstorage_per_gib_month: -1\n", "field storage_per_gib_month: Input should be greater than or equal to 0"),
    ("name: mine\nstorage_per_gib_month: 0.02\nrequests_per_1000: {put: 0.005, copy: 1}\n",
     "field requests_per_1000: unknown request kind(s) ['copy']; kinds are ['list', 'head', 'get', 'put', 'post', "
     "'delete']"),
    ("name: mine\nstorage_per_gib_month: 0.02\nrequests_per_1000: {put: cheap}\n",
     "field requests_per_1000.put: Input should be a valid number, unable to parse string as a number"),
    ("storage_per_gib_month: 0.02\n", "field name: Field required"),
    ("name: mine\nstorage_per_gib_month: .inf\n", "field storage_per_gib_month: Input should be a finite number"),
    ("name: mine\nstorage_per_gib_month: 0\nrequests_per_1000: {put: .nan}\n",
     "field requests_per_1000.put: Input should be a finite number"),
    ("{name: [", "does not parse as JSON or YAML at line 1"),
])
def test_a_price_file_that_does_not_parse_is_refused_naming_file_and_field(tmp_path, capsys, text, message):
    prices = tmp_path / "prices.yaml"
    prices.write_text(text)
    with pytest.raises(PriceTableError) as caught:
        load_price_file(prices)
    assert str(caught.value) == f"price file {prices}: {message}"
    assert main(["report", str(tmp_path / "store"), "--prices", str(prices)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"opd-store report: error: price file {prices}: {message}"]


def test_a_price_file_replaces_the_built_in_table(tmp_path, capsys):
    from opd_store import CheckpointStore

    store = CheckpointStore(tmp_path / "store")
    _commit(store, 2)
    _run(Journal(store), 1_800_000_000.0, [2])
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"name": "mine", "currency": "EUR", "storage_per_gib_month": 2 ** 30,
                                  "requests_per_1000": {"put": 1000.0}}))
    assert main(["report", str(tmp_path / "store"), "--prices", str(prices), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stored = store.manifest(2).total_size_bytes
    assert report["bytes_stored"] == stored and report["requests"] == {"put": 9}
    assert report["costs"] == {"table": "mine", "currency": "EUR", "requests": 9.0,
                               "storage_per_month": float(stored + report["journal_bytes"])}


def test_the_start_time_of_a_process_is_the_kernels():
    """The restart time is measured from a process's start as the kernel recorded it (a launcher's
    for the ranks it spawned), to the 10 ms of the kernel's clock ticks."""
    import subprocess
    import time

    from opd_store.ledger import process_started_secs

    before = time.time()
    child = subprocess.Popen(["sleep", "30"])
    after = time.time()
    try:
        assert before - 0.05 <= process_started_secs(child.pid) <= after + 0.05
        assert process_started_secs() < before
    finally:
        child.kill()
        child.wait()


def test_the_writer_thread_lives_only_while_events_are_queued(memory_backend):
    """Background events are written in order by a thread that ends once the queue is empty, so no
    thread outlives a trainer's fit (Lightning's own tests fail a test that leaves one)."""
    import threading

    journal = Journal(open_store(memory_backend))
    for round_ in range(2):
        for step in (1, 2, 3):
            journal.record("save", background=True, **_save_fields(10 * round_ + step))
        journal.flush()
        assert journal.written == 3 * (round_ + 1) and journal.failed == 0
        assert [t for t in threading.enumerate() if t.name == "opd-store-journal"] == []
    assert [n.step for n in list_journal(open_store(memory_backend))[0]] == [1, 2, 3, 11, 12, 13]
