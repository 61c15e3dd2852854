"""``opd-store demo``: train, SIGKILL, resume on a fresh "machine", compare bit for bit."""

from __future__ import annotations

import argparse
import datetime as _dt
import subprocess
from pathlib import Path
from typing import Any, Callable

from ._common import CliError, add_store_options, open_store, store_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="kill a training run (once mid-save), resume it on a fresh machine, compare with a reference",
        description=(
            "Runs an uninterrupted reference, then a run that is SIGKILLed twice (once at a random "
            "update, once while a save is streaming its payloads) and resumed each time in a new process with an empty working "
            "directory, HOME and temp dir. Exits 1 unless the final adapter weights, optimizer state "
            "and per-update loss log are bit-identical to the reference."
        ),
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--store", default=None, help="any store URL (default: a new directory under ./opd-demo)")
    where.add_argument("--s3-emulator", action="store_true", help="use an S3 server (moto) started on 127.0.0.1")
    parser.add_argument("--updates", type=int, default=8, help="successful updates (default 8)")
    parser.add_argument("--checkpoint-every", type=int, default=2, help="save every K successful updates (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="training seed")
    parser.add_argument("--kill-seed", type=int, default=None, help="seed of the random kill point (default: random)")
    parser.add_argument("--workdir", default=None, help="where logs and fresh machines go (default: ./opd-demo/<time>)")
    add_store_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, *, popen: Callable[..., Any] = subprocess.Popen, out=None) -> int:
    """Run ``opd-store demo``; ``popen`` and ``out`` go to :func:`~opd_store.job._demo.run_demo`
    (tests start the training processes from a preloaded fork server).

    Raises:
        CliError: ``--checkpoint-every`` below 1 or ``--updates`` below twice it, ``--s3-emulator``
            with ``--s3-endpoint-url``, or ``--s3-emulator`` without moto installed; before
            anything is started or created.
    """
    # Refused before anything starts or is created (an emulator, the store's directory, the work
    # directory): a refused command leaves nothing behind.
    if args.checkpoint_every < 1 or args.updates < 2 * args.checkpoint_every:
        raise CliError(f"the demo needs --checkpoint-every >= 1 and --updates >= 2 x --checkpoint-every "
                       f"(got {args.updates} and {args.checkpoint_every})")
    if args.s3_emulator and args.s3_endpoint_url:
        raise CliError("--s3-emulator starts its own S3 endpoint; drop --s3-endpoint-url")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    workdir = Path(args.workdir or Path.cwd() / "opd-demo" / stamp).resolve()
    options = store_options(args)
    store_args = [arg for pair in args.storage_option for arg in ("--storage-option", pair)]
    if args.s3_endpoint_url:
        store_args += ["--s3-endpoint-url", args.s3_endpoint_url]
    if args.connect_timeout_secs is not None:
        store_args += ["--connect-timeout-secs", str(args.connect_timeout_secs)]
    if args.allow_check_then_put:
        store_args += ["--allow-check-then-put"]
    storage_env: dict[str, str] = {}
    server = None
    if args.s3_emulator:
        try:
            from ..job import DemoS3Server

            server = DemoS3Server()
        except ImportError as exc:
            raise CliError(f"--s3-emulator needs moto's server ({exc}); pip install 'opd_store[emulator]'") from exc
        storage_env = server.environment()  # the training processes' credentials
        server.create_bucket("opd-demo")
        store_url = f"s3://opd-demo/{stamp}"
        # This process's own stores: the same credentials as options (its environment is left alone);
        # the command's other store options (--storage-option, --connect-timeout-secs) still apply.
        options.update(server.storage_options())
        store_args += ["--s3-endpoint-url", server.endpoint_url]
    elif args.store:
        store_url = args.store
    else:
        store_url = str(workdir / "store")
    try:
        # Before the reference run: an unusable store is refused in seconds, not after minutes of work.
        open_store(store_url, args, create=True, options=options)
        from ..job import run_demo  # torch and the job's models: after the check

        return run_demo(
            store_url=store_url,
            store_args=store_args,
            storage_env=storage_env,
            storage_options=options,
            workdir=workdir,
            updates=args.updates,
            every=args.checkpoint_every,
            seed=args.seed,
            kill_seed=args.kill_seed,
            popen=popen,
            out=out,
        )
    finally:
        if server is not None:
            server.stop()
