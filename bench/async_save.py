"""Asynchronous saves versus synchronous ones, measured side by side in one run.

    .venv/bin/python -m bench.async_save [--size-mib 1024] [--repeats 3] [--backends local,s3]
                                          [--job-updates 8] [--job-every 2] [--no-job]

1. blocked: an OPD checkpoint whose state totals ``--size-mib`` MiB (a student of 16 float32
   Linear layers holding a third of it, AdamW's ``exp_avg``/``exp_avg_sq`` the rest) is saved
   through ``save_opd_checkpoint`` (synchronous: training waits for the commit) and through
   ``AsyncCheckpointer.save`` (training waits only for the snapshot: host copies of every tensor;
   the write and commit run in the background, and each async save is waited for before the next
   measurement, so the two never overlap). The student's ``save_pretrained`` takes ``state_dict=``,
   as PEFT's does. Runs alternate (sync, async, async, sync, ...) on the same store; the first
   async save allocates its staging buffers and is reported apart (``first``); ``steady`` is the
   median of the later ones, which reuse them. Target: blocked <= 10 % of the synchronous save
   (the spot-saves target in ``docs/performance.md``).
   Backends: a local directory and moto S3 in its own process (``opd_testkit.s3.MotoProcess``).
2. job: updates per second of the main job (``opd_store.job._train.train``, in this process)
   with a checkpoint every ``--job-every`` successful updates, synchronous and ``async_save``,
   against no checkpoints (``checkpoint_every`` past the end), on a local store, after one
   warm-up run. Each run includes the same model build; the job's checkpoints are small (tens of
   KiB). ``--backends ""`` runs only this part.

Prints markdown tables (and writes them to ``bench/results/async-save-<date>-<size>mib.md``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from opd_testkit.s3 import MotoProcess

from bench._common import MIB, REPO_ROOT

N_LAYERS = 16


def _student_class():
    import torch
    from safetensors.torch import save_file

    class BenchStudent(torch.nn.Module):
        """Linear layers whose ``save_pretrained`` writes safetensors (honours ``state_dict=``)."""

        def __init__(self, params_per_layer: int) -> None:
            super().__init__()
            side = max(1, int(params_per_layer**0.5))
            self.layers = torch.nn.ModuleList(torch.nn.Linear(side, side, bias=False) for _ in range(N_LAYERS))

        def save_pretrained(self, directory: str, state_dict: dict | None = None) -> None:
            state = self.state_dict() if state_dict is None else state_dict
            Path(directory).mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(Path(directory) / "adapter_model.safetensors"))

    return BenchStudent


class _Config:
    def fingerprint(self) -> str:
        return "bench"

    def as_dict(self) -> dict:
        return {"bench": True}


def _training(size_mib: int, device: str = "cpu"):
    """Student + AdamW (with state) + LambdaLR totalling about ``size_mib`` MiB of float32 on ``device``."""
    import torch

    params_per_layer = size_mib * MIB // 4 // 3 // N_LAYERS
    model = _student_class()(params_per_layer).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    scheduler.step()
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return model, optimizer, scheduler, nbytes


def _kwargs(store, model, optimizer, scheduler, step: int) -> dict:
    return dict(
        checkpoints_dir=store, model=model, processor=None, optimizer=optimizer, scheduler=scheduler,
        trainer_state={"attempted_updates": step, "successful_updates": step, "query_update": step},
        config=_Config(), provenance_fingerprints={"bench": "1"}, teacher_state={"update_count": step},
    )


def bench_blocked(store_factory, size_mib: int, repeats: int, device: str = "cpu") -> dict:
    from opd_store.opd import AsyncCheckpointer, save_opd_checkpoint

    model, optimizer, scheduler, nbytes = _training(size_mib, device)
    store = store_factory()
    sync_secs, async_blocked, async_total = [], [], []
    step = 0
    with AsyncCheckpointer() as checkpointer:
        for index in range(repeats):
            order = ("sync", "async") if index % 2 == 0 else ("async", "sync")
            for kind in order:
                step += 1
                started = time.perf_counter()
                if kind == "sync":
                    save_opd_checkpoint(**_kwargs(store, model, optimizer, scheduler, step))
                    sync_secs.append(time.perf_counter() - started)
                else:
                    handle = checkpointer.save(**_kwargs(store, model, optimizer, scheduler, step))
                    async_blocked.append(handle.blocked_secs)
                    handle.result()
                    async_total.append(time.perf_counter() - started)
            for done in (step - 1, step):  # keep the store (and moto's memory) small
                store.delete(done)
    steady = async_blocked[1:] or async_blocked
    sync_median = statistics.median(sync_secs)
    return {
        "state_mib": nbytes / MIB,
        "sync_secs": sync_median,
        "async_first_blocked_secs": async_blocked[0],
        "async_steady_blocked_secs": statistics.median(steady),
        "async_total_secs": statistics.median(async_total),
        "ratio_steady": statistics.median(steady) / sync_median,
        "ratio_first": async_blocked[0] / sync_median,
    }


def bench_job(updates: int, every: int) -> list[tuple[str, float, float]]:
    from opd_store import CheckpointStore
    from opd_store.job import train

    with tempfile.TemporaryDirectory(prefix="opd-bench-job-") as tmp:  # warm-up: first-use costs out of the rows
        with open(Path(tmp) / "log.jsonl", "w") as log:
            train(store=CheckpointStore(Path(tmp) / "store"), updates=1, checkpoint_every=2, log=log)
    rows = []
    for label, checkpoint_every, async_save in (("none", updates + 1, False), ("sync", every, False),
                                                ("async", every, True)):
        with tempfile.TemporaryDirectory(prefix="opd-bench-job-") as tmp:
            started = time.perf_counter()
            with open(Path(tmp) / "log.jsonl", "w") as log:
                result = train(store=CheckpointStore(Path(tmp) / "store"), updates=updates,
                               checkpoint_every=checkpoint_every, log=log, async_save=async_save)
            secs = time.perf_counter() - started
        rows.append((label, secs, result.successful_updates / secs))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="local,s3")
    parser.add_argument("--job-updates", type=int, default=8)
    parser.add_argument("--job-every", type=int, default=2)
    parser.add_argument("--no-job", action="store_true")
    parser.add_argument("--device", default="cpu", help="where the state lives: cpu, or cuda (staged into pinned host memory)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from opd_store import CheckpointStore

    out = io.StringIO()

    def emit(line: str = "") -> None:
        print(line, flush=True)
        out.write(line + "\n")

    emit(f"# Asynchronous save, {args.size_mib} MiB state on {args.device}, {args.repeats} repeats ({_dt.date.today()})")
    emit()
    emit("| backend | state MiB | sync save s | async blocked s (first) | async blocked s (steady) | "
         "async save total s | blocked / sync (steady) | blocked / sync (first) |")
    emit("|---|---|---|---|---|---|---|---|")
    for backend in [name for name in args.backends.split(",") if name]:
        tmp = tempfile.mkdtemp(prefix="opd-bench-async-")
        moto = None
        try:
            if backend == "local":
                factory = lambda: CheckpointStore(Path(tmp) / "store")  # noqa: E731
            elif backend == "s3":
                moto = MotoProcess()
                moto.new_bucket("bench")
                factory = lambda: CheckpointStore("s3://bench/async", storage_options=moto.storage_options())  # noqa: E731
            else:
                raise SystemExit(f"unknown backend {backend}")
            row = bench_blocked(factory, args.size_mib, args.repeats, args.device)
        finally:
            if moto is not None:
                moto.stop()
            shutil.rmtree(tmp, ignore_errors=True)
        emit(f"| {backend} | {row['state_mib']:.0f} | {row['sync_secs']:.3f} | {row['async_first_blocked_secs']:.3f} | "
             f"{row['async_steady_blocked_secs']:.3f} | {row['async_total_secs']:.3f} | {row['ratio_steady']:.1%} | "
             f"{row['ratio_first']:.1%} |")
    emit()
    emit("Target: blocked <= 10 % of the synchronous save (steady state).")
    if not args.no_job:
        emit()
        emit(f"## Main job: {args.job_updates} updates, checkpoint every {args.job_every} (local store)")
        emit()
        emit("| checkpoints | wall s | updates/s | vs none |")
        emit("|---|---|---|---|")
        rows = bench_job(args.job_updates, args.job_every)
        base = rows[0][2]
        for label, secs, rate in rows:
            emit(f"| {label} | {secs:.1f} | {rate:.3f} | {rate / base:.2f}x |")
    results = REPO_ROOT / "bench" / "results" / f"async-save-{_dt.date.today()}-{args.size_mib}mib{'' if args.device == 'cpu' else '-' + args.device}.md"
    results.write_text(out.getvalue(), encoding="utf-8")
    print(f"\nwritten to {results.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
