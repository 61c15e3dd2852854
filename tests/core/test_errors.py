"""Error classes, storage options that reach every call, and backends without a create-only write."""

from __future__ import annotations

import socket
import sys

import pytest
from fsspec.implementations.memory import MemoryFileSystem

import opd_store
from opd_store import (
    AmbiguousCommitError,
    CheckpointNotFoundError,
    CheckpointStore,
    CommitConflictError,
    CommitError,
    IncompleteCheckpointError,
    IntegrityError,
    ManifestError,
    OpdStoreError,
    ResumeMismatchError,
    StoreUnreachableError,
    UnsafeCheckpointError,
    UnsupportedBackendError,
)
from opd_store.storage import CheckThenPutStorage
from opd_store.store import LegacyReader, split_checkpoint_url

from .helpers import Raw, save


@pytest.mark.parametrize(
    "cls,builtin",
    [
        (CheckpointNotFoundError, FileNotFoundError),
        (CommitConflictError, FileExistsError),
        (IntegrityError, ValueError),
        (ManifestError, ValueError),
        (IncompleteCheckpointError, ValueError),
        (UnsupportedBackendError, ValueError),
        (ResumeMismatchError, ValueError),
        (UnsafeCheckpointError, ValueError),
        (CommitError, OSError),
        (AmbiguousCommitError, CommitError),
        (StoreUnreachableError, OSError),
    ],
)
def test_error_classes_subclass_root_and_builtin(cls, builtin):
    assert issubclass(cls, OpdStoreError) and issubclass(cls, builtin)
    assert cls.__name__ in opd_store.__all__
    err = cls("message")
    assert isinstance(err, Exception) and str(err) == "message"


def test_every_public_error_is_rooted():
    errors = [getattr(opd_store, n) for n in opd_store.__all__ if n.endswith("Error") and n != "OpdStoreError"]
    assert len(errors) >= 11
    for error in errors:
        assert issubclass(error, OpdStoreError), error
        # ... and also the builtin that matches its meaning, never a bare Exception subclass.
        assert issubclass(error, (FileNotFoundError, FileExistsError, ValueError, OSError)), error


def test_backend_errors_kept_as_cause(tmp_path):
    store = CheckpointStore(tmp_path / "s")
    txn = save_one(store, 1)
    (tmp_path / "s" / "step-000001" / txn.attempt_id / "m.pt").unlink()
    with pytest.raises(IncompleteCheckpointError) as caught:
        store.read(1, "m.pt")
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    (tmp_path / "s" / "step-000001" / "manifest.json").write_bytes(b"[1, 2")
    with pytest.raises(ManifestError) as caught:
        store.manifest(1)
    assert type(caught.value.__cause__).__name__ == "JSONDecodeError"
    # Legacy step with a missing file (read through the legacy adapter).
    (tmp_path / "s" / "step-000004").mkdir()
    (tmp_path / "s" / "step-000004" / "COMPLETE").write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError) as caught:
        LegacyReader(store).read(4, "nope.pt")
    assert isinstance(caught.value.__cause__, FileNotFoundError)


def save_one(store, step):
    return save(store, step, {"m.pt": b"x" * 10})


# -- storage options ---------------------------------------------------------------------------


def _dead_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _every_call(store: CheckpointStore, options: dict) -> None:
    save(store, 1, {"m.pt": b"one", "a/b.bin": b"b"})
    save(store, 2, {"m.pt": b"two"})
    assert store.steps() == [1, 2]
    assert store.latest_step() == 2
    assert store.is_complete(2) and store.status(1) == "complete"
    assert store.manifest(2).step == 2
    assert store.names(1) == ["m.pt", "a/b.bin"]
    assert store.read(1, "a/b.bin") == b"b" and store.open(2, "m.pt").read() == b"two"
    assert store.verify(1, deep=True).ok
    assert [i.status for i in store.checkpoints()] == ["complete", "complete"]
    with pytest.raises(CommitConflictError):
        store.begin(2)
    store.delete(2)
    assert store.steps() == [1] and store.latest_step() == 1
    other, step = split_checkpoint_url(store.step_url(1), options)
    assert step == 1 and other.read(1, "m.pt") == b"one"


def test_s3_storage_options_reach_every_call(s3_backend, moto_s3, monkeypatch):
    # Where a default client (no endpoint_url) would go: nowhere that answers.
    dead = _dead_endpoint()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    import s3fs

    bucket = s3_backend.url[len("s3://"):].split("/")[0]
    default = s3fs.S3FileSystem(
        skip_instance_cache=True, key="testing", secret="testing", client_kwargs={"region_name": "us-east-1"},
        config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2},
    )
    with pytest.raises(Exception) as caught:
        default.ls(bucket)
    assert dead in str(caught.value)

    options = dict(s3_backend.storage_options)
    store = CheckpointStore(s3_backend.url, storage_options=options)
    assert store.storage_options == options
    fs = store.storage.fs
    fs.connect()
    urls: list[str] = []
    fs.s3.meta.events.register("before-send.s3", lambda request, **_kw: urls.append(request.url))
    _every_call(store, options)
    assert len(urls) > 20
    assert all(url.startswith(moto_s3.endpoint_url + "/") for url in urls), [u for u in urls if moto_s3.endpoint_url not in u]
    # The objects really are in moto (boto3 against the moto endpoint, explicitly).
    assert any(k.endswith("step-000001/manifest.json") for k in Raw(s3_backend, moto_s3).keys())


def test_gcs_storage_options_reach_every_call(gcs_backend, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", _dead_endpoint())  # where a default gcsfs would go
    options = dict(gcs_backend.storage_options)
    store = CheckpointStore(gcs_backend.url, storage_options=options)
    _every_call(store, options)


# -- a backend without a create-only write -------------------------------------------------------


class CheckThenPutFS(MemoryFileSystem):
    """An fsspec protocol opd_store does not know: no create-only write it can rely on."""

    protocol = ("opdctp",)

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("opdctp://"):
            path = path[len("opdctp://"):]
        return super()._strip_protocol(path)


@pytest.fixture
def ctp_protocol(monkeypatch):
    registry = sys.modules["fsspec.registry"]._registry
    monkeypatch.setitem(registry, "opdctp", CheckThenPutFS)
    return "opdctp://ctp-bucket/run"


def test_check_then_put_backend_refused_by_default(ctp_protocol):
    # Refused when the store is opened, before any request: the message names the URL and what
    # opd_store supports, and the opt-in.
    with pytest.raises(UnsupportedBackendError) as caught:
        CheckpointStore(ctp_protocol)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert message.startswith(f"{ctp_protocol}: URL scheme 'opdctp' has no create-only write; ")
    assert "s3://" in message and "gs://" in message and "allow_check_then_put=True" in message
    assert [k for k in MemoryFileSystem.store if "ctp-bucket" in k] == []  # nothing uploaded
    # A backend built without the opt-in (directly) still refuses the commit itself.
    storage = CheckThenPutStorage(MemoryFileSystem(), "/ctp-bucket/run", "opdctp://ctp-bucket/run",
                                  allow_check_then_put=False)
    with pytest.raises(UnsupportedBackendError):
        storage.create_exclusive("step-000001/manifest.json", b"{}")
    with pytest.raises(UnsupportedBackendError):
        CheckpointStore.from_storage(storage).begin(1)
    assert [k for k in MemoryFileSystem.store if "ctp-bucket" in k] == []


def test_check_then_put_backend_with_opt_in(ctp_protocol):
    store = CheckpointStore(ctp_protocol, allow_check_then_put=True)
    assert "NOT atomic" in store.storage.commit_primitive
    save(store, 1, {"m.pt": b"one"})
    assert store.steps() == [1] and store.latest_step() == 1 and store.read(1, "m.pt") == b"one"
    with pytest.raises(CommitConflictError):
        store.begin(1)
    # Two attempts begun before either commits: the check catches the later one.
    first, second = store.begin(2), store.begin(2)
    first.write_bytes("m.pt", b"first")
    second.write_bytes("m.pt", b"second")
    first.commit()
    with pytest.raises(CommitConflictError):
        second.commit()
    assert store.read(2, "m.pt") == b"first"
    assert store.manifest(2).attempt_id == first.attempt_id
