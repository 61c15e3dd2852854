"""The ``opd-store`` command line (also ``python -m opd_store``).

Human output goes to stdout, diagnostics to stderr; exit codes are listed in
:mod:`opd_store.cli.common`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .common import EXIT_USAGE, CliError, exit_code_for

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away


def build_parser() -> argparse.ArgumentParser:
    from . import demo_cmd, import_dcp_cmd, inspect_cmd, migrate_cmd, store_cmds, train_cmd

    parser = argparse.ArgumentParser(
        prog="opd-store",
        description="Crash-safe PyTorch checkpoints on any fsspec URL.",
        epilog="exit codes: 0 ok, 2 usage or unreachable store, 3 not found, 4 incomplete/corrupt, "
        "5 resume mismatch, 6 commit conflict, 7 (train --nproc) a rank gave up on a lost rank",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level on stderr")
    subparsers = parser.add_subparsers(dest="command", required=True)
    train_cmd.add_parser(subparsers)
    demo_cmd.add_parser(subparsers)
    migrate_cmd.add_parser(subparsers)
    import_dcp_cmd.add_parser(subparsers)
    inspect_cmd.add_parsers(subparsers)
    store_cmds.add_parsers(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``opd-store``; returns the process exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0); main returns, never exits
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        code = args.handler(args)
        sys.stdout.flush()  # a closed pipe fails here, inside the handler below, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`opd-store ls URL | head`): stop quietly, as a command killed by
        # SIGPIPE would. stdout is pointed at /dev/null so the interpreter's final flush cannot
        # fail again (Python docs, "Note on SIGPIPE" in the signal module).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except (CliError, OSError, ValueError) as exc:
        message = str(exc).strip() or type(exc).__name__
        print(f"opd-store {args.command}: error: {message}", file=sys.stderr)
        return exit_code_for(exc) if not isinstance(exc, CliError) else exc.exit_code
    except KeyboardInterrupt:
        return 130


__all__ = ["main", "build_parser", "EXIT_USAGE"]
