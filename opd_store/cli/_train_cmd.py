"""``opd-store train``: the main job (a small real OPD run that checkpoints and resumes)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from ..ledger import MAX_AUTO_EVERY
from ..opd import RESUME_MODES
from ..runtime import AWS_METADATA_ENDPOINT, GCE_METADATA_ENDPOINT, SIGNAL_NAMES, PreemptionWatcher
from ._common import (
    EXIT_CONFLICT,
    EXIT_CORRUPT,
    EXIT_RANK_LOST,
    EXIT_RESUME_MISMATCH,
    EXIT_USAGE,
    CliError,
    add_store_options,
    file_in_existing_dir,
    nonnegative_secs,
    port_arg,
    positive_int,
    positive_secs,
    store_options,
)


def checkpoint_interval(text: str) -> tuple[int, bool]:
    """argparse type of ``--checkpoint-every``: ``K`` (an int >= 1), ``auto`` (from 2) or ``auto:K``
    (K up to ``MAX_AUTO_EVERY``, the bound auto keeps); returns ``(K, auto)``.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    head, sep, tail = text.partition(":")
    auto = head == "auto"
    number = tail if auto and sep else ("2" if auto else text)
    if (sep and not auto) or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"expected K >= 1, auto or auto:K, got {text!r}")
    if auto and int(number) > MAX_AUTO_EVERY:
        raise argparse.ArgumentTypeError(f"auto:K keeps the interval within 1 and {MAX_AUTO_EVERY:,} updates, "
                                         f"got {text!r}")
    return int(number), auto


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
    parser.add_argument("--checkpoint-every", type=checkpoint_interval, default=(2, False), metavar="K|auto[:K]",
                        help="save every K successful updates (default 2); auto (from 2) or auto:K moves the interval "
                        "toward the Young/Daly optimum as saves and preemptions are measured (docs/ledger.md)")
    parser.add_argument(
        "--local-tier",
        default=None,
        metavar="DIR",
        help="commit each checkpoint to this local directory first and upload it to --store in the "
        "background (docs/tiered.md); the job exits only after every upload landed",
    )
    parser.add_argument("--keep-last", type=positive_int, default=None, metavar="N",
                        help="after each save, delete complete checkpoints beyond the newest N (default: keep all; "
                        "with --local-tier this is the bucket's retention, applied after each upload)")
    parser.add_argument("--keep-every", type=positive_int, default=None, metavar="K",
                        help="keep every checkpoint whose step is a multiple of K, and delete the others not kept "
                        "by --keep-last (alone: the multiples of K and the newest; default: keep all)")
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
    spot.add_argument("--notice-poll-secs", type=positive_secs, default=5.0, help="seconds between notice polls (default 5)")
    spot.add_argument("--notice-deadline-secs", type=positive_secs, default=None, metavar="SECS",
                      help="a preemption signal's deadline (the pod's grace period): on a signal, the final save is "
                      "started only if it can commit within SECS, else the job exits at once saying what is lost "
                      "(the AWS and GCE notices carry their own deadline; docs/ledger.md)")
    ledger = parser.add_argument_group("run journal and metrics (docs/ledger.md)")
    ledger.add_argument("--journal-progress-secs", type=nonnegative_secs, default=60.0, metavar="SECS",
                        help="seconds between the run journal's progress events (0: after every update; the report's "
                        "lost updates are exact then; default 60)")
    ledger.add_argument("--metrics-port", type=port_arg, default=None, metavar="PORT",
                        help="serve Prometheus metrics on this port (the prometheus extra)")
    ledger.add_argument("--metrics-textfile", type=file_in_existing_dir, default=None, metavar="FILE",
                        help="write Prometheus metrics to FILE after every journal event (node_exporter's textfile "
                        "collector; the prometheus extra)")
    parser.add_argument("--resume-mode", choices=RESUME_MODES, default="exact",
                        help="how a resume may differ from the saved run (docs/resume.md); 'elastic' accepts another "
                        "--nproc (default exact)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks to spawn (gloo process group on 127.0.0.1; each rank saves its part; default 1)")
    parser.add_argument("--shard", action="store_true",
                        help="shard the student over the ranks with FSDP2 and checkpoint through DCP (docs/sharded.md)")
    parser.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                        help="how ranks are started: spawn (default; required once CUDA is in use) or fork (CPU "
                        "only: the ranks share this process's imports and start in a fraction of the time)")
    parser.add_argument("--dist-timeout-secs", type=positive_secs, default=600.0,
                        help="process-group timeout: a rank waiting longer on a collective fails (default 600)")
    parser.add_argument("--rank-timeout-secs", type=positive_secs, default=30.0,
                        help="with --nproc > 1: once a rank died, the others are given this long to give up on "
                        "their own before they are stopped; also the timeout of the collective in which the ranks "
                        "agree on a preemption notice at every update boundary (default 30)")
    add_store_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.resume not in ("auto", "never") and not args.resume.isdigit():
        raise CliError(f"--resume must be auto, never or a step number, got {args.resume!r}")
    if args.nproc < 1:
        raise CliError(f"--nproc must be >= 1, got {args.nproc}")
    if (args.nproc > 1 or args.shard) and (args.async_save or args.local_tier is not None):
        # Asynchronous saves and the local tier are single-writer features of the main job.
        raise CliError("--nproc > 1 and --shard cannot be combined with --async-save or --local-tier")
    options = store_options(args)
    if args.nproc == 1 and not args.shard:
        return _train(args, options)
    return _spawn(args, options)


def _train(args: argparse.Namespace, options: dict, rank: int = 0, launcher_pid: int | None = None) -> int:
    from ..store import CheckpointStore

    store = CheckpointStore(args.store, storage_options=options, allow_check_then_put=args.allow_check_then_put)
    if args.local_tier is not None:
        from ..tiered import TieredStore

        store = TieredStore(args.local_tier, store)
    # Before the job's modules (torch, transformers, PEFT: seconds to import) are loaded, so an
    # unusable store is refused at once; train() checks again, as its API promises.
    store.check_reachable()

    from ..job import train
    from ..retention import RetentionPolicy

    endpoint = args.metadata_endpoint
    watcher = PreemptionWatcher(  # every rank: a notice seen by any rank is agreed at the next boundary
        signals=args.preemption_signal or ("SIGTERM",),
        aws_endpoint=(endpoint or AWS_METADATA_ENDPOINT) if args.spot_notice == "aws" else None,
        gce_endpoint=(endpoint or GCE_METADATA_ENDPOINT) if args.spot_notice == "gce" else None,
        poll_interval_secs=args.notice_poll_secs,
    )
    with contextlib.ExitStack() as stack:
        sinks = []
        if rank == 0 and (args.metrics_port is not None or args.metrics_textfile is not None):
            from ..ledger import PrometheusExporter

            exporter = PrometheusExporter(port=args.metrics_port, textfile=args.metrics_textfile)
            stack.callback(exporter.close)
            sinks.append(exporter)
        if args.local_tier is not None:
            stack.enter_context(store)
        if watcher is not None:
            stack.enter_context(watcher)
        log = stack.enter_context(open(args.log, "a", encoding="utf-8")) if args.log and rank == 0 else sys.stdout
        events = (stack.enter_context(open(args.events, "a", encoding="utf-8")) if args.events and rank == 0
                  else sys.stderr)
        result = train(
            store=store,
            updates=args.updates,
            checkpoint_every=args.checkpoint_every[0],
            checkpoint_every_auto=args.checkpoint_every[1],
            progress_every_secs=args.journal_progress_secs,
            notice_deadline_secs=args.notice_deadline_secs,
            journal_sinks=sinks,
            process_started_secs=_started_secs(launcher_pid),
            resume=args.resume,
            seed=args.seed,
            log=log,
            events=events,
            final_state_path=args.final_state,
            preemption=watcher,
            async_save=args.async_save,
            retention=RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every),
            resume_mode=args.resume_mode,
            shard=args.shard,
            rank_timeout_secs=args.rank_timeout_secs,
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
    notice = result.preempted
    if notice is not None and notice["action"] == "skipped":
        last = (f"the last committed step is {notice['last_committed_step']} ({notice['url']})"
                if notice["last_committed_step"] is not None else "no step is committed")
        print(f"opd-store train: preempted ({notice['source']}): no save started at step {notice['step']}: "
              f"{notice['reason']}; {last}, {notice['updates_lost']} updates lost; exiting 0",
              file=sys.stderr, flush=True)
    elif notice is not None:
        print(f"opd-store train: preempted ({notice['source']}): step {notice['step']} {notice['action']} at "
              f"{notice['url']} in {notice['seconds']:.2f} s; exiting 0", file=sys.stderr, flush=True)
    if notice is not None:
        summary["preempted"] = {key: notice[key] for key in ("source", "step", "url", "action")}
    print(json.dumps(summary), file=sys.stderr if not args.log else sys.stdout)
    return 0


def _started_secs(launcher_pid: int | None) -> float | None:
    """When the launcher of spawned ranks started (a restart is timed from the command the user
    ran, not from its ranks' start); ``None`` in a single process."""
    if launcher_pid is None:
        return None
    from ..ledger import process_started_secs

    return process_started_secs(launcher_pid)


def _spawn(args: argparse.Namespace, options: dict) -> int:
    """Run ``args.nproc`` ranks with ``torch.multiprocessing`` (``--start-method``) in one gloo process group.

    The preemption signals this process receives (SIGTERM from a platform that signals only the
    job's first process) are forwarded to every rank. When a rank fails, the others get
    ``--rank-timeout-secs`` to give up on their own (a dead peer's connections fail their
    collectives at once), then are stopped (SIGTERM, then SIGKILL after as long again); nothing a
    failed save wrote is committed, and the message names the step a rerun resumes from. When this
    process dies, even by SIGKILL, the kernel kills every rank
    (:func:`~opd_store.cli._rank_process.tie_to_launcher`), so no rank goes on committing beside a rerun.

    Returns the first failing rank's exit code (``128 + signal`` for a rank killed by a signal).
    """
    import shutil
    import signal
    import tempfile

    import torch.multiprocessing as mp

    # The ranks meet through a file in a directory of this run's own: a TCP port chosen here and
    # bound again by rank 0 could be taken in between by another process on the host.
    rendezvous_dir = tempfile.mkdtemp(prefix="opd-train-rendezvous-")
    init_method = f"file://{os.path.join(rendezvous_dir, 'store')}"
    if args.start_method == "fork":
        from ..job import train  # noqa: F401 - imported once here, shared by the forked ranks
    try:
        context = mp.start_processes(_rank_main, args=(args, options, init_method, os.getpid()), nprocs=args.nproc,
                                     join=False, start_method=args.start_method)
    except BaseException:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
        raise

    def forward(signum, _frame) -> None:
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    forwarded = {getattr(signal, name): signal.signal(getattr(signal, name), forward)
                 for name in args.preemption_signal or ("SIGTERM",)}
    try:
        while not context.join(grace_period=args.rank_timeout_secs):
            pass
    except mp.ProcessExitedException as exc:
        # torch stopped the other ranks (after the grace period); name the rank that failed first
        # for a reason of its own, not one that gave up because of it (exit 7), whichever exited first.
        codes = {rank: process.exitcode for rank, process in enumerate(context.processes)}
        causes = [rank for rank, code in codes.items() if code not in (0, EXIT_RANK_LOST, None)]
        # A rank killed by a signal other than the SIGTERM torch stops the others with comes first.
        rank = (min(causes, key=lambda r: (codes[r] == -signal.SIGTERM, codes[r] >= 0, r)) if causes
                else exc.error_index)
        code = codes.get(rank) if codes.get(rank) is not None else exc.exit_code
        what = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        gave_up = sorted(r for r, c in codes.items() if c == EXIT_RANK_LOST)
        others = f"ranks {gave_up} gave up" if gave_up else "the other ranks were stopped"
        print(f"opd-store train: rank {rank} {what}; {others} (within {args.rank_timeout_secs:g} s, then stopped; "
              f"exit codes by rank: {codes}); {_rerun_outcome(code, args, options)}", file=sys.stderr)
        return 128 - code if code < 0 else code
    except mp.ProcessRaisedException as exc:
        print(f"opd-store train: error: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum, handler in forwarded.items():
            signal.signal(signum, handler)
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
    return 0


def _rerun_outcome(code: int, args: argparse.Namespace, options: dict) -> str:
    """What a rerun of the same command does, for the message after a failed run: a failure a rerun
    repeats (damage, a resume refused, a commit conflict: exit 4, 5, 6, or a usage error, 2) says
    so instead of promising a resume."""
    if code in (EXIT_USAGE, EXIT_CORRUPT, EXIT_RESUME_MISMATCH, EXIT_CONFLICT):
        return "a rerun of the same command fails the same way: see the rank's error above"
    return _resume_point(args, options)


def _resume_point(args: argparse.Namespace, options: dict) -> str:
    """Where a rerun of the same command resumes, for the message after a failed run."""
    from ..errors import CheckpointNotFoundError
    from ..store import CheckpointStore

    try:
        step = CheckpointStore(args.store, storage_options=options).latest_step()
    except CheckpointNotFoundError:
        return "no checkpoint is committed; a rerun starts from the beginning"
    except Exception as exc:  # noqa: BLE001 - the message is best effort; the job already failed
        return f"the store could not be read ({type(exc).__name__}); a rerun resumes from its latest complete checkpoint"
    return f"the latest complete checkpoint is step {step}; rerun the same command to resume from it"


def _rank_main(rank: int, args: argparse.Namespace, options: dict, init_method: str, launcher_pid: int) -> None:
    """One spawned rank: tie its life to the launcher's (``launcher_pid``), join the process group
    (``init_method``: the run's rendezvous file), train, leave; exit with the CLI's exit code."""
    import datetime

    from ._rank_process import tie_to_launcher

    tie_to_launcher(launcher_pid, rank)  # first: a launcher killed from here on takes this rank with it

    import torch.distributed as dist

    from ._common import configure_logging, exit_code_for

    configure_logging(args.verbose)  # as quiet as one process: client libraries' warnings only with -v

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=args.nproc,
                            timeout=datetime.timedelta(seconds=args.dist_timeout_secs))
    try:
        code = _train(args, options, rank, launcher_pid)
    except (CliError, OSError, ValueError) as exc:
        message = str(exc).strip() or type(exc).__name__
        print(f"opd-store train: error: rank {rank}: {message}", file=sys.stderr)
        os._exit(exit_code_for(exc))  # no process-group teardown: a peer may be gone
    except RuntimeError as exc:  # torch.distributed: a peer's connection closed, or a collective timed out
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"opd-store train: rank {rank}: gave up: another rank is gone or stopped answering ({first}); "
              "this rank commits nothing", file=sys.stderr)
        os._exit(EXIT_RANK_LOST)
    dist.destroy_process_group()
    sys.exit(code)
