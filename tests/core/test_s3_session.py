"""Every S3 store gets its own botocore session (credentials resolved per store) and shares the
process's one parsed copy of botocore's data (the loader)."""

from __future__ import annotations

from fsspec.asyn import sync

from opd_store import CheckpointStore
from opd_store.storage.s3._session import new_session


def _access_key(store: CheckpointStore) -> str:
    fs = store.storage.fs
    return sync(fs.loop, fs.session.get_credentials).access_key


def test_stores_share_the_data_loader_not_the_session_or_its_credentials(s3_backend, monkeypatch):
    # No key in the options: each store's session finds its credentials in the environment.
    options = {k: v for k, v in s3_backend.storage_options.items() if k not in ("key", "secret")}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "first-key")
    first = CheckpointStore(s3_backend.url, storage_options=options)
    assert first.steps() == []  # moto takes any key
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "second-key")
    second = CheckpointStore(s3_backend.url, storage_options=options)
    with second.begin(3) as txn:
        txn.write_bytes("a.bin", b"abc")
    assert first.steps() == [3] and first.read(3, "a.bin") == b"abc"
    sessions = [store.storage.fs.session for store in (first, second)]
    assert sessions[0] is not sessions[1]
    assert sessions[0].get_component("data_loader") is sessions[1].get_component("data_loader")
    assert [_access_key(first), _access_key(second)] == ["first-key", "second-key"]


def test_a_session_the_caller_gives_is_kept(s3_backend):
    mine = new_session({})
    store = CheckpointStore(s3_backend.url, storage_options={**s3_backend.storage_options, "session": mine})
    assert store.steps() == [] and store.storage.fs.session is mine


def test_another_data_path_gets_its_own_loader(monkeypatch, tmp_path):
    default = new_session({}).get_component("data_loader")
    assert new_session({}).get_component("data_loader") is default
    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
    other = new_session({}).get_component("data_loader")
    assert other is not default and str(tmp_path) in other.search_paths
