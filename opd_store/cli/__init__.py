"""The ``opd-store`` command line (also ``python -m opd_store``).

Human output goes to stdout, diagnostics to stderr; exit codes are listed in
:mod:`opd_store.cli._common`. A failure is one line on stderr, ``opd-store COMMAND: error: <URL>:
cannot <operation>: <cause>``. Client libraries (botocore, s3fs, gcsfs, google-auth, ...) log
their retries and print warnings of their own; those, and tracebacks, appear only with
``-v``/``--verbose``. The Python API leaves logging to the application: only this entry point
configures it.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from ._common import EXIT_UNEXPECTED, EXIT_USAGE, CliError, configure_logging, exit_code_for

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away


def build_parser() -> argparse.ArgumentParser:
    from . import (
        _demo_cmd as demo_cmd,
    )
    from . import (
        _import_dcp_cmd as import_dcp_cmd,
    )
    from . import (
        _inspect_cmd as inspect_cmd,
    )
    from . import (
        _migrate_cmd as migrate_cmd,
    )
    from . import (
        _report_cmd as report_cmd,
    )
    from . import (
        _store_cmds as store_cmds,
    )
    from . import (
        _train_cmd as train_cmd,
    )

    parser = argparse.ArgumentParser(
        prog="opd-store",
        description="Crash-safe PyTorch checkpoints on any fsspec URL.",
        epilog="exit codes: 0 ok, 2 usage or unreachable store, 3 not found, 4 incomplete/corrupt, "
        "5 resume mismatch, 6 commit conflict, 7 (train --nproc) a rank gave up on a lost rank",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at INFO level on stderr, client libraries' logging and warnings included, "
                        "and print the traceback of a failure")
    subparsers = parser.add_subparsers(dest="command", required=True)
    train_cmd.add_parser(subparsers)
    demo_cmd.add_parser(subparsers)
    migrate_cmd.add_parser(subparsers)
    import_dcp_cmd.add_parser(subparsers)
    inspect_cmd.add_parsers(subparsers)
    store_cmds.add_parsers(subparsers)
    report_cmd.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``opd-store``; returns the process exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0); main returns, never exits
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    configure_logging(args.verbose)
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
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line per failure (module docstring)
        return _report(args, exc)


def _report(args: argparse.Namespace, exc: Exception) -> int:
    """Print one line for a failed command (and with ``--verbose`` its traceback first); return
    its exit code: the documented one for opd_store's errors and for backend failures, 1 for
    anything else (a bug)."""
    from ..errors import OpdStoreError
    from ..storage import describe, is_backend_failure

    if args.verbose:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, (CliError, OSError, ValueError)):
        # opd_store's own messages are complete as they are (a refused resume lists each
        # difference on a line of its own); a backend's is one line.
        message = str(exc).strip() or type(exc).__name__
        if not isinstance(exc, OpdStoreError) and not isinstance(exc, CliError):
            message = message.splitlines()[0]
        code = exit_code_for(exc)
    elif is_backend_failure(exc):
        message, code = describe(exc), EXIT_USAGE
    else:
        message = f"unexpected {describe(exc)} (rerun with -v for the traceback)"
        code = EXIT_UNEXPECTED
    print(f"opd-store {args.command}: error: {message}", file=sys.stderr)
    return code


__all__ = ["main", "build_parser", "EXIT_USAGE"]
