"""A complete checkpoint copied in by another tool, without our manifest, is
never deleted by garbage collection; an explicit import (``opd-store migrate``) writes a manifest.

The foreign checkpoint is a real seed-layout OPD checkpoint (tests/opd/seed_layout.py) uploaded
into an S3 store (moto server) with a plain recursive ``put``, as ``aws s3 sync`` would.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from cli_helpers import cli_store_args
from opd_testkit import opd as helpers

from opd_store import CheckpointStore
from opd_store.cli import main
from opd_store.opd import load_opd_checkpoint

TESTS = Path(__file__).parents[1]


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


seed_layout = _module("seed_layout", TESTS / "opd" / "seed_layout.py")


def write_seed(directory: Path, step: int, *, mark_complete: bool = True) -> Path:
    _layer, optimizer, scheduler = helpers.make_training()
    return seed_layout.write_seed_checkpoint(
        checkpoints_dir=directory,
        model=helpers.StubAdapterModel(),
        processor=None,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=helpers.trainer_state(step),
        config=helpers.TinyConfig(),
        provenance_fingerprints=dict(helpers.PROVENANCE),
        teacher_state={"update_count": step},
        mark_complete=mark_complete,
    )


def tree(fs, root: str, under: str) -> dict[str, bytes]:
    return {path[len(root) + 1:]: fs.cat_file(path) for path in fs.find(f"{root}/{under}")}


def test_gc_never_deletes_a_foreign_checkpoint_and_migrate_imports_it(s3_backend, tmp_path, capsys):
    args = cli_store_args(s3_backend)
    store = CheckpointStore(s3_backend.url, storage_options=s3_backend.storage_options)
    for step in (100, 200):
        with store.begin(step, metadata={"successful_updates": step}) as txn:
            txn.write_bytes("model.bin", bytes([step % 251]) * 32)
    # Another tool copies a complete seed checkpoint (step 150) and a partial one (step 250, no
    # COMPLETE marker) into the store, without our manifest.
    seed_dir = tmp_path / "seed"
    write_seed(seed_dir, 150)
    write_seed(seed_dir, 250, mark_complete=False)
    fs, root = s3_backend.raw_fs(), s3_backend.raw_root()
    fs.put(str(seed_dir / "step-000150"), f"{root}/step-000150", recursive=True)
    fs.put(str(seed_dir / "step-000250"), f"{root}/step-000250", recursive=True)
    foreign = {**tree(fs, root, "step-000150"), **tree(fs, root, "step-000250")}
    assert "step-000150/COMPLETE" in foreign and "step-000150/training_state.pt" in foreign

    assert main(["gc", s3_backend.url, "--keep-last", "1", "--orphans-older-than", "0", "--yes", *args]) == 0
    out = capsys.readouterr().out
    assert "deleted step 100" in out and "leave step 150 (legacy" in out and "leave step 250 (uncommitted" in out
    fs = s3_backend.raw_fs()
    assert {**tree(fs, root, "step-000150"), **tree(fs, root, "step-000250")} == foreign
    assert store.steps() == [200]

    assert main(["ls", s3_backend.url, "--json", *args]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [(row["step"], row["status"]) for row in rows] == [(150, "legacy"), (200, "complete")]

    # The explicit import: migrate reads the bucket and commits step 150 with a manifest.
    imported = "s3://opd-test/imported"
    assert main(["migrate", s3_backend.url, imported, *args]) == 0
    assert capsys.readouterr().out == "migrated s3://opd-test/imported/step-000150\n"
    destination = CheckpointStore(imported, storage_options=s3_backend.storage_options)
    assert destination.steps() == [150] and destination.verify(150, deep=True).ok
    names = {entry.name for entry in destination.manifest(150).payloads}
    assert names == {name[len("step-000150/"):] for name in foreign if name.startswith("step-000150/")} - {"COMPLETE"}
    state = load_opd_checkpoint(
        (destination, 150), **helpers.load_kwargs(storage_options=s3_backend.storage_options)
    )
    assert state["successful_updates"] == 150
    # The imported copy is ours: retention may manage it; the foreign original is still untouched.
    assert tree(s3_backend.raw_fs(), root, "step-000150") == {k: v for k, v in foreign.items() if k.startswith("step-000150/")}


def test_migrate_on_a_terminal_advances_a_progress_bar_per_step(tmp_path, capsys, monkeypatch):
    from fsspec.callbacks import Callback

    import opd_store.cli._migrate_cmd as migrate_cmd

    class Recorder(Callback):
        def __init__(self):
            super().__init__()
            self.sizes, self.updates, self.closed = [], [], False

        def set_size(self, size):
            self.sizes.append(size)

        def relative_update(self, inc=1):
            self.updates.append(inc)

        def close(self):
            self.closed = True

    recorder = Recorder()
    monkeypatch.setattr(migrate_cmd, "progress_callback", lambda desc, unit="B": recorder)
    seed_dir = tmp_path / "seed"
    for step in (2, 4):
        write_seed(seed_dir, step)
    write_seed(seed_dir, 6, mark_complete=False)
    destination = tmp_path / "dst"
    assert main(["migrate", str(seed_dir), str(destination)]) == 0
    assert capsys.readouterr().out == f"migrated {destination / 'step-000002'}\nmigrated {destination / 'step-000004'}\n"
    assert (recorder.sizes, recorder.updates, recorder.closed) == ([2], [1, 1], True)
    assert CheckpointStore(destination).steps() == [2, 4]
