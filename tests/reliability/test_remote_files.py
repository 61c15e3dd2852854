"""Remote file objects have no ``fileno()``. Saving through them works,
``os.fsync`` is never called for them, and durability comes from closing the object: the payload
exists on the backend only once its writer is closed."""

from __future__ import annotations

import io
import os

import pytest
import torch
from core.helpers import open_store


@pytest.mark.parametrize("backend", ["memory", "s3", "gcs"], indirect=True)
def test_save_without_fileno_durable_at_close(backend, monkeypatch):
    store = open_store(backend)
    fsyncs: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: fsyncs.append(fd))
    tensor = torch.arange(4096, dtype=torch.float64)
    raw = backend.raw_fs()
    with store.begin(5) as txn:
        with txn.open("model.pt") as writer:
            handle = writer._handle
            with pytest.raises((io.UnsupportedOperation, AttributeError, OSError)):
                handle.fileno()
            torch.save({"w": tensor}, writer)
            path = f"{backend.raw_root()}/step-000005/{txn.attempt_id}/model.pt"
            if backend.name != "memory":  # fsspec's memory files are visible from open()
                raw.invalidate_cache()
                assert not raw.exists(path)  # buffered, not yet durable
        txn.settle()  # a remote store finishes an upload in the background after close()
        raw.invalidate_cache()
        assert raw.size(path) == txn.entries[0].size_bytes  # published
    assert fsyncs == []
    assert store.latest_step() == 5
    assert torch.equal(torch.load(store.open(5, "model.pt"), weights_only=True)["w"], tensor)
