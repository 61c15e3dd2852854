"""Sharded checkpoints on GPUs: NCCL, ``dcp.async_save`` with pinned staging, CUDA RNG per rank.

NOT RUN YET: no machine of this project had a GPU when it was written (docs/performance.md). Every
check also runs on CPU with gloo (``--device cpu``, no pinned memory), which is how its logic was
exercised; the figures that matter need ``--device cuda``:

    python -m bench.dcp_gpu --store /tmp/dcp-gpu             # every visible GPU, one rank each
    python -m bench.dcp_gpu --store s3://bucket/run --s3-endpoint-url http://...  --size-mib 1024
    python -m bench.dcp_gpu --device cpu --nproc 4 --store /tmp/dcp-cpu   # the logic, on CPU

Checks, in one launch of N ranks (``cpu:gloo,cuda:nccl`` process group; DCP's asynchronous save
needs a CPU backend, and runs its collectives on a gloo group of its own):

1. ``sync save``: ``opd_store.dcp.save`` of an FSDP2 model sharded over the N GPUs (AdamW after a
   few steps); the training loop's blocked time is the whole save.
2. ``async save``, once per DCP executor (``--executors thread,process``; the process executor
   writes from DCP's background process, whose first save, which starts it, is not counted, and
   gets its staged copy through shared memory, ``use_shared_memory=True``):
   ``opd_store.dcp.async_save`` with ``DefaultStager(StagingOptions(
   use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
   use_non_blocking_copy=True))``; reported: the time until the call returns, the time until
   ``staged`` (the loop may change parameters only then: the real blocked time), and the time until
   the commit. One more optimizer step runs right after ``staged``; the committed step must hold the
   values from before that step.
3. ``resharded load``: the step saved by N ranks loaded by N/2 of them (a subgroup), every element of
   every parameter and optimizer tensor equal to the saved ones (gathered full state).
4. ``cuda rng``: ``save_sharded_opd_checkpoint`` captures every rank's CUDA generator; after a
   ``load_sharded_opd_checkpoint`` the next ``torch.rand(device="cuda")`` equals the one drawn right
   after the save, on every rank.

Prints one JSON line per rank and a summary table; ``--out DIR`` also writes them there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _model(device: str, mesh, size_mib: int, seed: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    width = 1024
    layers = max(2, size_mib * 2**20 // (3 * 4 * (width * width + width)))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def _train_step(model, optimizer, device: str) -> None:
    import torch

    model(torch.ones(8, 1024, device=device)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                    cpu_offload=True))
    # get_state_dict hands plain (unsharded) tensors such as AdamW's ``step`` over as they are:
    # copies, so the state cannot change under the caller when training goes on.
    return _clone({"model": model_sd, "optim": optim_sd})


def _clone(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(item) for item in value)
    return value


def _differing(a, b, path: str = "") -> list[str]:
    import torch

    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b.to(a.device)) else [path]
    if isinstance(a, dict):
        return [d for key in a for d in _differing(a[key], b.get(key) if isinstance(b, dict) else None, f"{path}.{key}")]
    if isinstance(a, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differing(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _rank(rank: int, args: argparse.Namespace, rendezvous: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from opd_store import CheckpointStore
    from opd_store.dcp import async_save, load, save

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", init_method=f"file://{rendezvous}",
                            rank=rank, world_size=args.nproc, timeout=datetime.timedelta(seconds=1800))
    side = dist.new_group(backend="gloo")  # the asynchronous save's collectives, on DCP's thread
    store = CheckpointStore(args.store, storage_options=args.storage_options)
    mesh = init_device_mesh(device, (args.nproc,))
    model, optimizer = _model(device, mesh, args.size_mib, seed=0)
    for _ in range(3):
        _train_step(model, optimizer, device)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    report: dict = {"rank": rank, "device": device, "sync_secs": [], "async_return_secs": [],
                    "async_staged_secs": [], "async_commit_secs": []}
    step = args.first_step
    for _ in range(args.repeats):
        _sync(device)
        dist.barrier()
        started = time.perf_counter()
        save(state, store, step)
        report["sync_secs"].append(time.perf_counter() - started)
        step += 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the process executor's background group
    for executor in args.executors:
        # The process executor receives the staged state through shared memory (DCP's e2e test does
        # the same); the first of its saves starts DCP's background process (spawn), so it is warmed
        # up once and not counted.
        stager = DefaultStager(StagingOptions(use_pinned_memory=device == "cuda",
                                              use_shared_memory=executor == "process",
                                              use_async_staging=device == "cuda",
                                              use_non_blocking_copy=device == "cuda"))
        kind = AsyncCheckpointerType(executor)
        suffix = "" if executor == "thread" else f"_{executor}"
        for key in ("async_return_secs", "async_staged_secs", "async_commit_secs"):
            report.setdefault(key.replace("async_", f"async{suffix}_"), [])
        try:
            for repeat in range(args.repeats + (executor == "process")):
                before = _full(model, optimizer)
                _sync(device)
                dist.barrier()
                started = time.perf_counter()
                pending = async_save(state, store, step, process_group=side, async_stager=stager,
                                     async_checkpointer_type=kind)
                returned = time.perf_counter() - started
                pending.staged.result()
                staged = time.perf_counter() - started
                _train_step(model, optimizer, device)  # the loop goes on: must not reach the saved step
                pending.result(timeout=1800)
                if executor == "thread" or repeat > 0:
                    report[f"async{suffix}_return_secs"].append(returned)
                    report[f"async{suffix}_staged_secs"].append(staged)
                    report[f"async{suffix}_commit_secs"].append(time.perf_counter() - started)
                async_step = step
                step += 1
        finally:
            stager.close()
    half = max(1, args.nproc // 2)
    sub = dist.new_group(list(range(half)))
    saved = before  # the state the last asynchronous save staged
    if rank < half:
        submesh = DeviceMesh.from_group(sub, device)
        fresh, fresh_optimizer = _model(device, submesh, args.size_mib, seed=1)
        fresh_sd, fresh_osd = get_state_dict(fresh, fresh_optimizer)
        load({"model": fresh_sd, "optim": fresh_osd}, store, async_step, process_group=sub)
        set_state_dict(fresh, fresh_optimizer, model_state_dict=fresh_sd, optim_state_dict=fresh_osd)
        loaded = _full(fresh, fresh_optimizer)
        if rank == 0:
            report["resharded_differing"] = _differing(saved, loaded)
    dist.barrier()
    report.update(_rng_check(rank, device, store, step, model, optimizer))
    print(json.dumps(report), flush=True)
    if args.out:
        Path(args.out, f"rank-{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _rng_check(rank: int, device: str, store, step: int, model, optimizer) -> dict:
    """CUDA (or CPU) generator of every rank through a sharded OPD checkpoint."""
    import torch

    from opd_store.opd import OPDConfig, load_sharded_opd_checkpoint, save_sharded_opd_checkpoint

    config, provenance = OPDConfig(), {"code_revision": "gpu-check"}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
    trainer = {"attempted_updates": step, "successful_updates": step, "query_update": step}
    torch.manual_seed(1234 + rank)
    if device == "cuda":
        torch.cuda.manual_seed(4321 + rank)
    save_sharded_opd_checkpoint(checkpoints_dir=store, model=model, optimizer=optimizer, scheduler=scheduler,
                                trainer_state=trainer, config=config, provenance_fingerprints=provenance,
                                teacher_state={})
    after_save = torch.rand(4, device=device).tolist()
    torch.rand(100, device=device)  # move on
    load_sharded_opd_checkpoint(store.step_url(step), model=model, optimizer=optimizer, scheduler=scheduler,
                                config=config, provenance_fingerprints=provenance, teacher_state_loader=lambda s: None)
    return {"rng_restored": torch.rand(4, device=device).tolist() == after_save}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store URL (local path, s3://, gs://, ...)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: every visible GPU; 2 on CPU)")
    parser.add_argument("--size-mib", type=int, default=256, help="parameters and AdamW moments in all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--first-step", type=int, default=1)
    parser.add_argument("--s3-endpoint-url", default=None)
    parser.add_argument("--out", default=None, help="directory for each rank's JSON report")
    parser.add_argument("--executors", default="thread,process",
                        help="DCP's async_save executors to measure, in order (thread, process)")
    args = parser.parse_args(argv)
    args.executors = [name for name in args.executors.split(",") if name]
    import torch
    import torch.multiprocessing as mp

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; --device cpu runs the same checks with gloo")
    args.nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    args.storage_options = {"endpoint_url": args.s3_endpoint_url} if args.s3_endpoint_url else {}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dcp-gpu-") as tmp:
        mp.start_processes(_rank, args=(args, f"{tmp}/rendezvous"), nprocs=args.nproc, start_method="spawn")
    if args.out:
        reports = [json.loads(Path(args.out, f"rank-{r}.json").read_text()) for r in range(args.nproc)]
        worst = lambda key: max(statistics.median(r[key]) for r in reports)  # noqa: E731
        print(f"ranks {args.nproc} on {args.device}, {args.size_mib} MiB: sync save {worst('sync_secs'):.3f} s blocked; "
              f"async save returns in {worst('async_return_secs'):.3f} s, staged in {worst('async_staged_secs'):.3f} s "
              f"(blocked), committed in {worst('async_commit_secs'):.3f} s"
              + ("".join(f"; {e} executor: returns in {worst(f'async_{e}_return_secs'):.3f} s, staged in "
                         f"{worst(f'async_{e}_staged_secs'):.3f} s, committed in {worst(f'async_{e}_commit_secs'):.3f} s"
                         for e in args.executors if e != "thread"))
              + f"; resharded load on {max(1, args.nproc // 2)} "
              f"ranks differing: {reports[0].get('resharded_differing')}; RNG restored on every rank: "
              f"{all(r['rng_restored'] for r in reports)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
