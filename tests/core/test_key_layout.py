"""Key layouts (docs/protocol.md, "Key layouts"): where a save's payloads go is a storage option
recorded in the manifest; readers, ``verify``, ``cp``, retention and ``gc`` follow the manifest on
every backend; older checkpoints load unchanged; bad layouts and manifests naming objects outside
their layout are refused."""

from __future__ import annotations

import collections
import dataclasses
import json
import time

import pytest

from opd_store import CheckpointStore, ManifestError
from opd_store.format import KeyLayout, object_rel
from opd_store.retention import RetentionPolicy, collect_garbage
from opd_store.store import copy_checkpoint

from .helpers import open_store

SPREAD = {"key_layout": "spread", "key_prefixes": 4}


def _with(backend, **options):
    return dataclasses.replace(backend, storage_options={**backend.storage_options, **options})


def _save_ranks(store_of_rank, step: int, world_size: int = 3) -> dict[str, bytes]:
    """A multi-rank save: rank 0 commits, ranks 1.. write parts (each its own store); the bytes
    of every payload by name."""
    written = {}
    txn = store_of_rank(0).begin(step, world_size=world_size)
    for rank in range(1, world_size):
        with store_of_rank(rank).begin_part(step, attempt_id=txn.attempt_id, rank=rank, world_size=world_size) as part:
            written[f"shard-{rank}.bin"] = data = bytes([step, rank]) * (100 + rank)
            part.write_bytes(f"shard-{rank}.bin", data)
        for entry in part.entries:
            txn.add_entry(entry)
    with txn:
        written["shard-0.bin"] = data = bytes([step, 0]) * 100
        txn.write_bytes("shard-0.bin", data)
    return written


def test_the_spread_layout_on_every_backend(backend, raw):
    spread = _with(backend, **SPREAD)
    stores = [open_store(spread) for _ in range(3)]
    written = {step: _save_ranks(lambda rank: stores[rank], step) for step in (1, 2, 3)}
    store = stores[0]
    manifest = store.manifest(2)
    assert (manifest.format_version, manifest.layout) == (2, KeyLayout(strategy="spread", prefixes=4))
    # Every payload lies under one of the layout's prefixes, ahead of the step; only the manifest
    # stays under the step prefix.
    keys = raw.keys()
    for entry in manifest.payloads:
        assert entry.prefix in (".spread/00", ".spread/01", ".spread/02", ".spread/03")
        assert keys[object_rel(2, entry.prefix, entry.path)] == entry.size_bytes
    assert [k for k in keys if k.startswith("step-000002/")] == ["step-000002/manifest.json"]
    # Consecutive ranks writing the same file name land on consecutive prefixes.
    prefixes = [manifest.entry(f"shard-{rank}.bin").prefix for rank in range(3)]
    assert len(set(prefixes)) == 3
    # Readers follow the manifest.
    reader = open_store(backend)  # opened without the layout options: reads any layout
    assert reader.steps() == [1, 2, 3] and reader.latest_step() == 3
    assert all(reader.read(2, name) == data for name, data in written[2].items())
    assert reader.verify(2, deep=True).ok
    assert [(i.step, i.status, i.total_size_bytes) for i in reader.checkpoints()] == [  # payloads and manifest
        (s, "complete", sum(map(len, written[s].values())) + keys[f"step-{s:06d}/manifest.json"]) for s in (1, 2, 3)]
    # A copy into a store of the step layout, and back.
    plain = CheckpointStore(f"memory://layout-copy/{backend.name}")
    copy_checkpoint(reader, 2, plain)
    assert plain.manifest(2).format_version == 1 and plain.read(2, "shard-1.bin") == written[2]["shard-1.bin"]
    back = CheckpointStore(f"memory://layout-copy-back/{backend.name}", storage_options=SPREAD)
    copy_checkpoint(plain, 2, back, verify_deep=True)
    assert back.manifest(2).layout.strategy == "spread" and back.read(2, "shard-2.bin") == written[2]["shard-2.bin"]
    # Delete and gc: nothing of a deleted step is left under any prefix; a leftover attempt under
    # a spread prefix is one orphan with its other prefixes.
    store.delete(1)
    assert not [k for k in raw.keys() if "step-000001" in k]
    raw.put(".spread/03/step-000003/attempt-20200101T000000Z-0123456789ab/shard-7.bin", b"left")
    raw.put("step-000003/attempt-20200101T000000Z-0123456789ab/shard-8.bin", b"over")
    report = collect_garbage(store, RetentionPolicy(keep_last=1), orphans_older_than_secs=60, dry_run=False,
                             now_secs=time.time() + 3600)  # the store's clock an hour on
    assert report.deleted_steps == [2]
    assert [(o.rel, o.spread_rels, o.size_bytes) for o in report.orphans] == [
        ("step-000003/attempt-20200101T000000Z-0123456789ab",
         (".spread/03/step-000003/attempt-20200101T000000Z-0123456789ab",), 8)]
    left = raw.keys()
    assert not [k for k in left if "step-000002" in k or "0123456789ab" in k]
    assert sorted(k.split("/")[-1] for k in left) == ["manifest.json", "shard-0.bin", "shard-1.bin", "shard-2.bin"]
    assert store.verify(3, deep=True).ok


def test_a_step_layout_manifest_is_written_as_version_1_always_was():
    store = CheckpointStore("memory://layout-v1/run")
    with store.begin(1) as txn:
        txn.write_bytes("model.bin", b"weights")
    raw = json.loads(store.storage.read_bytes("step-000001/manifest.json"))
    assert raw["format_version"] == 1
    assert list(raw) == ["format", "format_version", "step", "attempt_id", "writer", "created_at", "world_size",
                         "payloads", "metadata"]
    assert list(raw["payloads"][0]) == ["name", "path", "size_bytes", "crc32c"]


def test_older_checkpoints_load_in_a_store_opened_with_the_spread_layout(tmp_path):
    old = CheckpointStore(tmp_path / "store")
    with old.begin(1) as txn:
        txn.write_bytes("model.bin", b"old weights")
    store = CheckpointStore(tmp_path / "store", storage_options=SPREAD)
    assert store.read(1, "model.bin") == b"old weights" and store.verify(1, deep=True).ok
    for step in (2, 3):
        with store.begin(step) as txn:
            txn.write_bytes("model.bin", bytes([step]) * 10)
    assert [store.manifest(s).layout.strategy for s in (1, 2, 3)] == ["step", "spread", "spread"]
    # Retention after a save deletes steps of both layouts, every object of each.
    from opd_store.pipeline import AfterCommit

    with store.begin(4) as txn:
        txn.write_bytes("model.bin", b"4")
    AfterCommit(store, 4, retention=RetentionPolicy(keep_last=1)).run(txn.committed_url)
    assert store.steps() == [4]
    files = sorted(str(p.relative_to(tmp_path / "store")) for p in (tmp_path / "store").rglob("*") if p.is_file())
    assert [f for f in files if "step-00000" in f and "step-000004" not in f] == []


@pytest.mark.parametrize("options, named", [
    ({"key_layout": "hashed"}, "unknown layout 'hashed' (known: step, spread)"),
    ({"key_layout": "spread", "key_prefixes": 0}, "key_prefixes must be an integer from 1 to 256, got 0"),
    ({"key_layout": "spread", "key_prefixes": 300}, "key_prefixes must be an integer from 1 to 256, got 300"),
    ({"key_prefixes": 8}, "key_prefixes=8 needs key_layout=spread"),
])
def test_a_layout_option_that_is_not_recognised_is_refused_naming_it(options, named):
    with pytest.raises(ValueError, match="storage option key_") as caught:
        CheckpointStore("memory://layout-bad/run", storage_options=options)
    assert named in str(caught.value)


def _tampered(store: CheckpointStore, step: int, change) -> None:
    raw = json.loads(store.storage.read_bytes(f"step-{step:06d}/manifest.json"))
    change(raw)
    store.storage.delete(f"step-{step:06d}/manifest.json")
    store.storage.create_exclusive(f"step-{step:06d}/manifest.json", json.dumps(raw).encode())


@pytest.mark.parametrize("change, why", [
    (lambda m: m["payloads"][0].update(prefix=".spread/09"), "outside the prefixes the spread layout allows"),
    (lambda m: m["payloads"][0].update(prefix="pins"), "outside the prefixes the spread layout allows"),
    (lambda m: m["payloads"][0].update(prefix="../.."), "outside the prefixes the spread layout allows"),
    (lambda m: m.update(format_version=1), "the spread layout needs format_version 2"),
    (lambda m: (m.pop("layout"), m.update(format_version=1)), "outside the prefixes the step layout allows"),
    (lambda m: m.update(layout={"strategy": "zigzag", "prefixes": 4}), "Input should be 'step' or 'spread'"),
])
def test_a_manifest_naming_an_object_outside_its_layout_is_corrupt(change, why):
    store = CheckpointStore("memory://layout-corrupt/run", storage_options=SPREAD)
    for step in (1, 2):
        with store.begin(step) as txn:
            txn.write_bytes("model.bin", b"weights")
    _tampered(store, 2, change)
    assert store.status(2) == "corrupt" and why in store.step_state(2).problems[0].detail
    assert store.verify(2).status == "corrupt"
    with pytest.raises(ManifestError, match="outside|needs|Input should"):
        store.read(2, "model.bin")
    assert store.latest_step() == 1
    # Retention keeps it for inspection, as every damaged step.
    report = collect_garbage(store, RetentionPolicy(keep_last=1), dry_run=False)
    assert report.plan.untouched == {2: "corrupt"} and store.steps() == [1, 2]


def test_ranks_opened_with_different_layouts_fail_the_save_naming_the_option():
    ranks = [CheckpointStore("memory://layout-mixed/run"), CheckpointStore("memory://layout-mixed/run",
                                                                             storage_options=SPREAD)]
    with pytest.raises(ValueError, match="every rank must open the store with the same key_layout"):
        _save_ranks(lambda rank: ranks[rank], 1, world_size=2)
    assert ranks[0].steps() == []


def test_the_spread_layout_balances_the_files_every_rank_writes():
    layout = KeyLayout.named("spread", 16)
    for name in ("__{}_0.distcp", "rng-rank-{:02d}.pt", "shard-{:05d}.bin"):
        per_prefix = collections.Counter(layout.prefix_for(rank, name.format(rank)) for rank in range(512))
        assert sorted(per_prefix.values()) == [32] * 16, name
    assert KeyLayout.named("step").prefix_for(7, "x") is None and KeyLayout.named("step").prefix_names() == ()
