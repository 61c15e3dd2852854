"""DCP entry points: ``opd_store.dcp.async_save`` hands the upload to the background, and
``opd-store import-dcp`` records the world size of every rank that wrote a file."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from opd_store import CheckpointStore, dcp
from opd_store.cli import main as cli_main
from opd_store.testing import FaultyStorage

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(6, 4).state_dict(), "extra": {"counter": seed}}


class _HeldWrites(FaultyStorage):
    """Every payload write waits for ``gate`` (an upload that has not started moving bytes)."""

    def __init__(self, inner, gate: threading.Event) -> None:
        super().__init__(inner)
        self.gate = gate

    def recorded_mutation(self, kind, rel, action, **kwargs):
        if kind == "write" and not self.gate.wait(60):
            raise TimeoutError("the test never released the upload")
        return super().recorded_mutation(kind, rel, action, **kwargs)


def test_async_save_returns_before_the_upload_finishes(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    gate = threading.Event()
    held = _HeldWrites(store.storage, gate)
    returned: list = []
    caller = threading.Thread(target=lambda: returned.append(
        dcp.async_save(_state(1), CheckpointStore.from_storage(held), 3)))
    caller.start()
    caller.join(timeout=30)
    try:
        assert not caller.is_alive() and returned, "async_save waited for the upload"
        pending = returned[0]
        assert pending.staged.done() and not pending.committed.done()
        assert held.mutating_ops == [] and store.steps() == []  # not one byte written, nothing committed
    finally:
        gate.set()
    assert pending.result(timeout=60) == store.step_url(3)
    assert store.steps() == [3] and store.verify(3, deep=True).ok
    assert [op.kind for op in held.mutating_ops][-1] == "create"
    target = _state(2)
    dcp.load(target, store, 3)
    assert torch.equal(target["model"]["weight"], _state(1)["model"]["weight"]) and target["extra"] == {"counter": 1}


def test_import_dcp_of_two_ranks_whose_second_file_is_empty_records_world_size_2(tmp_path, capsys):
    """A rank whose state DCP deduplicated onto rank 0 writes an empty ``__1_0.distcp``; the
    metadata places no item there. The adopted step records both ranks."""
    source = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.save(_state(7), storage_writer=torch_dcp.FileSystemWriter(str(source)), no_dist=True)
    (source / "__1_0.distcp").write_bytes(b"")
    store = CheckpointStore(tmp_path / "store")
    assert cli_main(["import-dcp", str(source), store.url, "--step", "7"]) == 0
    manifest = store.manifest(7)
    assert (manifest.world_size, manifest.metadata["dcp_world_size"]) == (2, 2)
    assert {entry.name: entry.size_bytes for entry in manifest.payloads}["__1_0.distcp"] == 0
    assert store.verify(7, deep=True).ok
    target = _state(2)
    dcp.load(target, store, 7)
    assert torch.equal(target["model"]["weight"], _state(7)["model"]["weight"])
