"""One rank of a multi-rank checkpoint test: a real process in a gloo process group.

Run as ``python tests/distributed/rank_worker.py SPEC_JSON``; the spec names the rank, the world
size, the TCP rendezvous on 127.0.0.1, the store (URL and storage options) and the scenario. The
rank writes ``<out>/rank-<r>.json`` with what it saw (returned URLs, errors, RNG draws).

Scenarios (``steps`` lists the steps saved in order):

* ``save_load``: save each step, draw from every RNG, then resume from the latest and draw again.
* ``save_fail``: save ``steps[:-1]``, then the last step with ``fail_rank``'s write raising after
  it wrote some bytes of one payload.
* ``save_block``: as ``save_fail`` but ``fail_rank`` writes ``<out>/blocked`` and blocks forever in
  the middle of its payload (the test SIGKILLs it).
* ``resume``: resume from the latest complete checkpoint and draw.
* ``load``: load the checkpoint ``load_url`` and report the outcome.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import random
import sys
import threading
import traceback

import numpy as np
import torch
import torch.distributed as dist


def draws() -> list[float]:
    """One draw from each global RNG the checkpoint restores (Python, numpy, torch CPU)."""
    return [random.random(), float(np.random.rand()), *torch.rand(2, dtype=torch.float64).tolist()]


def _error(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "failures": {str(k): v for k, v in getattr(exc, "failures", {}).items()},
        "bases": [cls.__name__ for cls in type(exc).__mro__],
    }


class Config:
    """The seed's config contract: ``fingerprint()`` and ``as_dict()`` (as in tests/opd)."""

    checkpoint = None

    def as_dict(self) -> dict:
        return {"lr": 0.001, "rollout_limit": 8}

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()


class Adapter(torch.nn.Module):
    """A real module whose ``save_pretrained`` writes safetensors, as a PEFT adapter does.

    (The PEFT student of ``opd-store train`` is exercised by tests/distributed/test_train_nproc.py;
    transformers costs each rank process a minute of imports on a loaded 2-core host.)
    """

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.lora = torch.nn.Linear(8, 4)
        with torch.no_grad():
            for param in self.lora.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.lora(inputs)

    def save_pretrained(self, directory: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()},
                  os.path.join(directory, "adapter_model.safetensors"))
        with open(os.path.join(directory, "adapter_config.json"), "w") as handle:
            handle.write('{"r": 4}')


class Job:
    """A model, AdamW after one real step and a LambdaLR: the state one rank checkpoints."""

    def __init__(self) -> None:
        self.student = Adapter()
        self.config = Config()
        self.provenance = {"corpus": "c0ffee"}
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda update: 1.0 / (update + 1))
        self.student(torch.ones(2, 8)).pow(2).sum().backward()
        self.optimizer.step()
        self.scheduler.step()

    def save(self, store, step: int, rank_arg: int | None = None) -> str:
        from opd_store.opd import save_opd_checkpoint

        trainer = {"attempted_updates": step, "successful_updates": step, "query_update": step}
        return save_opd_checkpoint(
            checkpoints_dir=store, model=self.student, processor=None, optimizer=self.optimizer,
            scheduler=self.scheduler, trainer_state=trainer, config=self.config,
            provenance_fingerprints=self.provenance, teacher_state={"update_count": step}, rank=rank_arg,
        )

    def load(self, url: str, store) -> dict:
        from opd_store.opd import load_opd_checkpoint

        return load_opd_checkpoint(
            url, optimizer=self.optimizer, scheduler=self.scheduler, config=self.config,
            provenance_fingerprints=self.provenance, teacher_state_loader=lambda state: None,
            storage_options=store.storage_options,
        )


def _inject(spec: dict, rank: int) -> None:
    """Make ``fail_rank``'s write of one payload fail (or block) after some bytes went out."""
    if spec.get("fail_rank") != rank:
        return
    from opd_store.opd import _save as checkpoint  # where the payload writes live

    victim = "training_state.pt" if rank == 0 else f"rng-rank-{rank:02d}.pt"
    original = checkpoint._save_torch
    armed = {"on": False}

    def faulty(txn, name, obj):
        if not armed["on"] or name != victim:
            return original(txn, name, obj)
        with txn.open(name) as writer:
            writer.write(b"partial payload bytes")
            if spec["scenario"] == "save_block":
                with open(os.path.join(spec["out"], "blocked"), "w") as marker:
                    marker.write(str(os.getpid()))
                threading.Event().wait()  # killed here by the test
            raise OSError(f"injected write failure on rank {rank} ({name})")

    checkpoint._save_torch = faulty
    spec["_arm"] = armed


def main() -> int:
    spec = json.loads(sys.argv[1])
    rank, world_size = spec["rank"], spec["world_size"]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=spec["init_method"], rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=spec.get("timeout_secs", 600)),
    )
    from opd_store.opd import latest_complete_checkpoint
    from opd_store.store import CheckpointStore

    store = CheckpointStore(spec["url"], storage_options=spec["storage_options"])
    job = Job()
    random.seed(1000 + rank)
    np.random.seed(2000 + rank)
    torch.manual_seed(3000 + rank)
    result: dict = {"rank": rank, "saves": [], "pid": os.getpid()}
    scenario = spec["scenario"]
    _inject(spec, rank)
    try:
        if scenario in ("save_load", "save_fail", "save_block"):
            steps = spec["steps"]
            for index, step in enumerate(steps):
                if index == len(steps) - 1 and "_arm" in spec:
                    spec["_arm"]["on"] = True
                try:
                    url = job.save(store, step, spec.get("rank_args", {}).get(str(rank)))
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    result["saves"].append({"step": step, "error": _error(exc)})
                    break
                result["saves"].append({"step": step, "url": url, "draws": draws()})
        if scenario in ("save_load", "resume"):
            latest = latest_complete_checkpoint(store)
            trainer = job.load(latest, store)
            result.update(latest=latest, resumed_step=trainer["successful_updates"], draws_after_load=draws())
        if scenario == "load":
            try:
                job.load(spec["load_url"], store)
                result["load"] = {"draws": draws()}
            except Exception as exc:  # noqa: BLE001 - reported to the test
                result["load"] = {"error": _error(exc)}
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["fatal"] = _error(exc)
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as handle:
        json.dump(result, handle)
    if "fatal" not in result:
        dist.destroy_process_group()
    return 0 if "fatal" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
