"""``opd-store train``: the main job (a small real OPD run that checkpoints and resumes)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ..preemption import AWS_METADATA_ENDPOINT, GCE_METADATA_ENDPOINT, SIGNAL_NAMES, PreemptionWatcher
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
    parser.add_argument(
        "--local-tier",
        default=None,
        metavar="DIR",
        help="commit each checkpoint to this local directory first and upload it to --store in the "
        "background (docs/tiered.md); the job exits only after every upload landed",
    )
    parser.add_argument("--resume", default="auto", help="auto (default), never, or a step number")
    parser.add_argument("--seed", type=int, default=0, help="seed of models, data order and every RNG (default 0)")
    parser.add_argument("--log", default=None, help="per-update JSON-lines log file (default: stdout)")
    parser.add_argument("--events", default=None, help="JSON-lines file of resume/save events")
    parser.add_argument("--final-state", default=None, help="torch.save the final adapter and optimizer state here")
    parser.add_argument("--async-save", action="store_true",
                        help="periodic checkpoints in the background (training waits only for the snapshot)")
    spot = parser.add_argument_group("preemption (docs/spot.md)")
    spot.add_argument("--preemption-signal", action="append", choices=SIGNAL_NAMES, default=None,
                      help="signal that means 'save and exit 0' (repeatable; default SIGTERM)")
    spot.add_argument("--spot-notice", choices=("none", "aws", "gce"), default="none",
                      help="also poll the cloud's preemption notice: AWS spot instance-action (IMDSv2) or GCE preempted")
    spot.add_argument("--metadata-endpoint", default=None,
                      help="metadata server base URL (default: the platform's; tests use a fake one on loopback)")
    spot.add_argument("--notice-poll-secs", type=float, default=5.0, help="seconds between notice polls (default 5)")
    add_store_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..job.train import train
    from ..store import CheckpointStore

    if args.resume not in ("auto", "never") and not args.resume.isdigit():
        raise CliError(f"--resume must be auto, never or a step number, got {args.resume!r}")
    options = parse_storage_options(args.storage_option, args.s3_endpoint_url)
    store = CheckpointStore(args.store, storage_options=options)
    if args.notice_poll_secs <= 0:
        raise CliError(f"--notice-poll-secs must be > 0, got {args.notice_poll_secs}")
    endpoint = args.metadata_endpoint
    watcher = PreemptionWatcher(
        signals=args.preemption_signal or ("SIGTERM",),
        aws_endpoint=(endpoint or AWS_METADATA_ENDPOINT) if args.spot_notice == "aws" else None,
        gce_endpoint=(endpoint or GCE_METADATA_ENDPOINT) if args.spot_notice == "gce" else None,
        poll_interval_secs=args.notice_poll_secs,
    )
    if args.local_tier is not None:
        from ..tiered import TieredStore

        store = TieredStore(args.local_tier, store)
    with contextlib.ExitStack() as stack:
        if args.local_tier is not None:
            stack.enter_context(store)
        stack.enter_context(watcher)
        log = stack.enter_context(open(args.log, "a", encoding="utf-8")) if args.log else sys.stdout
        events = stack.enter_context(open(args.events, "a", encoding="utf-8")) if args.events else sys.stderr
        result = train(
            store=store,
            updates=args.updates,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            seed=args.seed,
            log=log,
            events=events,
            final_state_path=args.final_state,
            preemption=watcher,
            async_save=args.async_save,
        )
    summary = {
        "store": store.url,
        "resumed_from": result.resumed_from,
        "attempted_updates": result.attempted_updates,
        "successful_updates": result.successful_updates,
        "checkpoints_saved": [save["step"] for save in result.saves],
    }
    if result.preempted is not None:
        notice = result.preempted
        print(f"opd-store train: preempted ({notice['source']}): step {notice['step']} {notice['action']} at "
              f"{notice['url']} in {notice['seconds']:.2f} s; exiting 0", file=sys.stderr, flush=True)
        summary["preempted"] = {key: notice[key] for key in ("source", "step", "url", "action")}
    print(json.dumps(summary), file=sys.stderr if not args.log else sys.stdout)
    return 0
