"""The tiered store: local commit first, background upload with the same
protocol, which tier answers what, failures raised, retention per tier, and the OPD layer on top.

The bucket is a real S3 server (moto over HTTP) or ``memory://``; the local tier a temp dir.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from fsspec.callbacks import Callback
from opd_testkit.stores import Backend
from proc_writer import payloads_for

from opd_store import CheckpointStore, latest_complete_checkpoint, load_opd_checkpoint, save_opd_checkpoint
from opd_store.errors import CommitConflictError, CommitError, IntegrityError, UploadError
from opd_store.retention import RetentionPolicy
from opd_store.store import copy_checkpoint
from opd_store.testing import Fault, FaultyStorage, InjectedFault
from opd_store.tiered import TieredStore
from opd_store.tiered._store import same_payloads


class CountingStorage(FaultyStorage):
    """:class:`FaultyStorage` that also records whole-payload reads (``open_checked``) as ``read``."""

    def open_checked(self, rel: str, **kwargs):
        return self.recorded_read("read", rel, lambda: self.inner.open_checked(rel, **kwargs))

    def payload_reads(self) -> list[str]:
        return [op.rel for op in self.ops if op.kind == "read" and "/attempt-" in op.rel]


@pytest.fixture(params=("memory", "s3"))
def bucket_backend(request, tmp_path) -> Backend:
    if request.param == "s3":
        return request.getfixturevalue("s3_backend")
    return Backend("memory", "memory://opd-bucket/runs/tiered", {})


def plain(backend: Backend) -> CheckpointStore:
    return CheckpointStore(backend.url, storage_options=backend.storage_options)


def wrapped(backend: Backend, cls=FaultyStorage, **kwargs):
    """(store over a recording/faulty wrapper of the bucket, the wrapper)."""
    storage = cls(plain(backend).storage, **kwargs)
    return CheckpointStore.from_storage(storage), storage


def save(store, step: int, tag: str | None = None) -> str:
    with store.begin(step, metadata={"tag": tag or f"step{step}"}) as txn:
        for name, data in payloads_for(tag or f"step{step}").items():
            txn.write_bytes(name, data)
    return txn.committed_url


def wait_idle(store: TieredStore, timeout_secs: float = 120.0) -> None:
    """Wait (polling a real condition with a deadline) until no upload is queued or running,
    without consuming a failure the way ``flush`` does."""
    deadline = time.monotonic() + timeout_secs
    tick = threading.Event()
    while store.pending_uploads():
        assert time.monotonic() < deadline, f"uploads still pending: {store.pending_uploads()}"
        tick.wait(0.02)


def test_save_commits_locally_then_uploads_with_same_entries(bucket_backend, tmp_path):
    store = TieredStore(tmp_path / "local", bucket_backend.url, storage_options=bucket_backend.storage_options)
    url = save(store, 1)
    assert url == str(tmp_path / "local" / "step-000001")  # the local commit's URL
    assert store.wait_uploaded(1, timeout_secs=120) == f"{store.bucket.url}/step-000001"
    local, remote = store.local.manifest(1), plain(bucket_backend).manifest(1)
    assert same_payloads(local, remote) and local.attempt_id != remote.attempt_id
    assert [(e.name, e.size_bytes, e.crc32c) for e in remote.payloads] == [
        (e.name, e.size_bytes, e.crc32c) for e in local.payloads
    ]
    assert remote.metadata == {"tag": "step1"}
    for name, data in payloads_for("step1").items():
        assert plain(bucket_backend).read(1, name) == data
    assert store.durable_steps() == [1] and store.local_steps() == [1] and store.latest_step() == 1
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.begin(2)


def test_local_copy_preferred_when_both_match_no_bucket_payload_reads(bucket_backend, tmp_path):
    bucket, counting = wrapped(bucket_backend, CountingStorage)
    store = TieredStore(tmp_path / "local", bucket)
    save(store, 1)
    store.flush()
    counting.ops.clear()
    assert store.tier_for(1) is store.local and store.step_url(1) == str(tmp_path / "local" / "step-000001")
    manifest = store.manifest(1)
    for name, data in payloads_for("step1").items():
        assert store.read(1, name, manifest=manifest) == data
    assert counting.payload_reads() == []
    # What the bucket was asked: only its manifest (one small GET per tier decision).
    assert {op.rel for op in counting.ops if op.kind == "read"} == {"step-000001/manifest.json"}
    # A new machine (empty local tier) reads every payload from the bucket.
    counting.ops.clear()
    fresh = TieredStore(tmp_path / "fresh", bucket)
    for name, data in payloads_for("step1").items():
        assert fresh.read(1, name) == data
    assert sorted(rel.rsplit("/attempt-", 1)[0] for rel in counting.payload_reads()) == ["step-000001"] * 3
    assert fresh.step_url(1) == f"{bucket.url}/step-000001"


def test_mismatch_reads_bucket_copy_and_blocks_the_step(bucket_backend, tmp_path, caplog):
    remote = plain(bucket_backend)
    save(remote, 1, "bucket-copy")
    local = CheckpointStore(tmp_path / "local")
    save(local, 1, "stale-local-copy")  # same names and sizes, other bytes
    store = TieredStore(local, remote)
    with caplog.at_level(logging.WARNING, logger="opd_store.tiered"):
        assert store.tier_for(1) is store.bucket
    assert "step 1 differs between the local tier" in caplog.text
    assert store.step_url(1) == f"{remote.url}/step-000001"
    for name, data in payloads_for("bucket-copy").items():
        assert store.read(1, name) == data
    assert store.manifest(1).metadata == {"tag": "bucket-copy"}
    assert [info.metadata["tag"] for info in store.checkpoints()] == ["bucket-copy"]
    with pytest.raises(CommitConflictError, match="step 1 is committed"):
        store.begin(1)  # the local tier holds it
    save(remote, 3, "only-in-bucket")
    with pytest.raises(CommitConflictError, match="step 3 is in the bucket"):
        save(store, 3, "new")  # asked while the payloads streamed, refused before the local commit
    assert store.local.storage.list_tree("step-000003") == {}  # the local attempt was deleted
    assert store.pending_uploads() == [] and remote.manifest(3).metadata == {"tag": "only-in-bucket"}
    assert store.upload_pending() == []
    # A bucket copy that is not complete any more loses to the complete local one.
    entry = remote.manifest(1).payloads[0]
    remote.storage.delete(f"step-000001/{entry.path}")
    assert store.tier_for(1) is store.local
    assert store.read(1, entry.name) == payloads_for("stale-local-copy")[entry.name]


def test_upload_failure_is_raised_at_wait_next_save_flush_and_close(bucket_backend, tmp_path):
    failing = {2, 4, 5, 6}
    fault = Fault(when=lambda op: op.kind == "create" and int(op.rel[5:11]) in failing, once=False)
    bucket, _faulty = wrapped(bucket_backend, faults=fault)
    store = TieredStore(tmp_path / "local", bucket)
    save(store, 1)
    save(store, 2)
    with pytest.raises(UploadError, match="upload of step 2") as info:
        store.wait_uploaded(2, timeout_secs=120)
    # The copy's commit failed (CommitError: the manifest create raised, no manifest read back).
    assert isinstance(info.value.__cause__, CommitError) and isinstance(info.value.__cause__.__cause__, InjectedFault)
    assert store.latest_step() == 2 and store.local_steps() == [1, 2]  # available here...
    assert not store.is_durable(2) and store.latest_durable_step() == 1 and store.durable_steps() == [1]  # ...not durable
    assert plain(bucket_backend).status(2) == "uncommitted"

    # A failure nobody waited for is raised by the next save, before it writes anything.
    save(store, 4)
    wait_idle(store)
    with pytest.raises(UploadError, match="upload of step 4"):
        store.begin(5)
    assert store.local.status(5) == "uncommitted" and store.local.storage.list_tree("step-000005") == {}
    failing.discard(5)
    save(store, 5)  # raised once: the next save goes ahead
    store.flush()
    assert store.is_durable(5)
    failing.add(5)
    save(store, 6)
    with pytest.raises(UploadError, match="upload of step 6"):
        store.flush()
    store.flush()  # already raised
    failing.add(7)
    save(store, 7)
    with pytest.raises(UploadError, match="upload of step 7"):
        store.close()
    assert store.local_steps()[-1] == 7 and store.durable_steps() == [1, 5]


def test_retention_per_tier_never_drops_a_step_that_is_not_durable(bucket_backend, tmp_path):
    fault = Fault(when=lambda op: op.kind == "create" and op.rel.startswith("step-000003/"), once=False)
    bucket, faulty = wrapped(bucket_backend, faults=fault)
    store = TieredStore(tmp_path / "local", bucket, local_keep_last=1, bucket_retention=RetentionPolicy(keep_last=2))
    for step in (1, 2, 3):
        save(store, step)
        wait_idle(store)
    assert store.local_steps() == [2, 3]  # 1 dropped once durable; 3 never uploaded, so kept
    with pytest.raises(UploadError, match="upload of step 3"):
        store.flush()
    for step in (4, 5):
        save(store, step)
        store.flush()
    assert store.local_steps() == [3, 5]  # 2 and 4 dropped (durable); 3 still the only copy
    assert store.durable_steps() == [4, 5]  # the bucket's retention kept the newest two
    # The bucket's pass deleted step 1, then 2 (after the uploads of 4 and 5); step 3 never landed.
    deleted = [op.rel for op in faulty.ops if op.kind == "delete" and op.rel.endswith("/manifest.json")]
    assert deleted == ["step-000001/manifest.json", "step-000002/manifest.json"]


def test_wait_uploaded_of_a_step_from_an_earlier_process(bucket_backend, tmp_path):
    save(CheckpointStore(tmp_path / "local"), 3)  # committed locally by a process that then died
    store = TieredStore(tmp_path / "local", bucket_backend.url, storage_options=bucket_backend.storage_options)
    assert store.latest_step() == 3 and not store.is_durable(3)
    assert store.wait_uploaded(3, timeout_secs=120) == f"{store.bucket.url}/step-000003"
    assert store.is_durable(3) and store.wait_uploaded(3) == f"{store.bucket.url}/step-000003"
    with pytest.raises(FileNotFoundError, match="step 9 is complete in neither"):
        store.wait_uploaded(9)
    store.close()


class RecordingCallback(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.updates: list[int] = []

    def call(self, *args, **kwargs) -> None:
        self.updates.append(self.value)


def test_copy_checkpoint_checks_and_commits_last(bucket_backend, tmp_path):
    src = CheckpointStore(tmp_path / "src")
    save(src, 7)
    dst = plain(bucket_backend)
    callback = RecordingCallback()
    assert copy_checkpoint(src, 7, dst, callback=callback) == f"{dst.url}/step-000007"
    total = sum(len(v) for v in payloads_for("step7").values())
    assert callback.size == total and callback.updates[-1] == total
    assert same_payloads(src.manifest(7), dst.manifest(7)) and dst.verify(7, deep=True).ok
    with pytest.raises(CommitConflictError):
        copy_checkpoint(src, 7, dst)
    # A local payload changed after its commit (same size): refused, nothing committed at dst.
    save(src, 8)
    entry = src.manifest(8).payloads[1]
    path = Path(src.storage.path(f"step-000008/{entry.path}"))
    path.write_bytes(bytes(len(path.read_bytes())))
    with pytest.raises(IntegrityError, match="crc32c"):
        copy_checkpoint(src, 8, dst)
    assert dst.status(8) == "uncommitted" and dst.steps() == [7]


# -- the OPD layer on a tiered store ---------------------------------------------------------------


class _Config:
    data = {"lr": 0.01}
    checkpoint = types.SimpleNamespace(resume_mode="exact")

    def as_dict(self) -> dict:
        return dict(self.data)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.data).encode()).hexdigest()


class _Adapter:
    def save_pretrained(self, directory: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, "adapter_config.json").write_text('{"r": 2}')


def _training(steps: int):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(steps):
        optimizer.zero_grad()
        layer(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def test_opd_save_latest_and_load_through_a_tiered_store(bucket_backend, tmp_path):
    optimizer, scheduler = _training(2)
    trainer = {"attempted_updates": 3, "successful_updates": 2, "query_update": 2}
    common = dict(config=_Config(), provenance_fingerprints={"code_revision": "x"})
    store = TieredStore(tmp_path / "local", bucket_backend.url, storage_options=bucket_backend.storage_options)
    url = save_opd_checkpoint(checkpoints_dir=store, model=_Adapter(), processor=None, optimizer=optimizer,
                              scheduler=scheduler, trainer_state=trainer, teacher_state={"update_count": 2}, **common)
    local_url = str(tmp_path / "local" / "step-000002")
    assert url == local_url and latest_complete_checkpoint(store) == local_url
    store.close()
    assert store.is_durable(2)

    def load(ref, **extra):
        fresh_optimizer, fresh_scheduler = _training(0)
        teacher = []
        state = load_opd_checkpoint(ref, optimizer=fresh_optimizer, scheduler=fresh_scheduler,
                                    teacher_state_loader=teacher.append, **common, **extra)
        saved = optimizer.state_dict()["state"]
        for key, value in fresh_optimizer.state_dict()["state"].items():
            for name, tensor in value.items():
                assert torch.equal(tensor, saved[key][name])
        assert teacher == [{"update_count": 2}]
        return state

    assert load(local_url) == trainer
    assert load((store, 2)) == trainer
    fresh = TieredStore(tmp_path / "new-machine", bucket_backend.url, storage_options=bucket_backend.storage_options)
    bucket_url = latest_complete_checkpoint(fresh)
    assert bucket_url == f"{fresh.bucket.url}/step-000002"
    assert load(bucket_url, storage_options=bucket_backend.storage_options) == trainer
    assert load((fresh, 2)) == trainer


def test_every_public_store_method_is_tiered():
    """The tiered store composes two stores: it offers the whole store API itself, inherits no
    method it would have to refuse, and has no single storage."""
    from opd_store.store import BaseStore

    api = {name for name in dir(BaseStore) if not name.startswith("_")}
    assert api <= set(vars(TieredStore)) and not issubclass(TieredStore, CheckpointStore)
    assert not hasattr(TieredStore("/tmp/a", "memory://b"), "storage")


def test_bucket_down_local_reads_and_saves_go_on_upload_failure_raised(bucket_backend, tmp_path):
    down = {"on": False}
    bucket, _faulty = wrapped(bucket_backend, read_fault=Fault(when=lambda op: down["on"], once=False))
    store = TieredStore(tmp_path / "local", bucket)
    save(store, 1)
    store.flush()
    down["on"] = True  # every list, size and read of the bucket now fails (InjectedFault)
    assert store.tier_for(1) is store.local
    assert store.read(1, "model.pt") == payloads_for("step1")["model.pt"]
    save(store, 2)  # the bucket check before the save fails: logged, the local commit goes ahead
    assert store.local.is_complete(2)
    with pytest.raises(UploadError, match="upload of step 2"):
        store.flush()
    down["on"] = False
    assert store.durable_steps() == [1] and store.upload_pending() == [2]
    store.close()
    assert store.durable_steps() == [1, 2]


def test_a_legacy_step_in_the_local_tier_is_read_through_the_legacy_adapter(tmp_path):
    """The tiered store knows manifests only; the legacy adapter finds a legacy step in either
    tier, reads it from there, and a save of that step is refused."""
    from opd_store.store import LegacyReader

    step_dir = tmp_path / "local" / "step-000004"
    step_dir.mkdir(parents=True)
    (step_dir / "COMPLETE").write_bytes(b"")
    (step_dir / "training_state.pt").write_bytes(b"legacy-state")
    with TieredStore(tmp_path / "local", tmp_path / "bucket") as store:
        reader = LegacyReader(store)
        assert store.status(4) == "uncommitted" and reader.status(4) == "legacy"
        assert reader.latest_step() == 4 and reader.step_url(4) == str(step_dir)
        assert reader.names(4) == ["training_state.pt"] and reader.read(4, "training_state.pt") == b"legacy-state"
        assert [(info.step, info.status) for info in reader.checkpoints()] == [(4, "legacy")]
        with pytest.raises(CommitConflictError, match="legacy"):
            store.begin(4)
