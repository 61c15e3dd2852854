"""Options and exit codes shared by every ``opd-store`` command.

Exit codes (documented in docs/cli.md and ``opd-store --help``):

==  ==========================================
0   ok
1   an unexpected error (a bug: rerun with -v for the traceback)
2   usage error, or the store cannot be reached
3   not found (no such step, no complete checkpoint, no such local store directory)
4   incomplete or corrupt checkpoint
5   resume mismatch
6   commit conflict (the step already exists)
==  ==========================================
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from ..errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    IncompleteCheckpointError,
    IntegrityError,
    ManifestError,
    ResumeMismatchError,
)
from ..runtime import secs_problem

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_CORRUPT = 4
EXIT_RESUME_MISMATCH = 5
EXIT_CONFLICT = 6
EXIT_RANK_LOST = 7
"""``opd-store train --nproc N``: a rank gave up because another rank died or stopped answering."""


class CliError(Exception):
    """An error reported to the user as one line on stderr with a given exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code of an opd_store error."""
    if isinstance(exc, CliError):
        return exc.exit_code
    if isinstance(exc, CommitConflictError):
        return EXIT_CONFLICT
    if isinstance(exc, ResumeMismatchError):
        return EXIT_RESUME_MISMATCH
    if isinstance(exc, (IncompleteCheckpointError, IntegrityError, ManifestError)):
        return EXIT_CORRUPT
    if isinstance(exc, CheckpointNotFoundError):
        return EXIT_NOT_FOUND
    return EXIT_USAGE


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_storage_options(pairs: list[str] | None, s3_endpoint_url: str | None) -> dict[str, Any]:
    """Turn repeated ``KEY=VALUE`` options into fsspec ``storage_options``.

    Values are JSON when they parse as JSON (``true``, ``3``, ``{"a": 1}``), else strings. Dotted
    keys nest: ``client_kwargs.region_name=us-east-1`` gives ``{"client_kwargs": {"region_name": ...}}``.

    Raises:
        CliError: an option without ``=`` (exit 2).
    """
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--storage-option expects KEY=VALUE, got {pair!r}")
        target = options
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise CliError(f"--storage-option {key!r} nests under a non-mapping value")
        target[parts[-1]] = _parse_value(value)
    if s3_endpoint_url:
        options["endpoint_url"] = s3_endpoint_url
    return options


def _secs(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    problem = secs_problem(value, positive=positive)
    if problem is not None:  # the one rule of every *_secs option (opd_store.runtime.check_secs)
        raise argparse.ArgumentTypeError(problem.replace(repr(value), repr(text)))
    return value


def positive_secs(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (``nan``, ``inf``, 0 and below refused)."""
    return _secs(text, positive=True)


def nonnegative_secs(text: str) -> float:
    """argparse type: a finite number of seconds >= 0 (``nan``, ``inf`` and below 0 refused)."""
    return _secs(text, positive=False)


def port_arg(text: str) -> int:
    """argparse type: a TCP port, 0 (one the OS picks) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 (one the OS picks) to 65535, got {value}")
    return value


def file_in_existing_dir(text: str) -> str:
    """argparse type: a file to write whose directory exists (else the write fails after the work,
    naming a temporary file)."""
    if not Path(text).resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its directory does not exist")
    return text


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable), ``--s3-endpoint-url``, ``--connect-timeout-secs``
    and ``--allow-check-then-put``."""
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option for the store (repeatable; JSON values; dotted keys nest)",
    )
    parser.add_argument("--s3-endpoint-url", default=None, help="endpoint of an S3-compatible server")
    parser.add_argument(
        "--connect-timeout-secs", type=positive_secs, default=None, metavar="SECS",
        help="refuse a store that cannot be reached and used within SECS seconds, and give up on a "
        "connection after SECS (default 15; the storage option connect_timeout_secs)")
    parser.add_argument(
        "--allow-check-then-put", action="store_true",
        help="accept a URL whose backend has no create-only write (any fsspec protocol beyond local, "
        "memory://, s3://, gs://): commits are then an exists check and a put, and two writers of one "
        "step can both commit (docs/protocol.md)")


def store_options(args: argparse.Namespace, *, prefix: str = "") -> dict[str, Any]:
    """The storage options of a command's store (``prefix="dst_"``: ``cp``'s destination ones).

    Raises:
        CliError: a malformed ``--storage-option`` (exit 2).
    """
    options = parse_storage_options(getattr(args, f"{prefix}storage_option"), getattr(args, f"{prefix}s3_endpoint_url"))
    if getattr(args, "connect_timeout_secs", None) is not None:
        options.setdefault("connect_timeout_secs", args.connect_timeout_secs)
    return options


def open_store(url: str, args: argparse.Namespace, *, check: bool = True, write: bool = False,
               create: bool = False, options: dict[str, Any] | None = None):
    """The :class:`~opd_store.store._checkpoint_store.CheckpointStore` at ``url`` with the command's store options,
    checked before any work (:meth:`~opd_store.store._checkpoint_store.CheckpointStore.check_reachable`).

    Args:
        url (str): the store URL.
        args (argparse.Namespace): the command's arguments (store options).
        check (bool): check the store.
        write (bool): the command changes an existing store (``gc --yes``, ``pin``): prove reads,
            then writes.
        create (bool): the command saves into the store (``cp``'s destination): prove writes,
            creating a missing local root as a save would.
        options (dict | None): storage options to use instead of the command's own.

    Raises:
        CliError: a malformed ``--storage-option`` (exit 2).
        UnsupportedBackendError: a URL scheme opd_store cannot commit to (exit 2).
        StoreUnreachableError: the store cannot be used (exit 2), when ``check``.
        StoreNotFoundError: a local root that does not exist, for a read (exit 3).
    """
    from ..store import CheckpointStore

    store = CheckpointStore(url, storage_options=store_options(args) if options is None else options,
                            allow_check_then_put=getattr(args, "allow_check_then_put", False))
    if check:
        if not create:
            store.check_reachable(write=False)  # a missing local root is "not found" (exit 3)
        if write or create:
            store.check_reachable(write=True)
    return store


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """``--json``: one JSON document on stdout instead of the human-readable text."""
    parser.add_argument("--json", action="store_true", help="print JSON (machine-readable) on stdout")


def print_json(value: Any) -> None:
    """Print ``value`` as indented JSON on stdout."""
    print(json.dumps(value, indent=1, sort_keys=False, default=str))


class ProgressBar:
    """A tqdm bar on stderr with the progress protocol of copies (``set_size``,
    ``relative_update``; :class:`opd_store.store._copy.Progress`) and ``close``."""

    def __init__(self, desc: str, unit: str) -> None:
        from tqdm import tqdm

        kwargs: dict[str, Any] = {"desc": desc, "file": sys.stderr, "leave": False, "unit": unit}
        if unit == "B":
            kwargs.update(unit_scale=True, unit_divisor=1024)
        self._bar = tqdm(**kwargs)

    def set_size(self, size: int) -> None:
        self._bar.reset(total=size)

    def relative_update(self, inc: int = 1) -> None:
        self._bar.update(inc)

    def close(self) -> None:
        self._bar.close()


def progress_callback(desc: str, *, unit: str = "B") -> ProgressBar | None:
    """A progress bar on stderr when stderr is a terminal, else ``None`` (quiet in logs and pipes)."""
    return ProgressBar(desc, unit) if sys.stderr.isatty() else None


_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``30m``, ``1h``, ``1.5h`` or ``2d``.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse reports it, exit 2).
    """
    value = text.strip().lower()
    unit = value[-1:] if value[-1:] in _DURATION_UNITS and not value[-1:].isdigit() else ""
    number = value[: -len(unit)] if unit else value
    try:
        seconds = float(number) * _DURATION_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 30m, 1h, 2d)") from None
    if secs_problem(seconds) is not None:
        raise argparse.ArgumentTypeError(f"duration must be finite and >= 0: {text!r}")
    return seconds


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def step_arg(text: str) -> int:
    """argparse type: a step number (int >= 0)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"step must be >= 0, got {value}")
    return value



class _OwnRecords(logging.Filter):
    """Pass opd_store's own log records only (client libraries' retries and tracebacks stay out
    of a command's stderr unless ``--verbose``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name == "opd_store" or record.name.startswith("opd_store.")


def configure_logging(verbose: bool) -> None:
    """Log to stderr: opd_store's records at WARNING, or with ``verbose`` everything at INFO
    (client libraries' records and Python warnings included). A process whose logging is already
    configured (an application or a test runner calling :func:`~opd_store.cli.main`, a rank forked
    from the CLI process) keeps its own. Every rank of ``train --nproc N`` calls it too: a spawned
    rank is a fresh interpreter, and would otherwise print client libraries' warnings once per rank."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if not verbose:
        handler.addFilter(_OwnRecords())
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.captureWarnings(True)  # google-auth and others warn through `warnings`: filtered the same way


__all__ = [
    "configure_logging",
    "CliError",
    "EXIT_CONFLICT",
    "EXIT_CORRUPT",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_RESUME_MISMATCH",
    "EXIT_UNEXPECTED",
    "EXIT_USAGE",
    "add_json_option",
    "add_store_options",
    "open_store",
    "parse_duration",
    "positive_int",
    "positive_secs",
    "store_options",
    "print_json",
    "progress_callback",
    "step_arg",
    "exit_code_for",
    "file_in_existing_dir",
    "nonnegative_secs",
    "parse_storage_options",
    "port_arg",
]
