"""``opd-store train``: the main job (a small real OPD run that checkpoints and resumes)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from .common import CliError, add_store_options, parse_storage_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="run the OPD main job against a store, resuming from its latest complete checkpoint",
        description=(
            "A small on-policy distillation run on CPU (tiny Llama student with a LoRA adapter, "
            "frozen teacher, local tokenizer) that checkpoints every K successful updates."
        ),
    )
    parser.add_argument("--store", required=True, help="store URL: local path, s3://, gs://, memory://, ...")
    parser.add_argument("--updates", type=int, required=True, help="successful updates to reach")
    parser.add_argument("--checkpoint-every", type=int, default=2, help="save every K successful updates (default 2)")
    parser.add_argument("--resume", default="auto", help="auto (default), never, or a step number")
    parser.add_argument("--seed", type=int, default=0, help="seed of models, data order and every RNG (default 0)")
    parser.add_argument("--log", default=None, help="per-update JSON-lines log file (default: stdout)")
    parser.add_argument("--events", default=None, help="JSON-lines file of resume/save events")
    parser.add_argument("--final-state", default=None, help="torch.save the final adapter and optimizer state here")
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks to spawn (gloo process group on 127.0.0.1; each rank saves its part; default 1)")
    parser.add_argument("--dist-timeout-secs", type=float, default=600.0,
                        help="process-group timeout: a rank waiting longer on a collective fails (default 600)")
    add_store_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.resume not in ("auto", "never") and not args.resume.isdigit():
        raise CliError(f"--resume must be auto, never or a step number, got {args.resume!r}")
    if args.nproc < 1:
        raise CliError(f"--nproc must be >= 1, got {args.nproc}")
    options = parse_storage_options(args.storage_option, args.s3_endpoint_url)
    if args.nproc == 1:
        return _train(args, options)
    return _spawn(args, options)


def _train(args: argparse.Namespace, options: dict, rank: int = 0) -> int:
    from ..job.train import train
    from ..store import CheckpointStore

    store = CheckpointStore(args.store, storage_options=options)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(args.log, "a", encoding="utf-8")) if args.log and rank == 0 else sys.stdout
        events = (stack.enter_context(open(args.events, "a", encoding="utf-8")) if args.events and rank == 0
                  else sys.stderr)
        result = train(
            store=store,
            updates=args.updates,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            seed=args.seed,
            log=log,
            events=events,
            final_state_path=args.final_state,
        )
    if rank != 0:
        return 0
    summary = {
        "store": store.url,
        "resumed_from": result.resumed_from,
        "attempted_updates": result.attempted_updates,
        "successful_updates": result.successful_updates,
        "checkpoints_saved": [save["step"] for save in result.saves],
    }
    print(json.dumps(summary), file=sys.stderr if not args.log else sys.stdout)
    return 0


def _spawn(args: argparse.Namespace, options: dict) -> int:
    """Run ``args.nproc`` ranks with ``torch.multiprocessing`` (spawn) in one gloo process group.

    Returns the first failing rank's exit code (``128 + signal`` for a rank killed by a signal);
    the other ranks are then terminated (torch's process context does that).
    """
    import socket

    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.start_processes(_rank_main, args=(args, options, port), nprocs=args.nproc, join=False,
                                 start_method="spawn")
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as exc:
        code = exc.exit_code
        return 128 - code if code < 0 else code
    except mp.ProcessRaisedException as exc:
        print(f"opd-store train: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _rank_main(rank: int, args: argparse.Namespace, options: dict, port: int) -> None:
    """One spawned rank: join the process group, train, leave; exit with the CLI's exit code."""
    import datetime

    import torch.distributed as dist

    from .common import exit_code_for

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc,
                            timeout=datetime.timedelta(seconds=args.dist_timeout_secs))
    try:
        code = _train(args, options, rank)
    except (CliError, OSError, ValueError) as exc:
        message = str(exc).strip() or type(exc).__name__
        print(f"opd-store train: error: rank {rank}: {message}", file=sys.stderr)
        sys.exit(exit_code_for(exc))
    dist.destroy_process_group()
    sys.exit(code)
