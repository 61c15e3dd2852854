"""One rank of a 2-process gloo DDP Lightning run resuming ``fit(ckpt_path="last")`` from a store, as
a program of its own (``python tests/integrations/lightning_ddp_child.py SPEC_JSON``, forked from
the worker's fork server by :func:`start_pair`).

Lightning asks each rank for ``"last"`` on its own, before any process group exists (its launcher
creates the group later, in ``setup_environment``). Here the ranks join their group through a
rendezvous file first (Lightning then uses it), and a commit lands *between* the two ranks' lookups
(two barriers order it): rank 0 looks ``"last"`` up; then rank 1 commits a newer version of
``last.ckpt`` (another writer's late commit: the first version with ``global_step``
:data:`LATE_GLOBAL_STEP` and every weight plus 1), and only then looks up. Each rank reports the
``global_step`` and a digest of the weights of the checkpoint it restored (``on_load_checkpoint``):
``{"event": "result", ...}`` (:mod:`opd_testkit.events`).
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import subprocess
import sys
import traceback
import uuid
from pathlib import Path

from opd_testkit import events, forkserver

LATE_GLOBAL_STEP = 40


def main(spec: dict) -> None:
    rank = spec["rank"]
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1", OMP_NUM_THREADS="1")
    try:
        import gc

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        result = _resume(spec)
        gc.collect()  # the Trainer and its DDP wrapper before the group goes (rank_child.py says why)
        events.emit(result)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        events.emit({"event": "error", "traceback": traceback.format_exc()})
        raise


def _resume(spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    import lightning_child
    from opd_store import CheckpointStore
    from opd_store.integrations.lightning import StoreModelCheckpoint

    rank, url = spec["rank"], spec["url"]
    loaded = {}

    class Loaded(lightning_child.pl_callback()):
        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            digest = hashlib.sha256()
            for name, tensor in sorted(checkpoint["state_dict"].items()):
                digest.update(name.encode() + tensor.numpy().tobytes())
            loaded.update(global_step=checkpoint["global_step"], digest=digest.hexdigest())

    class LookUpThenWait(StoreModelCheckpoint):
        def _find_last_checkpoints(self, trainer):
            found = super()._find_last_checkpoints(trainer)
            if rank == 0:
                dist.barrier()  # rank 0 has looked up
                dist.barrier()  # rank 1 has committed a newer version of last.ckpt
            return found

    if rank == 1:
        dist.barrier()
        last = CheckpointStore(f"{url}/last.ckpt")
        (version,) = last.steps()
        checkpoint = torch.load(io.BytesIO(last.read(version, "checkpoint.ckpt")), weights_only=False)
        checkpoint.update(global_step=LATE_GLOBAL_STEP,
                          state_dict={name: tensor + 1 for name, tensor in checkpoint["state_dict"].items()})
        with last.begin(version + 1, metadata={"framework": "lightning", "name": "last.ckpt",
                                               "global_step": LATE_GLOBAL_STEP}) as txn:
            with txn.open("checkpoint.ckpt") as writer:
                torch.save(checkpoint, writer)
        dist.barrier()
    trainer, model, train, val, _plugin, _c = lightning_child.build(
        url, {}, max_epochs=1, checkpoint_class=LookUpThenWait, callbacks=[Loaded()], devices=2, strategy="ddp")
    trainer.fit(model, train, val, ckpt_path="last")
    return {"event": "result", "rank": rank, "world_size": trainer.world_size, **loaded}


def start_pair(base: Path, url: str) -> list[events.EventStream]:
    """Start both ranks; return their event streams (rank order)."""
    init_method = f"file://{base / f'rendezvous-{uuid.uuid4().hex}'}"
    streams = []
    for rank in (0, 1):
        spec = dict(rank=rank, init_method=init_method, url=url)
        process = forkserver.popen([sys.executable, __file__, json.dumps(spec)], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        streams.append(events.EventStream(process))
    return streams


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
