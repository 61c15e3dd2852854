"""``check_reachable`` through the Python API: a real probe (a listing; for writers a probe object
created with the create-only write and deleted), refusals that name the operation and the cause,
and a probe name that no listing, ``ls`` or ``gc`` ever takes for a step. S3 behind the fault proxy
in front of moto (:mod:`opd_testkit.proxies`), local directories, the memory store.
"""

from __future__ import annotations

import time

import pytest

from opd_store import CheckpointStore, StoreNotFoundError, StoreUnreachableError
from opd_store.format import probe_name
from opd_store.format._names import PROBE_PREFIX
from opd_store.retention import RetentionPolicy, collect_garbage


def test_the_write_probe_uses_the_commit_primitive_and_leaves_nothing(s3_proxy):
    backend, proxy = s3_proxy
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    store.check_reachable(write=False)
    assert [r.op for r in proxy.requests] == ["ListObjectsV2"]
    proxy.clear()
    store.check_reachable()  # write=True
    ops = [(r.op, r.path.rsplit("/", 1)[-1], r.headers.get("if-none-match")) for r in proxy.requests]
    assert [op for op, _name, _cond in ops] == ["ListObjectsV2", "PutObject", "DeleteObject"]
    put = ops[1]
    assert put[1].startswith(PROBE_PREFIX) and put[2] == "*"  # the create-only write of every commit
    assert backend.raw_fs().find(backend.raw_root()) == []


def test_refusals_name_the_operation_and_the_cause(s3_proxy):
    backend, proxy = s3_proxy
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    proxy.add(ops=("PutObject",), status=403, code="AccessDenied", times=None)
    store.check_reachable(write=False)  # reading is allowed
    with pytest.raises(StoreUnreachableError) as caught:
        store.check_reachable()
    assert str(caught.value) == f"{store.url}: cannot write a probe object: access denied (AccessDenied)"
    proxy.clear()
    proxy.add(ops=("ListObjectsV2",), status=403, code="AccessDenied", times=None)
    with pytest.raises(StoreUnreachableError) as caught:
        store.check_reachable(write=False)
    assert str(caught.value) == f"{store.url}: cannot list the store: access denied (AccessDenied)"
    proxy.clear()
    proxy.add(ops=("ListObjectsV2",), fault="stall", times=None)
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError) as caught:
        store.check_reachable(timeout_secs=1)
    assert time.monotonic() - started < 1 + 30  # the bound, with a generous margin
    assert str(caught.value) == f"{store.url}: cannot list the store: endpoint {proxy.endpoint_url} did not answer within 1 s"
    proxy.clear()


def test_a_probe_left_behind_is_never_a_step(backend):
    """A check killed between its create and its delete leaves a probe object: listings, ``ls``
    and ``gc`` never take it for a step or an attempt, and never delete it."""
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    with store.begin(1) as txn:
        txn.write_bytes("model.bin", b"one")
    name = probe_name()
    store.storage.create_exclusive(name, b"opd-store write probe\n")
    assert store.steps() == [1] and [i.step for i in store.checkpoints()] == [1] and store.latest_step() == 1
    report = collect_garbage(store, RetentionPolicy(keep_last=1), orphans_older_than_secs=0, dry_run=False)
    assert (report.orphans, report.uploads, report.deleted_steps) == ([], [], [])
    assert store.storage.size(name) == len(b"opd-store write probe\n")


def test_local_roots(tmp_path):
    missing = CheckpointStore(tmp_path / "no" / "such")
    with pytest.raises(StoreNotFoundError) as caught:
        missing.check_reachable(write=False)
    assert isinstance(caught.value, FileNotFoundError)
    assert str(caught.value) == f"{tmp_path}/no/such: no such directory (a save creates it; check the path)"
    missing.check_reachable()  # a save creates it: so does the write check
    assert (tmp_path / "no" / "such").is_dir() and list((tmp_path / "no" / "such").iterdir()) == []
    (tmp_path / "file").write_text("x")
    for write in (False, True):
        with pytest.raises(StoreUnreachableError, match="not a directory"):
            CheckpointStore(tmp_path / "file").check_reachable(write=write)
    with pytest.raises(StoreUnreachableError) as caught:
        CheckpointStore("/proc/forbidden").check_reachable()
    assert str(caught.value) == "/proc/forbidden: cannot create the store root (No such file or directory)"


def test_memory_store():
    store = CheckpointStore("memory://check/run")
    store.check_reachable(write=False)
    store.check_reachable()
    assert store.storage.list_tree("") == {}
