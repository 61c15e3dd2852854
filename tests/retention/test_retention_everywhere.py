"""Every way to ask for retention works on every kind of store, and a pass that cannot run is the
caller's error at the next sync point.

The table: six ways (``retention=`` on ``save_opd_checkpoint``, on ``AsyncCheckpointer.save``, on a
multi-rank save, ``opd-store train --keep-last``, ``TieredStore(bucket_retention=...)``,
``opd-store gc``) times the kinds of store (plain local, memory, S3 on moto, GCS on
fake-gcs-server, and tiered: a local directory in front of an S3 bucket). Each cell saves steps
1-4 with ``keep_last=1`` and asserts the steps left in each tier, read back through a plain store
of that tier: ``[4]`` in a plain store and in a tiered store's bucket, ``[3, 4]`` in its local tier
(which keeps its own newest two). ``TieredStore(bucket_retention=)`` is a tiered store by
definition: its columns are the bucket's backends. A multi-rank save needs a store every rank
sees, so ``memory://`` (one per process) has no cell there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from opd_testkit import forkserver
from opd_testkit import opd as helpers
from opd_testkit.stores import Backend

from opd_store import AsyncCheckpointer, CheckpointStore, TieredStore, save_opd_checkpoint
from opd_store.cli import main
from opd_store.errors import BackgroundSaveError, RetentionError, UploadError
from opd_store.retention import RetentionPolicy
from opd_store.testing import Fault, FaultyStorage, InjectedFault

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
KEEP_ONE = RetentionPolicy(keep_last=1)
PLAIN = ("local", "memory", "s3", "gcs")
KINDS = (*PLAIN, "tiered")
LEFT_PLAIN = {"store": [4]}
LEFT_TIERED = {"bucket": [4], "local": [3, 4]}


@dataclasses.dataclass
class Target:
    """A store of one kind: what the API is given, what the CLI is given, and each tier to check."""

    kind: str
    backend: Backend
    local_dir: str | None = None

    def open(self, **tiered_kwargs):
        if self.local_dir is None:
            return CheckpointStore(self.backend.url, storage_options=self.backend.storage_options)
        # From URLs, as the user who met the bug built it (the bucket's options passed along).
        return TieredStore(self.local_dir, self.backend.url, storage_options=self.backend.storage_options,
                           **tiered_kwargs)

    def steps_left(self) -> dict[str, list[int]]:
        tiers = {"store" if self.local_dir is None else "bucket": self.backend}
        if self.local_dir is not None:
            tiers["local"] = Backend("local", self.local_dir, {})
        return {name: CheckpointStore(b.url, storage_options=b.storage_options).steps() for name, b in tiers.items()}

    def expected(self) -> dict[str, list[int]]:
        return LEFT_PLAIN if self.local_dir is None else LEFT_TIERED

    def cli_args(self) -> list[str]:
        args = []
        for key, value in self.backend.storage_options.items():
            args += ["--storage-option", f"{key}={json.dumps(value)}"]
        return args + (["--local-tier", self.local_dir] if self.local_dir is not None else [])


def make_target(request, tmp_path, kind: str) -> Target:
    if kind == "local":
        return Target(kind, request.getfixturevalue("local_backend"))
    if kind == "memory":
        return Target(kind, Backend("memory", "memory://opd-retention/run", {}))
    if kind == "s3":
        return Target(kind, request.getfixturevalue("s3_backend"))
    if kind == "gcs":
        return Target(kind, request.getfixturevalue("gcs_backend"))
    return Target(kind, request.getfixturevalue("s3_backend"), str(tmp_path / "local-tier"))


@pytest.fixture(params=KINDS)
def target(request, tmp_path) -> Target:
    return make_target(request, tmp_path, request.param)


def _save(store, step: int, **kwargs) -> str:
    return save_opd_checkpoint(**helpers.save_kwargs(store, successful=step, **kwargs))


# -- the table --------------------------------------------------------------------------------------


def test_save_opd_checkpoint_retention(target):
    """Its ``tiered`` cell is the bug that started it, as a user met it: ``TieredStore(local dir,
    S3 URL, storage_options=...)`` and ``retention=`` on each save kept every bucket step."""
    store = target.open()
    for step in (1, 2, 3, 4):
        _save(store, step, retention=KEEP_ONE)
    if target.local_dir is not None:
        store.flush()
        assert CheckpointStore(target.backend.url, storage_options=target.backend.storage_options).steps() == [4]
    store.close()
    assert target.steps_left() == target.expected()


def test_async_checkpointer_retention(target):
    store = target.open()
    with AsyncCheckpointer() as checkpointer:
        for step in (1, 2, 3, 4):
            checkpointer.save(**helpers.save_kwargs(store, successful=step, retention=KEEP_ONE))
    store.close()
    assert target.steps_left() == target.expected()


@pytest.mark.parametrize("bucket_kind", PLAIN)
def test_tiered_store_bucket_retention(request, tmp_path, bucket_kind):
    bucket = make_target(request, tmp_path, bucket_kind)
    target = Target("tiered", bucket.backend, str(tmp_path / "local-tier"))
    store = target.open(bucket_retention=KEEP_ONE)
    for step in (1, 2, 3, 4):
        _save(store, step)
    store.close()
    assert target.steps_left() == LEFT_TIERED


def test_opd_store_gc(target, capsys):
    store = target.open()
    for step in (1, 2, 3, 4):
        _save(store, step)
    store.close()
    assert main(["gc", target.backend.url, "--keep-last", "1", "--yes", *target.cli_args()]) == 0
    assert target.steps_left() == target.expected()
    out = capsys.readouterr().out
    assert "deleted step 3" in out and ("local tier " in out) == (target.local_dir is not None)


def test_opd_store_train_keep_last(target, tmp_path):
    assert main(["train", "--store", target.backend.url, "--updates", "4", "--checkpoint-every", "1",
                 "--keep-last", "1", "--log", str(tmp_path / "log.jsonl"), *target.cli_args()]) == 0
    assert target.steps_left() == target.expected()


@pytest.fixture(scope="module")
def multirank_left(request, tmp_path_factory) -> dict[str, dict[str, list[int]]]:
    """One gloo process group of two ranks saving to every kind a multi-rank save can reach."""
    out = tmp_path_factory.mktemp("multirank")
    targets = {}
    for kind in ("local", "s3", "gcs", "tiered"):
        if kind == "local":
            backend, local = Backend("local", str(out / "store"), {}), None
        elif kind == "tiered":
            backend, local = Backend("local", str(out / "bucket"), {}), str(out / "local-tier")
        elif kind == "s3":
            moto = request.getfixturevalue("moto_s3")
            backend = moto.new_backend(bucket="opd-multirank")
            local = None
        else:
            backend, local = request.getfixturevalue("fake_gcs").new_backend(), None
        targets[kind] = {"url": backend.url, "storage_options": backend.storage_options, "local": local}
    # A rendezvous file of this run (no port to choose: parallel workers cannot collide on one).
    init_method = f"file://{out / f'rendezvous-{uuid.uuid4().hex}'}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = [forkserver.popen([sys.executable, str(HERE / "retention_ranks.py"), json.dumps(dict(
        rank=rank, world_size=2, init_method=init_method, targets=targets, out=str(out)))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    logs = [proc.communicate(timeout=900)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(log[-3000:] for log in logs)
    return json.loads((out / "result.json").read_text())


@pytest.mark.timeout(1200)
@pytest.mark.xdist_group("multirank-retention")  # one worker runs the module fixture's process group once
@pytest.mark.parametrize("kind", ("local", "s3", "gcs", "tiered"))
def test_multirank_save_retention(multirank_left, kind):
    assert multirank_left[kind] == (LEFT_TIERED if kind == "tiered" else LEFT_PLAIN)


# -- a pass that cannot run is the caller's error, at the next sync point -----------------------------


def _deletes_fail(store: CheckpointStore) -> CheckpointStore:
    return CheckpointStore.from_storage(FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "delete", once=False)))


def test_a_failing_pass_after_a_synchronous_save_is_raised_by_that_save(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    _save(store, 1)
    with pytest.raises(RetentionError, match="after committing step 2") as caught:
        _save(_deletes_fail(store), 2, retention=KEEP_ONE)
    assert caught.value.url == store.step_url(2) and isinstance(caught.value.__cause__, InjectedFault)
    assert store.steps() == [1, 2] and store.is_complete(2)


def test_a_failing_pass_after_an_asynchronous_save_is_raised_at_result_or_the_next_save(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    _save(store, 1)
    failing = _deletes_fail(store)
    checkpointer = AsyncCheckpointer()
    handle = checkpointer.save(**helpers.save_kwargs(failing, successful=2, retention=KEEP_ONE))
    with pytest.raises(RetentionError, match="after committing step 2"):
        handle.result(timeout_secs=120)
    checkpointer.save(**helpers.save_kwargs(failing, successful=3, retention=KEEP_ONE)).task.wait(120)
    with pytest.raises(BackgroundSaveError, match="step 3 failed in the background") as caught:
        checkpointer.close()
    assert isinstance(caught.value.__cause__, RetentionError)
    assert store.steps() == [1, 2, 3] and store.is_complete(3)


def test_a_pass_that_cannot_run_on_a_tiered_store_is_raised_at_the_next_save(tmp_path):
    bucket = CheckpointStore(tmp_path / "bucket")
    _save(bucket, 1)
    store = TieredStore(tmp_path / "local", _deletes_fail(bucket))
    _save(store, 2, retention=KEEP_ONE)
    store.uploads.saves.wait(120)
    with pytest.raises(UploadError, match="retention after the upload of step 2") as caught:
        _save(store, 3)
    assert isinstance(caught.value.__cause__, RetentionError)
    assert store.durable_steps() == [1, 2] and store.local_steps() == [2]
    store.close()
