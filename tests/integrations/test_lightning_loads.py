"""What Lightning users load, through StoreCheckpointIO, as without a store: the best model with
``load_from_checkpoint``, a top-k checkpoint resumed on a remote store (not deleted by the run's
top-k evictions), checkpoints outside the plugin's root (another run's store, a plain ``.ckpt``
file), ``"last"`` under DDP (every rank loads the version rank 0 picks), and the strategies whose
checkpoints bypass the ``CheckpointIO``, refused at setup."""

from __future__ import annotations

import types

import lightning_child
import lightning_ddp_child
import pytest
import torch
from store_fixtures import backend_named

from opd_store import CheckpointStore
from opd_store.integrations.lightning import StoreCheckpointIO, StoreModelCheckpoint
from opd_store.job._machines import torch_threads

pytestmark = pytest.mark.timeout(300)


def _boring_run(url, options, max_steps, ckpt_path=None):
    """Lightning's ``test_resume_and_old_checkpoint_files_remain`` run (BoringModel, 10 batches an
    epoch, top-2 by ``step`` every 2 steps) with the plugin: ``(trainer, callback, plugin, model)``."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    pl.seed_everything(0, verbose=False)
    io = StoreCheckpointIO(url, storage_options=options)
    callback = StoreModelCheckpoint(io, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2)
    trainer = pl.Trainer(callbacks=[callback], plugins=[io], max_steps=max_steps, limit_train_batches=10,
                         limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, logger=False,
                         accelerator="cpu", devices=1)
    model = BoringModel()
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, callback, io, model


@pytest.mark.parametrize("where,same_resume_folder", [("local", True), ("memory", True), ("memory", False)])
def test_resume_and_old_checkpoints_remain_and_the_best_model_loads(where, same_resume_folder, request):
    """Lightning's ``test_resume_and_old_checkpoint_files_remain`` (same assertions, names in a
    store instead of files in a directory, listed as a directory is: an evicted name used to leave
    its empty local directory). Lightning deems every non-local path removable, so on ``memory://``
    (as on ``s3://``: the rule looks at the protocol only) the resumed checkpoint was deleted at the
    first eviction. The best model then
    loads with ``load_from_checkpoint(io.open(best_model_path))``."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    backend = backend_named(request, where)
    first, second = f"{backend.url}/first", f"{backend.url}/second"
    new_root = first if same_resume_folder else second
    trainer, callback, io, model = _boring_run(first, backend.storage_options, max_steps=5)
    assert io.listed_names() == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]

    # the best model, as Lightning users load it (a name in the store is not a file to open)
    assert callback.best_model_path == io.path_of("epoch=0-step=4.ckpt")
    best = BoringModel.load_from_checkpoint(io.open(callback.best_model_path))
    saved = io.load_checkpoint(callback.best_model_path)["state_dict"]
    assert saved.keys() == best.state_dict().keys()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in best.state_dict().items())

    resumed_from = io.path_of("epoch=0-step=4.ckpt")
    trainer, callback, io2, model = _boring_run(new_root, backend.storage_options, max_steps=8, ckpt_path=resumed_from)
    assert trainer.global_step == 8
    if same_resume_folder:
        # the checkpoint the run resumed from is kept, as Lightning keeps a local one
        assert io2.listed_names() == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    else:
        # resumed from outside the plugin's root (another run's store): nothing of it deleted
        assert io.listed_names() == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
        assert io2.listed_names() == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]


def test_a_plain_ckpt_file_outside_the_root_loads_as_lightning_loads_it(tmp_path):
    """Fine-tuning from a plain local ``.ckpt`` file (Lightning's own format, no manifest): loaded
    unchecked, as Lightning's default ``CheckpointIO`` loads it; the run then saves into the store."""
    url = f"memory://lightning-plain-{tmp_path.name}/ckpts"
    first, model, train, val, plugin, _c = lightning_child.build(url, {}, max_epochs=1)
    first.fit(model, train, val)
    plain = tmp_path / "pretrained.ckpt"
    torch.save(plugin.load_checkpoint(plugin.path_of("last.ckpt")), plain)
    other = f"memory://lightning-plain-{tmp_path.name}/other"
    second, model, train, val, plugin, _c = lightning_child.build(other, {}, max_epochs=2)
    restored = []
    second.callbacks.append(lightning_child.loaded_states(restored))
    second.fit(model, train, val, ckpt_path=str(plain))
    (step, weights), = restored
    saved = torch.load(plain, weights_only=False)["state_dict"]
    assert step == 4 and all(torch.equal(weights[name], tensor) for name, tensor in saved.items())
    assert second.global_step == 8 and plugin.load_checkpoint(plugin.path_of("last.ckpt"))["global_step"] == 8
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nothing.ckpt: no committed version and no file"):
        plugin.load_checkpoint(str(tmp_path / "nothing.ckpt"))


def test_ddp_ranks_load_the_version_rank_0_picks_though_a_commit_lands_between_their_lookups(tmp_path):
    """Two gloo ranks resume ``"last"``; a newer version of ``last.ckpt`` is committed after rank
    0's lookup and before rank 1's. Each rank used to fetch what its own lookup found (rank 0 the
    first version, rank 1 the late one); the version is now picked at the load, by rank 0, for every
    rank (the late one: rank 0 lists the store again then)."""
    url = str(tmp_path / "ckpts")
    with torch_threads(1):
        trainer, model, train, val, _p, _c = lightning_child.build(url, {}, max_epochs=1)
        trainer.fit(model, train, val)
    assert CheckpointStore(f"{url}/last.ckpt").steps() == [1]
    results = []
    for stream in lightning_ddp_child.start_pair(tmp_path, url):
        (result,) = stream.until(lambda event: event["event"] == "result")
        assert stream.process.wait(60) == 0
        results.append(result)
    late = lightning_ddp_child.LATE_GLOBAL_STEP
    assert [(r["rank"], r["world_size"], r["global_step"]) for r in results] == [(0, 2, late), (1, 2, late)]
    assert results[0]["digest"] == results[1]["digest"]


@pytest.mark.parametrize("strategy", ["FSDPStrategy", "ModelParallelStrategy"])
def test_strategies_whose_checkpoints_bypass_the_checkpoint_io_are_refused_at_setup(strategy, tmp_path):
    """FSDP (sharded state dicts written to a local directory, full ones loaded from a local path)
    and ModelParallel bypass the plugin: refused before anything trains. Both need a GPU to run in
    Lightning, so the callback's setup is given their real strategy objects; DDP is accepted."""
    from lightning.pytorch import strategies

    io = StoreCheckpointIO(tmp_path / "ckpts")
    callback = StoreModelCheckpoint(io, save_last=True)
    with pytest.raises(ValueError, match=rf"^{strategy} is not supported by StoreModelCheckpoint: .* local "
                                         rf"(directory|path).*would not \(all\) reach {tmp_path}/ckpts; use DDP"):
        callback.setup(types.SimpleNamespace(strategy=getattr(strategies, strategy)()), None, "fit")
    ddp = types.SimpleNamespace(strategy=strategies.DDPStrategy(), is_global_zero=True)
    callback.setup(ddp, None, "fit")
    assert callback.dirpath == io.url
