"""Options and exit codes shared by every ``opd-store`` command.

Exit codes (documented in docs/operations.md and ``opd-store --help``):

==  ==========================================
0   ok
2   usage error, or the store cannot be reached
3   not found (no such step, no complete checkpoint)
4   incomplete or corrupt checkpoint
5   resume mismatch
6   commit conflict (the step already exists)
==  ==========================================
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    IncompleteCheckpointError,
    IntegrityError,
    ManifestError,
    ResumeMismatchError,
)

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_CORRUPT = 4
EXIT_RESUME_MISMATCH = 5
EXIT_CONFLICT = 6


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


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) and ``--s3-endpoint-url``."""
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option for the store (repeatable; JSON values; dotted keys nest)",
    )
    parser.add_argument("--s3-endpoint-url", default=None, help="endpoint of an S3-compatible server")


__all__ = [
    "CliError",
    "EXIT_CONFLICT",
    "EXIT_CORRUPT",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_RESUME_MISMATCH",
    "EXIT_USAGE",
    "add_store_options",
    "exit_code_for",
    "parse_storage_options",
]
