"""Seed-layout (legacy) checkpoints: loading them in place, and migrating them into any store."""

from __future__ import annotations

import pytest
import torch
from seed_layout import PickledNote, seed_rng_state, write_seed_checkpoint

from opd_store.errors import (
    CommitConflictError,
    IncompleteCheckpointError,
    IntegrityError,
    UnsafeCheckpointError,
)
from opd_store.format import crc32c_hex
from opd_store.opd import (
    OPDConfig,
    latest_complete_checkpoint,
    load_adapter,
    load_opd_checkpoint,
    migrate_legacy,
    save_opd_checkpoint,
)
from opd_store.store import CheckpointStore, LegacyReader


def _peft_state(model):
    from peft.utils import get_peft_model_state_dict

    return {key: value.detach().clone() for key, value in get_peft_model_state_dict(model).items()}


def _seed_checkpoint(directory, opd, successful=2, world_size=1, **overrides):
    """A seed checkpoint with small objects; returns (path, optimizer state, expected draws per rank)."""
    _layer, optimizer, scheduler = opd.make_training()
    states, draws = [], []
    for rank in range(world_size):
        opd.seed_all(500 + rank + successful)
        states.append(seed_rng_state())
        draws.append(opd.next_draws())
    kwargs = dict(
        checkpoints_dir=directory,
        model=opd.StubAdapterModel(),
        processor=None,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=opd.trainer_state(successful),
        config=opd.TinyConfig(),
        provenance_fingerprints=dict(opd.PROVENANCE),
        teacher_state={"update_count": successful, "ema": torch.arange(2.0)},
        world_size=world_size,
        rank_rng_states=states,
    )
    kwargs.update(overrides)
    path = write_seed_checkpoint(**kwargs)
    return path, optimizer.state_dict(), draws


def test_seed_checkpoint_with_peft_adapter_loads_with_the_same_calls(tmp_path, peft_factory, opd):
    model = peft_factory.model()
    tokenizer = peft_factory.tokenizer()
    optimizer, scheduler = peft_factory.train(model, steps=2)
    adapter = _peft_state(model)
    opd.seed_all(77)
    rng = seed_rng_state()
    expected = opd.next_draws()
    path = write_seed_checkpoint(
        checkpoints_dir=tmp_path / "ckpts",
        model=model,
        processor=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=opd.trainer_state(2),
        config=OPDConfig(),
        provenance_fingerprints=dict(opd.PROVENANCE),
        teacher_state={"update_count": 2},
        rank_rng_states=[rng],
    )
    assert LegacyReader(CheckpointStore(str(tmp_path / "ckpts"))).status(2) == "legacy"
    latest = latest_complete_checkpoint(tmp_path / "ckpts")
    assert latest == str(path)

    fresh = peft_factory.model(lora_seed=9)
    fresh_optimizer, fresh_scheduler = peft_factory.fresh_optim(fresh)
    processor = load_adapter(latest, fresh)
    opd.assert_same(_peft_state(fresh), adapter, "adapter")
    assert processor("w3 w4")["input_ids"] == [3, 4]
    teacher: list = []
    opd.seed_all(1)
    state = load_opd_checkpoint(
        latest,
        optimizer=fresh_optimizer,
        scheduler=fresh_scheduler,
        config=OPDConfig(),
        provenance_fingerprints=dict(opd.PROVENANCE),
        teacher_state_loader=teacher.append,
    )
    assert opd.next_draws() == expected  # numpy's tuple state went through the allow-list
    assert state == opd.trainer_state(2)
    assert teacher == [{"update_count": 2}]
    opd.assert_same(fresh_optimizer.state_dict(), optimizer.state_dict(), "optimizer")
    opd.assert_same(fresh_scheduler.state_dict(), scheduler.state_dict(), "scheduler")


def test_seed_layout_rules_in_place(tmp_path, opd):
    root = tmp_path / "ckpts"
    _seed_checkpoint(root, opd, successful=2)
    unmarked, _, _ = _seed_checkpoint(root, opd, successful=9, mark_complete=False)  # partial copy
    (root / ".tmp-step-000011-deadbeef").mkdir()  # a seed save that died while staging
    assert latest_complete_checkpoint(root) == str(root / "step-000002")
    with pytest.raises(IncompleteCheckpointError, match="step-000009"):
        load_opd_checkpoint(str(unmarked), **opd.load_kwargs())
    with pytest.raises(FileExistsError, match="legacy"):
        save_opd_checkpoint(**opd.save_kwargs(str(root), successful=2))
    url = save_opd_checkpoint(**opd.save_kwargs(str(root), successful=4))
    assert latest_complete_checkpoint(root) == url == str(root / "step-000004")


def test_seed_multi_rank_checkpoint_gives_each_rank_its_rng(tmp_path, opd):
    path, saved_optimizer, draws = _seed_checkpoint(tmp_path / "ckpts", opd, world_size=2)
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("rng")) == ["rng-rank-00.pt", "rng-rank-01.pt"]
    for rank in (1, 0):
        opd.seed_all(123)
        kwargs = opd.load_kwargs(world_size=2, rank=rank)
        state = load_opd_checkpoint(str(path), **kwargs)
        assert opd.next_draws() == draws[rank]
        assert state["successful_updates"] == 2
        opd.assert_same(kwargs["optimizer"].state_dict(), saved_optimizer, "optimizer")


def _source_files(path) -> dict[str, tuple[int, str]]:
    return {
        p.relative_to(path).as_posix(): (p.stat().st_size, crc32c_hex(p.read_bytes()))
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "COMPLETE"
    }


def test_migrate_copies_verifies_and_is_idempotent(tmp_path, opd_backend, opd):
    source = tmp_path / "seed"
    one, _, _ = _seed_checkpoint(source, opd, successful=1)
    three, saved_optimizer, draws = _seed_checkpoint(source, opd, successful=3)
    _seed_checkpoint(source, opd, successful=5, mark_complete=False)  # not a checkpoint: ignored
    dst = CheckpointStore(opd_backend.url, storage_options=opd_backend.storage_options)

    result = migrate_legacy(source, dst)
    assert list(result) == [dst.step_url(1), dst.step_url(3)] and result.skipped == []
    assert dst.steps() == [1, 3]
    for step, path in ((1, one), (3, three)):
        manifest = dst.manifest(step)
        assert {e.name: (e.size_bytes, e.crc32c) for e in manifest.payloads} == _source_files(path)
        assert dst.read(step, "training_state.pt") == (path / "training_state.pt").read_bytes()
        assert manifest.metadata["successful_updates"] == step
        assert manifest.metadata["migrated_from"] == str(path)
        assert manifest.metadata["config_fingerprint"] == opd.TinyConfig().fingerprint()
        assert dst.verify(step, deep=True).ok

    opd.seed_all(0)
    kwargs = opd.load_kwargs()
    state = load_opd_checkpoint((dst, 3), **kwargs)
    assert opd.next_draws() == draws[0]
    assert state == opd.trainer_state(3)
    opd.assert_same(kwargs["optimizer"].state_dict(), saved_optimizer, "optimizer")

    again = migrate_legacy(source, dst)
    assert list(again) == [] and again.skipped == [dst.step_url(1), dst.step_url(3)]

    (three / "config.yaml").write_text("changed: true\n", encoding="utf-8")
    with pytest.raises(CommitConflictError, match="config.yaml") as info:
        migrate_legacy(source, dst, steps=[3])
    assert isinstance(info.value, FileExistsError)
    with pytest.raises(FileNotFoundError, match="step"):
        migrate_legacy(source, dst, steps=[5])


def test_migrate_refuses_pickle_only_payloads(tmp_path, opd):
    source = tmp_path / "seed"
    _seed_checkpoint(source, opd, successful=1, trainer_state=opd.trainer_state(1, note=PickledNote("x")))
    dst = CheckpointStore("memory://opd-test/migrated")
    with pytest.raises(UnsafeCheckpointError, match=r"seed_layout\.PickledNote"):
        migrate_legacy(source, dst)
    assert dst.checkpoints() == []


def test_migrate_deletes_a_copy_that_does_not_read_back(tmp_path, opd):
    from opd_store.testing import FaultyStorage

    class CorruptingStorage(FaultyStorage):
        """Stores ``adapter_model.safetensors`` with its first byte flipped (silent corruption)."""

        def open_write(self, rel):
            handle = super().open_write(rel)
            if rel.endswith("adapter_model.safetensors"):
                inner_write = handle.write

                def write(data):
                    data = bytearray(memoryview(data).tobytes())
                    data[0] ^= 0xFF
                    return inner_write(bytes(data))

                handle.write = write
            return handle

    source = tmp_path / "seed"
    _seed_checkpoint(source, opd, successful=1)
    dst = CheckpointStore.from_storage(CorruptingStorage(CheckpointStore(str(tmp_path / "dst")).storage))
    with pytest.raises(IntegrityError, match="adapter_model.safetensors"):
        migrate_legacy(source, dst)
    assert CheckpointStore(str(tmp_path / "dst")).steps() == []


def test_migrate_cli_copies_to_s3_and_is_idempotent(tmp_path, opd, opd_s3_backend, capsys):
    from opd_store.cli import main

    root = tmp_path / "seed"
    _seed_checkpoint(root, opd, successful=2)
    _seed_checkpoint(root, opd, successful=4)
    args = ["migrate", str(root), opd_s3_backend.url, "--s3-endpoint-url", opd_s3_backend.storage_options["endpoint_url"]]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"migrated {opd_s3_backend.url}/step-000002", f"migrated {opd_s3_backend.url}/step-000004"]
    store = CheckpointStore(opd_s3_backend.url, storage_options=opd_s3_backend.storage_options)
    assert [(c.step, c.status) for c in store.checkpoints()] == [(2, "complete"), (4, "complete")]
    for name in store.names(4):
        assert store.read(4, name) == (root / "step-000004" / name).read_bytes()
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"skipped {opd_s3_backend.url}/step-000002 (already committed with identical content)",
        f"skipped {opd_s3_backend.url}/step-000004 (already committed with identical content)",
    ]
