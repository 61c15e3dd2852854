"""No rename, move, copy or symlink anywhere in a save and commit.

Three layers of instrumentation, each independent of the others:

* the store's fsspec filesystem is replaced by a proxy that records every method the storage
  layer calls on it;
* the filesystem class's own move/copy/link methods (sync and async, so s3fs/gcsfs internals are
  covered too) are replaced by traps for the duration of the test;
* below fsspec: ``os``/``shutil`` rename/copy/symlink functions (local), every botocore operation
  sent by the store's s3fs client (S3), every JSON-API call of gcsfs (GCS).
"""

from __future__ import annotations

import os
import shutil

import torch

from .helpers import open_store

FORBIDDEN_FS = {
    "mv", "_mv", "move", "rename", "copy", "_copy", "cp", "cp_file", "_cp_file", "mv_file", "_mv_file",
    "symlink", "link", "ln", "_copy_basic", "_copy_etag_preserved", "_copy_managed",
}
FORBIDDEN_OS = [(os, "rename"), (os, "replace"), (os, "renames"), (os, "symlink"), (shutil, "move"),
                (shutil, "copy"), (shutil, "copy2"), (shutil, "copyfile"), (shutil, "copytree")]
ALLOWED_S3_OPERATIONS = {
    "HeadObject", "GetObject", "ListObjectsV2", "PutObject", "DeleteObject", "DeleteObjects",
    "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "AbortMultipartUpload",
}


class FsSpy:
    """A proxy over an fsspec filesystem recording the names of the methods called on it."""

    def __init__(self, fs) -> None:
        self._fs = fs
        self.calls: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr
        calls = self.calls

        def recorded(*args, **kwargs):
            calls.append(name)
            return attr(*args, **kwargs)

        return recorded


def _full_cycle(store) -> None:
    state = {"w": torch.randn(256, 64), "step": torch.tensor(3)}
    with store.begin(3, metadata={"successful_updates": 3}) as txn:
        with txn.open("model.pt") as writer:
            torch.save(state, writer)
        txn.write_bytes("adapter/config.json", b'{"r": 8}')
        txn.write_bytes("empty.bin", b"")
    assert store.latest_step() == 3 and store.is_complete(3)
    assert torch.equal(torch.load(store.open(3, "model.pt"), weights_only=True)["w"], state["w"])
    assert store.verify(3, deep=True).ok
    assert [i.status for i in store.checkpoints()] == ["complete"]
    store.delete(3)
    assert store.steps() == []


def test_save_and_commit_never_rename_or_copy(backend, monkeypatch):
    store = open_store(backend)
    fs = store.storage.fs
    trapped: list[str] = []

    # 1. traps on the filesystem class (catches internal calls too)
    def make_trap(name):
        def trap(*_args, **_kwargs):
            trapped.append(name)
            raise AssertionError(f"{type(fs).__name__}.{name} called during a save")

        return trap

    for name in FORBIDDEN_FS:
        if hasattr(type(fs), name):
            monkeypatch.setattr(type(fs), name, make_trap(name))

    # 2. below fsspec
    below: list[str] = []
    for module, name in FORBIDDEN_OS:
        real = getattr(module, name)

        def recording(*args, _real=real, _name=f"{module.__name__}.{name}", **kwargs):
            below.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    links: list[tuple[str, str]] = []
    real_link = os.link

    def recording_link(src, dst, *args, **kwargs):
        links.append((os.fspath(src), os.fspath(dst)))
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", recording_link)
    s3_operations: list[str] = []
    gcs_calls: list[tuple[str, str]] = []
    if backend.name == "s3":
        fs.connect()
        fs.s3.meta.events.register("before-call.s3", lambda model, **_kw: s3_operations.append(model.name))
    if backend.name == "gcs":
        real_call = type(fs)._call

        async def recording_call(self, method, path, *args, **kwargs):
            gcs_calls.append((method, str(path)))
            return await real_call(self, method, path, *args, **kwargs)

        monkeypatch.setattr(type(fs), "_call", recording_call)

    # 3. the proxy in the store's path
    spy = FsSpy(fs)
    store.storage.fs = spy

    _full_cycle(store)

    assert trapped == []
    assert below == []
    assert not FORBIDDEN_FS & set(spy.calls), spy.calls
    # The proxy really was in the path: the save wrote and listed through it.
    assert {"open", "pipe_file", "rm", "find", "ls", "cat_file"} & set(spy.calls)
    assert "find" in spy.calls and "cat_file" in spy.calls
    if backend.name == "local":
        # The commit is one hard link of a temp file to the manifest name, nothing else.
        assert len(links) == 1 and links[0][1].endswith("/step-000003/manifest.json")
        assert "open" not in spy.calls  # local payloads are plain files the storage opens itself
    else:
        assert links == []
        assert "pipe_file" in spy.calls  # the manifest create
    if backend.name == "s3":
        assert s3_operations and set(s3_operations) <= ALLOWED_S3_OPERATIONS, s3_operations
        assert "PutObject" in s3_operations
    if backend.name == "gcs":
        assert gcs_calls
        assert not [c for c in gcs_calls if any(w in c[1] for w in ("copyTo", "rewriteTo", "compose"))], gcs_calls
