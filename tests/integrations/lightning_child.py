"""A tiny LightningModule trained with StoreCheckpointIO, in this process or as a program of its own.

The module has dropout (so it draws random numbers every step) and saves/restores the global RNG
state in its checkpoint hooks: Lightning itself does not put RNG states in a checkpoint, so without
them a resumed run draws other dropout masks (docs/integrations.md). The data order is fixed
(``shuffle=False``) and checkpoints are taken at epoch ends: Lightning restarts an epoch that was
interrupted from its beginning rather than from the batch it reached.

As a program (``python tests/integrations/lightning_child.py SPEC_JSON``, started by :func:`start`
on a fresh machine from the worker's fork server): events (:mod:`opd_testkit.events`)
``{"event": "epoch_end", "epoch": N}`` at each epoch end (before that epoch's checkpoint:
ModelCheckpoint runs after other callbacks), then the child waits for the parent's reply;
``{"event": "checkpoint", "step": N}`` for each checkpoint Lightning saves (its run journal has a
``progress`` event after every batch, so ``opd-store report`` knows where a start was killed); at the end
``{"event": "done", "resumed_from": ...}`` after ``torch.save`` of the weights to the spec's
``result`` path, or ``{"event": "error", "traceback": ...}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from opd_testkit import events, forkserver

from opd_store.job._machines import fresh_machine


def build(url: str, storage_options: dict, *, async_io: bool = False, max_epochs: int = 4, callbacks=(),
          save_top_k: int = 2, rng_hooks: bool = True, lr: float = 1e-2, local_cache_dir=None, plugin=None,
          checkpoint_class=None, checkpoint_kwargs=None, **trainer_kwargs):
    """The tiny run: ``(trainer, model, train loader, val loader, plugin, checkpoint callback)``.
    ``plugin``: an existing StoreCheckpointIO (else a new one); ``checkpoint_class``: a subclass of
    StoreModelCheckpoint; ``checkpoint_kwargs``: more of its arguments (``journal_progress_secs``,
    ``save_on_exception``); ``trainer_kwargs``: more ``Trainer`` arguments (``devices``, ``strategy``)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from opd_store.integrations.lightning import StoreCheckpointIO, StoreModelCheckpoint

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

        def on_save_checkpoint(self, checkpoint):
            if rng_hooks:
                checkpoint["rng_cpu"] = torch.random.get_rng_state()

        def on_load_checkpoint(self, checkpoint):
            if rng_hooks:
                torch.random.set_rng_state(checkpoint["rng_cpu"])

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    data = torch.utils.data.TensorDataset(x, y)
    train = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)
    val = torch.utils.data.DataLoader(data, batch_size=32)
    pl.seed_everything(0, verbose=False)
    model = Tiny()
    if plugin is None:
        plugin = StoreCheckpointIO(url, storage_options=storage_options, local_cache_dir=local_cache_dir)
    checkpoint = (checkpoint_class or StoreModelCheckpoint)(plugin, monitor="val_loss", save_top_k=save_top_k, save_last=True,
                                      filename="{epoch}-{step}", **(checkpoint_kwargs or {}))
    trainer_kwargs = {"accelerator": "cpu", "devices": 1, **trainer_kwargs}
    trainer = pl.Trainer(max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[AsyncCheckpointIO(plugin) if async_io else plugin], callbacks=[checkpoint, *callbacks],
                         default_root_dir=tempfile.mkdtemp(), **trainer_kwargs)
    return trainer, model, train, val, plugin, checkpoint


def snapshot(backend, sub: str = "ckpts") -> dict[str, bytes]:
    """Every object under ``sub`` of ``backend`` (a plugin root), read with the backend's own client."""
    fs, raw = backend.raw_fs(), f"{backend.raw_root()}/{sub}"
    return {path[len(raw) + 1:]: fs.cat_file(path) for path in fs.find(raw)}


def upload(objects: dict[str, bytes], backend, sub: str = "ckpts") -> str:
    """Write a :func:`snapshot` into ``backend`` under ``sub`` with the backend's own client; return
    the root's URL."""
    fs, raw = backend.raw_fs(), backend.raw_root()
    for rel, data in sorted(objects.items()):
        fs.pipe_file(f"{raw}/{sub}/{rel}", data)
    return f"{backend.url}/{sub}"


def loaded_states(records: list):
    """A callback appending ``(global_step, state_dict)`` of every checkpoint Lightning restores
    from to ``records`` (its ``on_load_checkpoint``, on every rank)."""
    class Loaded(pl_callback()):
        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            records.append((checkpoint["global_step"], dict(checkpoint["state_dict"])))

    return Loaded()


def pl_callback():
    """``lightning.pytorch.Callback`` (imported when needed)."""
    import lightning.pytorch as pl

    return pl.Callback


def weights(model) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def main(spec: dict) -> None:
    try:
        import lightning.pytorch as pl
        import torch

        torch.set_num_threads(1)  # as the tests' own process (conftest.py): the same bits

        class Report(pl.Callback):
            def on_train_epoch_end(self, trainer, pl_module):
                events.emit({"event": "epoch_end", "epoch": trainer.current_epoch, "step": trainer.global_step})
                events.wait_reply()

            def on_save_checkpoint(self, trainer, pl_module, checkpoint):
                events.emit({"event": "checkpoint", "step": trainer.global_step})

        trainer, model, train, val, _plugin, _ckpt = build(spec["url"], spec["storage_options"], callbacks=[Report()],
                                                           checkpoint_kwargs={"journal_progress_secs": 0})
        trainer.fit(model, train, val, ckpt_path="last")  # also on the first start (empty store)
        torch.save(weights(model), spec["result"])
        events.emit({"event": "done", "resumed_from": str(trainer.ckpt_path)})
    except BaseException:  # noqa: BLE001 - reported to the parent
        events.emit({"event": "error", "traceback": traceback.format_exc()})
        raise


def start(base: Path, url: str, storage_options: dict):
    """Start one training start on a fresh machine under ``base``; return ``(EventStream, machine
    directory)`` (the weights of a start that ended are its ``result.pt``)."""
    env, work = fresh_machine(base)
    spec = dict(url=url, storage_options=storage_options, result=str(work.parent / "result.pt"))
    process = forkserver.popen([sys.executable, __file__, json.dumps(spec)], env=env, cwd=work, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return events.EventStream(process), work.parent


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
