"""A tiny LightningModule trained with StoreCheckpointIO, in this process or in a forked child.

The module has dropout (so it draws random numbers every step) and saves/restores the global RNG
state in its checkpoint hooks: Lightning itself does not put RNG states in a checkpoint, so without
them a resumed run draws other dropout masks (docs/integrations.md). The data order is fixed
(``shuffle=False``) and checkpoints are taken at epoch ends: Lightning restarts an epoch that was
interrupted from its beginning rather than from the batch it reached.

Child protocol (a ``Pipe``): ``{"event": "epoch_end", "epoch": N}`` at each epoch end (before that epoch's
checkpoint: ModelCheckpoint runs after other callbacks), then
the child waits for ``"go"``; at the end ``{"event": "done", "state": bytes}`` (``torch.save`` of the
weights) or ``{"event": "error", "traceback": ...}``.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import proc_writer  # noqa: E402



def build(url: str, storage_options: dict, *, async_io: bool = False, max_epochs: int = 4, callbacks=(),
          save_top_k: int = 2, rng_hooks: bool = True, lr: float = 1e-2, local_cache_dir=None):
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
    plugin = StoreCheckpointIO(url, storage_options=storage_options, local_cache_dir=local_cache_dir)
    checkpoint = StoreModelCheckpoint(plugin, monitor="val_loss", save_top_k=save_top_k, save_last=True,
                                      filename="{epoch}-{step}")
    trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[AsyncCheckpointIO(plugin) if async_io else plugin],
                         callbacks=[checkpoint, *callbacks], default_root_dir=tempfile.mkdtemp())
    return trainer, model, train, val, plugin, checkpoint


def pl_callback():
    """``lightning.pytorch.Callback`` (imported when needed)."""
    import lightning.pytorch as pl

    return pl.Callback


def weights(model) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _child(conn, machine: str, url: str, storage_options: dict, resume: bool) -> None:
    try:
        root = Path(machine)
        for sub in ("home", "tmp", "work"):
            (root / sub).mkdir(parents=True)
        os.chdir(root / "work")
        os.environ["HOME"], os.environ["TMPDIR"] = str(root / "home"), str(root / "tmp")
        tempfile.tempdir = None
        import lightning.pytorch as pl
        import torch

        class Report(pl.Callback):
            def on_train_epoch_end(self, trainer, pl_module):
                conn.send({"event": "epoch_end", "epoch": trainer.current_epoch, "step": trainer.global_step})
                conn.recv()

        trainer, model, train, val, _plugin, _ckpt = build(url, storage_options, callbacks=[Report()])
        trainer.fit(model, train, val, ckpt_path="last")  # also on the first start (empty store)
        buffer = io.BytesIO()
        torch.save(weights(model), buffer)
        conn.send({"event": "done", "state": buffer.getvalue(), "resumed_from": str(trainer.ckpt_path)})
    except BaseException:  # noqa: BLE001
        conn.send({"event": "error", "traceback": traceback.format_exc()})
    finally:
        conn.close()


def start(machine: str, url: str, storage_options: dict, *, resume: bool):
    ctx = proc_writer.context()
    parent, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_child, args=(child, machine, url, storage_options, resume), daemon=True)
    process.start()
    child.close()
    return process, parent
