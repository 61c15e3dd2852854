"""Retention executor, orphans, pins and stale multipart uploads on real stores (local, S3 via moto).

Only verified-complete steps count toward keep-last, so corrupt or incomplete newest steps never
push a good one out; objects the store did not write (a checkpoint copied in by another tool) are
never deleted by garbage collection.
"""

from __future__ import annotations

import time

import pytest
from opd_testkit.aged_objects import backdate, moto_clock
from opd_testkit.stores import open_store, raw_put

from opd_store import CheckpointNotFoundError, CheckpointStore
from opd_store.format import new_attempt_id
from opd_store.retention import RetentionPolicy, apply_retention, collect_garbage
from opd_store.retention._executor import execute_plan, plan_store_retention
from opd_store.retention._gc import find_orphans
from opd_store.store import pin, pinned_steps, unpin
from opd_store.testing import Fault, FaultyStorage, InjectedFault


def commit(store: CheckpointStore, step: int, *, payload: bytes | None = None, metadata=None) -> None:
    with store.begin(step, metadata=metadata or {"successful_updates": step}) as txn:
        txn.write_bytes("model.bin", payload if payload is not None else step.to_bytes(4, "big") * 8)
        txn.write_bytes("config.yaml", b"lr: 0.1\n")


def raw_tree(backend) -> dict[str, bytes]:
    fs = backend.raw_fs()
    root = backend.raw_root()
    return {path[len(root) + 1:]: fs.cat_file(path) for path in fs.find(root)}


def payload_rel(store: CheckpointStore, step: int, name: str = "model.bin") -> str:
    return f"step-{step:06d}/{store.manifest(step).entry(name).path}"


def test_keep_last_2_keep_every_10000_with_the_two_newest_damaged(backend):
    store = open_store(backend)
    for step in (10000, 15000, 20000, 20100, 20200, 20300, 20400):
        commit(store, step)
    raw_put(backend, "step-020300/manifest.json", b"{ not json")  # corrupt
    raw_put(backend, payload_rel(store, 20400), b"short")  # incomplete (size differs)
    report = apply_retention(store, RetentionPolicy(keep_last=2, keep_every=10000))
    assert report.deleted_steps == [15000]
    assert store.steps() == [10000, 20000, 20100, 20200, 20300, 20400]
    assert [s for s in store.steps() if store.is_complete(s)] == [10000, 20000, 20100, 20200]
    assert report.plan.untouched == {20300: "corrupt", 20400: "incomplete"}
    assert store.read(20200, "model.bin") == (20200).to_bytes(4, "big") * 8


def test_same_size_corruption_needs_deep_to_be_seen(backend):
    store = open_store(backend)
    for step in (10000, 20100, 20200, 20300, 20400):
        commit(store, step)
    for step in (20300, 20400):  # same size, other bytes: only a checksum sees it
        raw_put(backend, payload_rel(store, step), b"\xff" * 32)
    policy = RetentionPolicy(keep_last=2, keep_every=10000)
    shallow, _sizes = plan_store_retention(store, policy)
    assert shallow.delete == (20100, 20200)  # what a size-only pass would do
    report = apply_retention(store, policy, deep=True)
    assert report.deleted_steps == []
    assert set(report.plan.keep) == {10000, 20100, 20200}
    assert report.plan.untouched == {20300: "corrupt", 20400: "corrupt"}
    assert store.steps() == [10000, 20100, 20200, 20300, 20400]


def test_pins_survive_retention_and_are_not_steps(backend):
    store = open_store(backend)
    for step in (1, 2, 3):
        commit(store, step)
    assert pin(store, 1, reason="eval baseline") is True
    assert pin(store, 1) is False
    assert pinned_steps(store) == {1}
    assert store.steps() == [1, 2, 3] and [i.step for i in store.checkpoints()] == [1, 2, 3]
    report = apply_retention(store, RetentionPolicy(keep_last=1))
    assert report.deleted_steps == [2]
    assert store.steps() == [1, 3]
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        pin(store, 7)
    assert unpin(store, 1) is True and unpin(store, 1) is False
    assert apply_retention(store, RetentionPolicy(keep_last=1)).deleted_steps == [1]
    assert store.steps() == [3]


def test_a_pin_added_after_planning_is_honoured(backend):
    store = open_store(backend)
    for step in (1, 2, 3):
        commit(store, step)
    plan, _sizes = plan_store_retention(store, RetentionPolicy(keep_last=1))
    assert plan.delete == (1, 2)
    pin(store, 2)
    assert execute_plan(store, plan) == [1]
    assert store.steps() == [2, 3]


def test_deletion_removes_the_manifest_first_so_a_crash_leaves_no_false_complete(backend):
    store = open_store(backend)
    for step in (1, 2):
        commit(store, step)
    faulty = CheckpointStore.from_storage(
        FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "delete_tree"))
    )
    with pytest.raises(InjectedFault):
        apply_retention(faulty, RetentionPolicy(keep_last=1))
    fresh = open_store(backend)
    assert fresh.steps() == [2]
    assert fresh.status(1) == "uncommitted"
    assert fresh.latest_step() == 2
    # The payloads left behind are an orphan attempt; gc removes them after the grace period.
    assert [o.step for o in find_orphans(fresh, older_than_secs=3600)] == []
    report = collect_garbage(fresh, RetentionPolicy(), orphans_older_than_secs=0, dry_run=False)
    assert [o.step for o in report.orphans] == [1]
    assert sorted(raw_tree(backend)) == sorted(
        f"step-000002/{name}" for name in ["manifest.json", *(e.path for e in fresh.manifest(2).payloads)]
    )


def test_orphans_respect_the_grace_period_and_foreign_objects_are_never_touched(backend, request):
    store = open_store(backend)
    commit(store, 5)
    now = time.time()
    moto = request.getfixturevalue("moto_s3") if backend.name == "s3" else None
    # The ids carry their writers' clocks, which say nothing: "old" was written by a writer whose
    # clock ran 2 h ahead, "young" by one 2 h behind. Only the store's times decide.
    old = new_attempt_id(now + 7200)
    young = new_attempt_id(now - 7200)
    lost = new_attempt_id(now)
    raw_put(backend, f"step-000007/{old}/model.bin", b"o" * 100)  # killed save, last written 2 h ago
    raw_put(backend, f"step-000008/{young}/model.bin", b"y" * 10)  # a live writer, written just now
    raw_put(backend, f"step-000005/{lost}/model.bin", b"l" * 20)  # lost race beside a committed step
    backdate(backend, f"step-000007/{old}", 7200, moto)
    backdate(backend, f"step-000005/{lost}", 7200, moto)
    foreign = {
        "step-000009/model.safetensors": b"another tool",  # no attempt layout
        "step-000009/attempt-not-ours/x.bin": b"not an attempt id",
        "notes/README.txt": b"hello",
        "step-000005/extra.txt": b"operator note",
    }
    for rel, data in foreign.items():
        raw_put(backend, rel, data)
    before = raw_tree(backend)
    dry = collect_garbage(store, RetentionPolicy(keep_last=1), dry_run=True)
    assert sorted((o.step, o.attempt_id, o.size_bytes) for o in dry.orphans) == [(5, lost, 20), (7, old, 100)]
    assert dry.freed_bytes == 120 and raw_tree(backend) == before
    done = collect_garbage(store, RetentionPolicy(keep_last=1), dry_run=False)
    assert [o.attempt_id for o in done.orphans] == [lost, old]
    after = raw_tree(backend)
    for rel, data in foreign.items():
        assert after[rel] == data
    assert f"step-000008/{young}/model.bin" in after
    assert not any(rel.startswith(f"step-000007/{old}") or rel.startswith(f"step-000005/{lost}") for rel in after)
    assert store.is_complete(5) and store.read(5, "model.bin") == (5).to_bytes(4, "big") * 8


def test_orphans_in_a_step_with_an_unreadable_manifest_are_kept(backend):
    store = open_store(backend)
    commit(store, 3)
    stray = new_attempt_id(time.time() - 7200)
    raw_put(backend, f"step-000003/{stray}/model.bin", b"s")
    raw_put(backend, "step-000003/manifest.json", b"garbage")
    assert find_orphans(store, older_than_secs=0) == []


def test_stale_multipart_uploads_are_aborted_and_reported(s3_backend, moto_s3):
    store = CheckpointStore(s3_backend.url, storage_options=s3_backend.storage_options)
    commit(store, 1)
    client = moto_s3.boto3_client()
    bucket, prefix = "opd-test", "runs/demo"
    # Uploads of payloads under two attempts: one with a part written just now (a live writer,
    # whatever its 2-hours-old id says), one whose only part was written 2 hours ago by the store's
    # clock (moto reports one fixed 2010 "Initiated" for every upload, so the parts decide).
    live_key = f"{prefix}/step-000002/{new_attempt_id(time.time() - 7200)}/model.bin"
    stale_key = f"{prefix}/step-000003/{new_attempt_id(time.time() + 7200)}/model.bin"
    live = client.create_multipart_upload(Bucket=bucket, Key=live_key)
    client.upload_part(Bucket=bucket, Key=live_key, UploadId=live["UploadId"], PartNumber=1, Body=b"l" * 100)
    stale = client.create_multipart_upload(Bucket=bucket, Key=stale_key)
    with moto_clock(-7200):
        client.upload_part(Bucket=bucket, Key=stale_key, UploadId=stale["UploadId"], PartNumber=1, Body=b"s" * 100)
    other = client.create_multipart_upload(Bucket=bucket, Key="elsewhere/big.bin")  # outside the store
    relative = {live["UploadId"]: live_key[len(prefix) + 1:], stale["UploadId"]: stale_key[len(prefix) + 1:]}

    dry = collect_garbage(store, RetentionPolicy(), dry_run=True)  # the default grace: one hour
    assert [(u.rel, u.upload_id) for u in dry.uploads] == [(relative[stale["UploadId"]], stale["UploadId"])]
    assert 7100 < dry.uploads[0].age_secs < 7800
    assert len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 3
    collect_garbage(store, RetentionPolicy(), dry_run=False)
    left = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert sorted(u["UploadId"] for u in left) == sorted([live["UploadId"], other["UploadId"]])
    # With no grace the live one goes too; the one outside the store prefix is never touched.
    collect_garbage(store, RetentionPolicy(), orphans_older_than_secs=0, dry_run=False)
    left = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["UploadId"] for u in left] == [other["UploadId"]]
