"""One rank of a 2-process gloo run of a plain transformers Trainer with StoreCallback, as a program
of its own (``python tests/integrations/rank_child.py SPEC_JSON``, forked from the worker's fork
server by :func:`start_pair`). The ranks join their process group through a rendezvous file (no
port is picked beforehand: parallel workers cannot collide on one) before the Trainer is built,
which then uses that group. Each rank has its own output directory (as on separate machines), so
rank 0 cannot see rank 1's files: rank 1's ``rng_state_1.pth`` can reach the store only as rank 1's
part.

With ``probe`` each rank also fails alone once, in the processes already running (no extra start):
after training, a commit of step 3 whose directory lacks rank 1's RNG file; before resuming, a fetch
into a directory rank 1 cannot create. Every rank must raise the same typed error naming rank 1
(a rank failing alone must not leave the other waiting in a collective); the errors are reported
as ``[type name, failing ranks, message]``. Before resuming, the two ranks also play two hosts
(host names ``host-0`` and ``host-1``) sharing one output directory over a network filesystem:
both fetch into it, and each reports how many fetches it made (the directory must be fetched
once). The result is the event ``{"event": "result", ...}`` (:mod:`opd_testkit.events`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import traceback
import uuid
from pathlib import Path

from opd_testkit import events, forkserver


def _error(call) -> list | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return [type(exc).__name__, sorted(getattr(exc, "failures", {})), str(exc)]
    return None


def main(spec: dict) -> None:
    """Join the process group, run :func:`_train`, emit its result, leave the group.

    The Trainer is released and collected before ``destroy_process_group``: its DDP wrapper's
    ``Reducer`` holds a reference to the process group, and a ``Reducer`` freed after the group was
    destroyed runs ``~ProcessGroupGloo`` with the GIL held (pybind11 frees it without releasing the
    GIL), which joins gloo's worker threads while one of them waits for the GIL to free the last
    collective's tensors: a deadlock at the end of the program (torch issue 56297: pybind11-bound
    destructors that block). Destroyed through ``destroy_process_group``, the group's last reference
    goes through torch's own binding, which releases the GIL first.
    """
    os.environ.update(RANK=str(spec["rank"]), LOCAL_RANK=str(spec["rank"]), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      OMP_NUM_THREADS="1")
    try:
        import gc

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=spec["init_method"], rank=spec["rank"], world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        result = _train(spec)
        gc.collect()  # the Trainer's reference cycles, with its DDP wrapper, before the group goes
        events.emit(result)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        events.emit({"event": "error", "traceback": traceback.format_exc()})
        raise


def _train(spec: dict) -> dict:
    """The run of this rank (see the module docstring); returns the ``result`` event."""
    import shutil
    import types
    from unittest import mock

    from opd_testkit.hf import tiny_trainer
    from transformers import TrainerCallback

    from opd_store.integrations.transformers import StoreCallback, store_checkpoint

    rank, out, store_url, stop_at = spec["rank"], spec["out"], spec["store_url"], spec["stop_at"]
    resume, probe = spec["resume"], spec["probe"]

    class StopAt(TrainerCallback):  # a run of 4 steps whose process ends after step ``stop_at``
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    callback = StoreCallback(store_url, async_upload=spec["async_upload"])
    trainer = tiny_trainer(out, callbacks=[callback, StopAt()], ddp_backend="gloo", ddp_timeout=60)
    args = trainer.args
    result = {"event": "result", "rank": rank, "world_size": args.world_size}
    if probe and resume:
        blocker = Path(out).parent / f"not-a-directory-{rank}"
        blocker.write_text("x")
        local = blocker / "sub" if rank == 1 else Path(out).parent / f"probe-{rank}"
        result["fetch_error"] = _error(lambda: store_checkpoint(store_url, local))
        fetches = _FetchCount()
        with mock.patch("socket.gethostname", return_value=f"host-{rank}"), fetches:
            shared = store_checkpoint(store_url, Path(out).parent / "shared-output")
        result["shared_fetch"] = [shared, fetches.count, sorted(os.listdir(shared))]
    resume_path = store_checkpoint(store_url, trainer=trainer) if resume else None
    trainer.train(resume_from_checkpoint=resume_path)
    result.update(files=sorted(os.listdir(Path(out) / f"checkpoint-{stop_at}")), resumed=resume_path,
                  loss=[e["loss"] for e in trainer.state.log_history if "loss" in e],
                  committed_steps=callback.committed_steps)
    if probe and not resume:
        copy = Path(out) / "checkpoint-3"
        shutil.copytree(Path(out) / f"checkpoint-{stop_at}", copy)
        if rank == 1:
            (copy / "rng_state_1.pth").unlink()
        result["commit_error"] = _error(lambda: callback.commit(args, types.SimpleNamespace(global_step=3)))
        shutil.rmtree(copy)
    return result


class _FetchCount(logging.Handler):
    """Counts the fetches of this process (``fetched ... into ...``, logged once per fetched step)
    while it is entered."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("fetched ")

    def __enter__(self) -> "_FetchCount":
        log = logging.getLogger("opd_store.integrations")
        self._level = log.level
        log.setLevel(logging.INFO)
        log.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        log = logging.getLogger("opd_store.integrations")
        log.removeHandler(self)
        log.setLevel(self._level)


def start_pair(base: Path, store_url: str, outs: list[str], stop_at: int, resume: bool, probe: bool = False,
               async_upload: bool = False) -> list[events.EventStream]:
    """Start both ranks; return their event streams (rank order)."""
    init_method = f"file://{base / f'rendezvous-{uuid.uuid4().hex}'}"
    streams = []
    for rank in (0, 1):
        spec = dict(rank=rank, init_method=init_method, store_url=store_url, out=outs[rank], stop_at=stop_at,
                    resume=resume, probe=probe, async_upload=async_upload)
        process = forkserver.popen([sys.executable, __file__, json.dumps(spec)], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        streams.append(events.EventStream(process))
    return streams


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
