"""One rank of a 2-process gloo run of a plain transformers Trainer with StoreCallback, forked from
the preloaded forkserver. Each rank has its own output directory (as on separate machines), so rank 0
cannot see rank 1's files: rank 1's ``rng_state_1.pth`` can reach the store only as rank 1's part.

With ``probe`` each rank also fails alone once, in the processes already running (no extra start):
after training, a commit of step 3 whose directory lacks rank 1's RNG file; before resuming, a fetch
into a directory rank 1 cannot create. Every rank must raise the same typed error naming rank 1
(a rank failing alone must not leave the other waiting in a collective); the errors are reported
as ``[type name, failing ranks, message]``."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import proc_writer  # noqa: E402



def _error(call) -> list | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return [type(exc).__name__, sorted(getattr(exc, "failures", {})), str(exc)]
    return None


def _rank(conn, rank: int, port: int, store_url: str, out: str, stop_at: int, resume: bool, probe: bool) -> None:
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import shutil
        import types

        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

        from opd_store.integrations.transformers import StoreCallback, store_checkpoint

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16))
        data = [{"input_ids": torch.arange(8) + i, "labels": torch.arange(8) + i} for i in range(32)]
        class StopAt(TrainerCallback):  # a run of 4 steps whose process ends after step ``stop_at``
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == stop_at:
                    control.should_training_stop = True

        args = TrainingArguments(output_dir=out, max_steps=4, save_steps=2, per_device_train_batch_size=2,
                                 report_to=[], use_cpu=True, disable_tqdm=True, ddp_backend="gloo", seed=0,
                                 logging_steps=1, ddp_timeout=60)
        callback = StoreCallback(store_url)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, StopAt()])
        result = {"rank": rank, "world_size": args.world_size}
        if probe and resume:
            blocker = Path(out).parent / f"not-a-directory-{rank}"
            blocker.write_text("x")
            local = blocker / "sub" if rank == 1 else Path(out).parent / f"probe-{rank}"
            result["fetch_error"] = _error(lambda: store_checkpoint(store_url, local))
        resume_path = store_checkpoint(store_url, trainer=trainer) if resume else None
        trainer.train(resume_from_checkpoint=resume_path)
        result.update(files=sorted(os.listdir(Path(out) / f"checkpoint-{stop_at}")), resumed=resume_path,
                      loss=[e["loss"] for e in trainer.state.log_history if "loss" in e])
        if probe and not resume:
            copy = Path(out) / "checkpoint-3"
            shutil.copytree(Path(out) / f"checkpoint-{stop_at}", copy)
            if rank == 1:
                (copy / "rng_state_1.pth").unlink()
            result["commit_error"] = _error(lambda: callback.commit(args, types.SimpleNamespace(global_step=3)))
            shutil.rmtree(copy)
        conn.send(result)
    except BaseException:  # noqa: BLE001
        conn.send({"rank": rank, "error": traceback.format_exc()})
    finally:
        conn.close()


def start_pair(port: int, store_url: str, outs: list[str], stop_at: int, resume: bool, probe: bool = False):
    ctx = proc_writer.context()
    procs = []
    for rank in (0, 1):
        parent, child = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_rank, args=(child, rank, port, store_url, outs[rank], stop_at, resume, probe),
                              daemon=True)
        process.start()
        child.close()
        procs.append((process, parent))
    return procs
