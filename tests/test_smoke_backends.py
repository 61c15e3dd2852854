"""Round trip through every backend, checked through the raw backend as well as the store."""

import torch

from opd_store import CheckpointStore


def test_round_trip_every_backend(backend):
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    tensor = torch.arange(1000, dtype=torch.float32)
    with store.begin(3, metadata={"successful_updates": 3}) as txn:
        with txn.open("model.pt") as writer:
            torch.save({"w": tensor}, writer)
        txn.write_bytes("config.yaml", b"lr: 0.1\n")
    assert store.steps() == [3]
    assert store.latest_step() == 3
    loaded = torch.load(store.open(3, "model.pt"), weights_only=True)
    assert torch.equal(loaded["w"], tensor)
    assert store.read(3, "config.yaml") == b"lr: 0.1\n"
    manifest = store.manifest(3)
    raw = backend.raw_fs()
    root = backend.raw_root()
    raw_manifest = raw.cat_file(f"{root}/step-000003/manifest.json")
    assert b'"attempt_id"' in raw_manifest
    entry = manifest.entry("config.yaml")
    assert raw.cat_file(f"{root}/step-000003/{entry.path}") == b"lr: 0.1\n"
    assert entry.size_bytes == 8
