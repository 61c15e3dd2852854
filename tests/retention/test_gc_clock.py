"""Garbage collection judges an attempt's age by the store's clock, never the writer's.

Each writer is a separate process (``skewed_writer.py``, forked from the worker's fork server)
whose ``time.time()`` runs 2 hours behind or ahead, so its attempt ids carry a time 2 hours off,
as a VM restored from a snapshot would write them. ``opd-store gc --yes`` runs while the writer is
in the middle of its save (stopped by a message, never by sleeping: a payload half streamed and,
on S3, its multipart upload open), and the save then commits. Abandoned attempts (the writer
SIGKILLed there) are kept until the store's clock says they are older than the grace period, and
collected then, whatever their ids say; the store's clock is moved without sleeping (local files'
mtimes set explicitly; moto stamping objects with a shifted clock; the store's "now" read an hour
later: :mod:`opd_testkit.aged_objects`). On local disk and on S3 (moto).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest
from opd_testkit import forkserver
from opd_testkit.aged_objects import backdate, moto_clock
from opd_testkit.stores import Backend
from proc_writer import make_bytes

import opd_store
from opd_store import CheckpointStore
from opd_store.cli import main
from opd_store.format import attempt_created_secs, new_attempt_id
from opd_store.retention import RetentionPolicy, collect_garbage
from opd_store.retention._gc import delete_orphans, find_orphans

REPO_ROOT = Path(opd_store.__file__).resolve().parents[1]
WRITER = Path(__file__).with_name("skewed_writer.py")
HOUR = 3600.0
SKEW = 7200.0  # the writers' clocks are this far off
STEP = 2
A_BYTES = make_bytes("a", 1000)  # what skewed_writer.py writes
B_BYTES = make_bytes("b", 7 << 20)
BLOCK_BYTES = 5 << 20  # S3's smallest part: the writer's 6 MiB pause leaves one part uploaded


@pytest.fixture(params=("local", "s3"))
def writer_backend(request, tmp_path) -> Backend:
    """A clean store on local disk or on moto, with S3 payloads uploaded in 5 MiB parts."""
    backend = request.getfixturevalue(f"{request.param}_backend")
    if backend.name == "s3":
        backend = dataclasses.replace(backend, storage_options=dict(backend.storage_options,
                                                                    default_block_size=BLOCK_BYTES))
    return backend


def cli_args(backend: Backend) -> list[str]:
    """The command-line store options that reach ``backend`` (moto: endpoint and test keys)."""
    if backend.name != "s3":
        return []
    options = backend.storage_options
    return ["--s3-endpoint-url", options["endpoint_url"], "--storage-option", f"key={options['key']}",
            "--storage-option", f"secret={options['secret']}"]


class Writer:
    """One ``skewed_writer.py`` process (see its docstring), forked from this worker's preloaded
    fork server (:mod:`opd_testkit.forkserver`): the writer shifts ``time.time`` when its
    program starts, which every clock reading of opd_store goes through (``time.time()`` looked up
    at each call), in a forked child as in a new interpreter."""

    def __init__(self, backend: Backend, mode: str, offset_secs: float, *extra: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self.proc = forkserver.popen(
            [sys.executable, str(WRITER), backend.to_json(), mode, str(offset_secs), *extra],
            stdin=forkserver.PIPE, stdout=forkserver.PIPE, stderr=forkserver.PIPE, text=True, env=env)

    def expect(self, prefix: str) -> str:
        line = self.proc.stdout.readline()
        if not line.startswith(prefix):
            self.proc.kill()
            raise AssertionError(f"expected {prefix!r}, got {line!r}; stderr: {self.proc.stderr.read()[-3000:]}")
        return line.strip()

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self) -> str:
        line = self.expect("committed ")
        assert self.proc.wait(timeout=120) == 0
        return line.split()[1]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)


def gc_yes(capsys, backend: Backend, *extra) -> dict:
    code = main(["gc", backend.url, "--yes", "--json", *extra, *cli_args(backend)])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def uncommitted_attempts(capsys, backend: Backend) -> dict[str, dict]:
    """``ls --all --json``: every uncommitted attempt of step 2 by id."""
    assert main(["ls", backend.url, "--all", "--json", *cli_args(backend)]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    return {a["attempt_id"]: a for row in rows if row["step"] == STEP for a in row["uncommitted_attempts"]}


def raw_keys(backend: Backend) -> list[str]:
    fs, root = backend.raw_fs(), backend.raw_root()
    return sorted(path[len(root) + 1:] for path in fs.find(root))


def open_uploads(backend: Backend, moto_s3) -> list[str]:
    if backend.name != "s3":
        return []
    bucket = backend.url[len("s3://"):].split("/")[0]
    return sorted(u["UploadId"] for u in moto_s3.boto3_client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def assert_committed(backend: Backend, attempt_id: str) -> None:
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    assert store.manifest(STEP).attempt_id == attempt_id
    assert store.read(STEP, "a.bin") == A_BYTES and store.read(STEP, "b.bin") == B_BYTES
    assert store.verify(STEP, deep=True).ok


@pytest.mark.parametrize("offset", [-SKEW, SKEW], ids=["writer-2h-behind", "writer-2h-ahead"])
def test_gc_during_a_save_keeps_it_whatever_the_writers_clock(writer_backend, offset, capsys, request):
    backend = writer_backend
    writer = Writer(backend, "txn", offset)
    attempt_id = writer.expect("paused ").split()[1]
    # By its id (the writer's clock) the attempt is 2 hours old, or 2 hours in the future...
    assert abs((time.time() - attempt_created_secs(attempt_id)) + offset) < 600
    # ...by the store's clock it was written to a moment ago.
    (listed,) = uncommitted_attempts(capsys, backend).values()
    assert listed["attempt_id"] == attempt_id and 0 <= listed["age_secs"] < 600
    assert abs(listed["writer_clock_age_secs"] + offset) < 600
    uploads = open_uploads(backend, request.getfixturevalue("moto_s3") if backend.name == "s3" else None)

    report = gc_yes(capsys, backend)  # concurrently with the save: the default grace of 1 hour
    assert (report["orphans"], report["stale_uploads"], report["freed_bytes"]) == ([], [], 0)
    assert f"step-000002/{attempt_id}/a.bin" in raw_keys(backend)
    if backend.name == "s3":
        assert len(uploads) == 1 and open_uploads(backend, request.getfixturevalue("moto_s3")) == uploads

    writer.go()
    assert writer.finish() == attempt_id
    assert_committed(backend, attempt_id)


def test_gc_during_an_async_save_keeps_it(writer_backend, capsys):
    """The asynchronous writer's own attempt (written on its background thread, clock 2 h behind)."""
    backend = writer_backend
    writer = Writer(backend, "async", -SKEW)
    writer.expect("paused")
    (listed,) = uncommitted_attempts(capsys, backend).values()
    assert listed["age_secs"] < 600 and abs(listed["writer_clock_age_secs"] - SKEW) < 600
    report = gc_yes(capsys, backend)
    assert (report["orphans"], report["stale_uploads"]) == ([], [])
    writer.go()
    attempt_id = writer.finish()
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    assert attempt_id == listed["attempt_id"] and store.latest_step() == STEP
    assert store.verify(STEP, deep=True).ok and "training_state.pt" in store.names(STEP)


def test_gc_during_a_tier_upload_keeps_it(writer_backend, tmp_path, capsys):
    """The tier uploader's own attempt in the bucket (the uploading process's clock 2 h behind),
    with ``gc --local-tier`` collecting both tiers meanwhile."""
    backend = writer_backend
    local_dir = tmp_path / "local-tier"
    writer = Writer(backend, "tier", -SKEW, str(local_dir))
    writer.expect("paused")
    (listed,) = uncommitted_attempts(capsys, backend).values()
    assert listed["age_secs"] < 600 and abs(listed["writer_clock_age_secs"] - SKEW) < 600
    report = gc_yes(capsys, backend, "--local-tier", str(local_dir))
    assert (report["orphans"], report["stale_uploads"], report["deleted_steps"]) == ([], [], [])
    assert (report["local_tier"]["orphans"], report["local_tier"]["deleted_steps"]) == ([], [])
    writer.go()
    attempt_id = writer.finish()
    assert attempt_id == listed["attempt_id"]
    assert_committed(backend, attempt_id)


def test_killed_saves_are_collected_after_the_grace_not_before_local(local_backend, capsys):
    """Two writers of step 2 killed mid-save, one 2 h behind (its id says "2 hours old") and one
    2 h ahead (its id says "in 2 hours"): both kept while the store says they were just written,
    both collected once the store says they were written more than an hour ago."""
    backend = local_backend
    writers = {offset: Writer(backend, "txn", offset) for offset in (-SKEW, SKEW)}
    attempts = {offset: writer.expect("paused ").split()[1] for offset, writer in writers.items()}
    for writer in writers.values():
        writer.kill()
    sizes = {a: row["size_bytes"] for a, row in uncommitted_attempts(capsys, backend).items()}
    assert sorted(sizes) == sorted(attempts.values()) and all(size > len(A_BYTES) for size in sizes.values())

    report = gc_yes(capsys, backend)
    assert report["orphans"] == []  # not before the grace: the store wrote them a moment ago
    assert len(raw_keys(backend)) == 4  # a.bin and the half-written b.bin of each

    backdate(backend, "step-000002", HOUR + 60)  # the store's clock: last written 61 minutes ago
    report = gc_yes(capsys, backend)
    assert sorted(o["attempt_id"] for o in report["orphans"]) == sorted(attempts.values())
    assert all(HOUR + 50 < o["age_secs"] < HOUR + 600 for o in report["orphans"])
    assert report["freed_bytes"] == sum(sizes.values())
    assert raw_keys(backend) == []


def test_killed_saves_are_collected_after_the_grace_not_before_s3(s3_backend, moto_s3, capsys):
    """On moto, with the open multipart uploads of the killed writers. The writer 2 h ahead wrote
    while moto's clock said an hour and a minute ago: collected (attempt and upload) by ``gc``
    although its id lies in the future. The writer 2 h behind wrote just now: kept (attempt and
    upload) although its id says 2 hours old; collected once the store's clock reads an hour and
    a minute later."""
    backend = dataclasses.replace(s3_backend, storage_options=dict(s3_backend.storage_options,
                                                                     default_block_size=BLOCK_BYTES))
    with moto_clock(-(HOUR + 60)):
        ahead = Writer(backend, "txn", SKEW)
        ahead_attempt = ahead.expect("paused ").split()[1]
        ahead.kill()
    behind = Writer(backend, "txn", -SKEW)
    behind_attempt = behind.expect("paused ").split()[1]
    behind.kill()
    client = moto_s3.boto3_client()
    bucket = backend.url[len("s3://"):].split("/")[0]
    uploads = {u["Key"].split("/")[3]: u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket)["Uploads"]}
    assert sorted(uploads) == sorted([ahead_attempt, behind_attempt])

    report = gc_yes(capsys, backend)
    assert [o["attempt_id"] for o in report["orphans"]] == [ahead_attempt]
    assert [u["upload_id"] for u in report["stale_uploads"]] == [uploads[ahead_attempt]]
    assert all(key.startswith(f"step-000002/{behind_attempt}/") for key in raw_keys(backend))
    assert open_uploads(backend, moto_s3) == [uploads[behind_attempt]]

    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    later = store.storage.clock_secs() + HOUR + 60
    done = collect_garbage(store, RetentionPolicy(), dry_run=False, now_secs=later)
    assert [o.attempt_id for o in done.orphans] == [behind_attempt]
    assert [u.upload_id for u in done.uploads] == [uploads[behind_attempt]]
    assert raw_keys(backend) == [] and open_uploads(backend, moto_s3) == []


def test_an_orphan_written_to_again_before_its_deletion_is_kept(writer_backend):
    """The survey and the deletion are two moments: an attempt found idle (here: by a store clock
    read two hours ahead) that the store says was written within the grace period when the
    deletion comes is kept (its prefix is listed again against a fresh reading of the clock)."""
    backend = writer_backend
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    with store.begin(1) as txn:
        txn.write_bytes("a.bin", A_BYTES)
    attempt = store.begin(STEP)
    attempt.write_bytes("a.bin", A_BYTES)
    attempt.settle()  # on S3 the publish runs in the background: a.bin is stored once settled
    found = find_orphans(store, older_than_secs=HOUR, now_secs=store.storage.clock_secs() + 2 * HOUR)
    assert [o.attempt_id for o in found] == [attempt.attempt_id]
    assert delete_orphans(store, found, older_than_secs=HOUR) == []
    assert f"step-000002/{attempt.attempt_id}/a.bin" in raw_keys(backend)
    assert delete_orphans(store, found) == found  # without the second look it would have gone
    assert all(not key.startswith("step-000002/") for key in raw_keys(backend))


def test_an_attempt_of_uploads_only_keeps_its_idle_upload(s3_backend, moto_s3, capsys):
    """A save whose payloads upload in parallel may be only open multipart uploads, none published
    yet. One payload idle for two hours on the store's clock (its one part stored then) while
    another streams now: the attempt is live, so ``gc`` aborts neither upload (an upload under an
    attempt lives and dies with its attempt, never judged alone); collected together once the
    store's clock says the newest part is older than the grace."""
    backend = s3_backend
    client = moto_s3.boto3_client()
    bucket, _, root = backend.url[len("s3://"):].partition("/")
    attempt_id = new_attempt_id()
    prefix = f"{root}/step-{STEP:06d}/{attempt_id}"

    def upload_with_one_part(name: str) -> str:
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/{name}")["UploadId"]
        client.upload_part(Bucket=bucket, Key=f"{prefix}/{name}", UploadId=upload_id, PartNumber=1,
                           Body=B_BYTES[:BLOCK_BYTES])
        return upload_id

    with moto_clock(-2 * HOUR):
        idle = upload_with_one_part("idle.bin")
    streaming = upload_with_one_part("streaming.bin")
    assert open_uploads(backend, moto_s3) == sorted([idle, streaming])

    report = gc_yes(capsys, backend)
    assert (report["orphans"], report["stale_uploads"]) == ([], [])
    assert open_uploads(backend, moto_s3) == sorted([idle, streaming])

    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    later = store.storage.clock_secs() + HOUR + 60
    done = collect_garbage(store, RetentionPolicy(), dry_run=False, now_secs=later)
    assert [o.attempt_id for o in done.orphans] == [attempt_id]
    assert sorted(u.upload_id for u in done.uploads) == sorted([idle, streaming])
    assert open_uploads(backend, moto_s3) == []


def test_an_orphan_whose_writer_streams_again_before_its_deletion_keeps_attempt_and_upload(
        s3_backend, moto_s3, capsys):
    """The survey finds an attempt idle for two hours (a.bin, and b.bin's open upload with one
    part, both stored then); before the deletion its writer uploads b.bin's next part. The second
    look sees that part (an upload is activity of its attempt, as an object is): neither the
    attempt nor its upload is removed, although the survey had found both stale."""
    from opd_store.testing import FaultyStorage

    backend = s3_backend
    client = moto_s3.boto3_client()
    bucket, _, root = backend.url[len("s3://"):].partition("/")
    attempt_id = new_attempt_id()
    key = f"{root}/step-{STEP:06d}/{attempt_id}/b.bin"
    with moto_clock(-2 * HOUR):
        client.put_object(Bucket=bucket, Key=f"{root}/step-{STEP:06d}/{attempt_id}/a.bin", Body=A_BYTES)
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=B_BYTES[:BLOCK_BYTES])

    class WriterComesBack(FaultyStorage):
        """Uploads b.bin's second part when the store's clock is read the second time (the
        deletion's fresh reading, after the survey's)."""

        readings = 0

        def clock_secs(self) -> float:
            self.readings += 1
            if self.readings == 2:
                client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=2,
                                   Body=B_BYTES[BLOCK_BYTES:])
            return self.inner.clock_secs()

    plain = CheckpointStore(backend.url, storage_options=backend.storage_options)
    store = CheckpointStore.from_storage(WriterComesBack(plain.storage))
    report = collect_garbage(store, RetentionPolicy(), dry_run=False)
    assert (report.orphans, report.uploads) == ([], [])
    assert store.storage.readings == 2
    assert raw_keys(backend) == [f"step-000002/{attempt_id}/a.bin"]
    assert open_uploads(backend, moto_s3) == [upload_id]
