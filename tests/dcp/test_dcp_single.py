"""The DCP storage layer in one process: any store (tiered too), safe metadata, adopting a
checkpoint DCP's own FileSystemWriter wrote into a store's prefix (``opd-store import-dcp``)."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opd_testkit.stores import open_store

from opd_store import CheckpointStore, TieredStore
from opd_store.cli import main as cli_main
from opd_store.dcp import StoreReader, StoreWriter, adopt_dcp_checkpoint, load, save
from opd_store.dcp._metadata_io import loads_metadata
from opd_store.errors import CommitConflictError, IncompleteCheckpointError, UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 6)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": {"counter": seed, "note": "x"}}


def _assert_equal_states(a: dict, b: dict) -> None:
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for index, state in a["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optim"]["state"][index][key]), (index, key)
    assert a["extra"] == b["extra"]


def test_roundtrip_on_a_tiered_store(tmp_path, moto_s3):
    """A tiered store: committed on the local tier, uploaded, then complete in the bucket."""
    bucket = open_store(moto_s3.new_backend())
    with TieredStore(tmp_path / "local", bucket) as store:
        assert save(_state(1), store, 3) == store.step_url(3)
        store.flush()
        assert bucket.is_complete(3) and bucket.manifest(3).metadata["checkpoint_format"] == "dcp"
        target = _state(2)
        load(target, store, 3)
    _assert_equal_states(_state(1), target)
    target = _state(2)
    load(target, bucket, 3)  # the bucket copy alone
    _assert_equal_states(_state(1), target)


def test_memory_store_refusals(tmp_path):
    store = CheckpointStore("memory://dcp-single/run")
    url = save(_state(1), store, 1)
    assert store.steps() == [1] and url == store.step_url(1)
    with pytest.raises(CommitConflictError):  # a committed step is refused before anything is written
        save(_state(1), store, 1)
    with pytest.raises(UnsafeCheckpointError, match="key 'extra.bad'"):  # refused at save, not at resume
        save({**_state(1), "extra": {"bad": torch.optim.AdamW}}, store, 2)
    assert store.steps() == [1] and store.checkpoints()[-1].step == 1  # no attempt left for step 2
    with pytest.raises(ValueError, match="one writer per step"):
        StoreWriter(store, 4).reset("memory://dcp-single/run/step-000005")
    with pytest.raises(Exception, match="use_collectives=True"):
        dcp.save(_state(1), storage_writer=StoreWriter(store, 6), no_dist=True, use_collectives=False)
    with pytest.raises(Exception, match="is not committed|no manifest"):
        load(_state(2), store, 9)


def test_the_storage_layer_example_of_docs_sharded_md(tmp_path, monkeypatch):
    """docs/sharded.md, "The storage layer": plain dcp.save/dcp.load with StoreWriter/StoreReader."""
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    store = CheckpointStore("runs/sharded")
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.save(state, storage_writer=StoreWriter(store, 10), no_dist=True)
    manifest = store.manifest(10)
    assert manifest.metadata["checkpoint_format"] == "dcp"
    assert {entry.name for entry in manifest.payloads} == {"__0_1.distcp", ".metadata"}
    restored = {"model": torch.nn.Linear(8, 4).state_dict(), "optim": {}}
    dcp.load(restored, storage_reader=StoreReader(store, 10), no_dist=True)
    assert torch.equal(restored["model"]["weight"], model.weight)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    save(_state(1), store, 1)
    with pytest.raises(UnsafeCheckpointError, match=r"naming posix\.system"):
        loads_metadata(pickle.dumps(_Evil()), source="evil")
    with store.begin(2) as txn:  # a hostile .metadata payload, committed like any other
        txn.write_bytes(".metadata", pickle.dumps(_Evil()))
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        StoreReader(store, 2).read_metadata()
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):  # not DCP's AssertionError
        load(_state(2), store, 2)


def test_a_filesystem_writer_checkpoint_is_uncommitted_until_imported(tmp_path, capsys):
    """DCP's own FileSystemWriter writing into a store's step prefix: `ls --all` shows the step as
    uncommitted, no reader takes it, and `opd-store import-dcp` verifies it and commits a copy."""
    store = CheckpointStore(tmp_path / "store")
    save(_state(1), store, 1)
    prefix = tmp_path / "store" / "step-000007"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(7), storage_writer=dcp.FileSystemWriter(str(prefix)), no_dist=True)
    assert store.latest_step() == 1 and store.status(7) == "uncommitted"
    assert cli_main(["ls", str(tmp_path / "store"), "--all"]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows == {"1": "complete", "7": "uncommitted"}

    broken = tmp_path / "broken"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(8), storage_writer=dcp.FileSystemWriter(str(broken)), no_dist=True)
    data_file = broken / "__0_0.distcp"
    data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(IncompleteCheckpointError, match="rank 0's DCP file __0_0.distcp is truncated"):
        adopt_dcp_checkpoint(broken, store, 8)
    assert store.status(8) == "uncommitted"

    assert cli_main(["import-dcp", str(prefix), str(tmp_path / "store"), "--step", "7"]) == 0
    assert "committed" in capsys.readouterr().out
    assert store.status(7) == "complete" and store.latest_step() == 7
    assert store.verify(7, deep=True).ok
    assert sorted(os.listdir(prefix)) == sorted([".metadata", "__0_0.distcp", "manifest.json",
                                                 store.manifest(7).attempt_id])  # the source is untouched
    target = _state(2)
    load(target, store, 7)
    _assert_equal_states(_state(7), target)
    assert cli_main(["import-dcp", str(prefix), str(tmp_path / "store"), "--step", "7"]) == 6  # committed already


def test_a_sharded_opd_save_runs_the_after_commit_stage_every_save_runs(tmp_path):
    """One process, no process group: the sharded save's retention is the pipeline's after-commit
    stage (``dcp.save(after_commit=...)``, run once DCP returned): older steps go once the step is
    committed, and a failing pass is a ``RetentionError`` naming the committed step, which stays."""
    from opd_testkit.opd import PROVENANCE, TinyConfig, make_training, trainer_state

    from opd_store.errors import RetentionError
    from opd_store.opd import save_sharded_opd_checkpoint
    from opd_store.pipeline import AfterCommit
    from opd_store.retention import RetentionPolicy
    from opd_store.testing import Fault, FaultyStorage

    store = CheckpointStore(tmp_path / "store")
    layer, optimizer, scheduler = make_training()

    def save(step: int, target) -> str:
        return save_sharded_opd_checkpoint(
            checkpoints_dir=target, model=layer, optimizer=optimizer, scheduler=scheduler,
            trainer_state=trainer_state(step), config=TinyConfig(), provenance_fingerprints=dict(PROVENANCE),
            teacher_state={"update_count": step}, retention=RetentionPolicy(keep_last=1))

    assert save(1, store) == store.step_url(1)
    assert save(2, store) == store.step_url(2) and store.steps() == [2]
    failing = CheckpointStore.from_storage(FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "delete")))
    with pytest.raises(RetentionError, match="after committing step 3") as caught:
        save(3, failing)
    assert caught.value.url == failing.step_url(3)
    assert store.steps() == [2, 3] and store.verify(3, deep=True).ok
    assert store.manifest(3).metadata["checkpoint_format"] == "dcp"
    with pytest.raises(ValueError, match="after-commit stage of step 4"):
        StoreWriter(store, 5, after_commit=AfterCommit(store, 4))


def test_import_dcp_checks_items_that_span_the_copy_chunks(tmp_path, monkeypatch):
    """``import-dcp`` streams each DCP file through the copy routine's chunk and checks each item
    as its bytes go by: with a chunk far smaller than the items, every item spans several chunks
    (the check holds the item only), the copy is bit exact and loads; an item altered inside the
    file is refused and nothing is committed."""
    import opd_store.store._copy as copy_module

    monkeypatch.setattr(copy_module, "CHUNK_BYTES", 37)  # no item fits in one chunk
    source = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(5), storage_writer=dcp.FileSystemWriter(str(source)), no_dist=True)
    store = CheckpointStore(tmp_path / "store")
    assert adopt_dcp_checkpoint(source, store, 5) == store.step_url(5)
    for name in (".metadata", "__0_0.distcp"):
        assert store.read(5, name) == (source / name).read_bytes()
    target = _state(2)
    load(target, store, 5)
    _assert_equal_states(_state(5), target)

    metadata = loads_metadata((source / ".metadata").read_bytes(), source="test")
    (index, info), *_ = sorted(metadata.storage_data.items(), key=lambda item: -item[1].length)
    data = bytearray((source / info.relative_path).read_bytes())
    data[info.offset:info.offset + info.length] = bytes(info.length)  # the largest item zeroed, same size
    (source / info.relative_path).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"rank 0's DCP file {info.relative_path}: '{index.fqn}' does not load"):
        adopt_dcp_checkpoint(source, store, 6)
    assert store.status(6) == "uncommitted" and store.steps() == [5]
