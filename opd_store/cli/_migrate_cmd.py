"""``opd-store migrate SRC DST``: import legacy checkpoints into any store."""

from __future__ import annotations

import argparse

from ._common import add_store_options, open_store, progress_callback, store_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "migrate",
        help="copy legacy (COMPLETE-marker) checkpoints into a store as manifest-committed ones",
        description=(
            "Copies every step-NNNNNN directory with a COMPLETE marker under SRC (a local directory or a "
            "store URL, read with the same storage options) "
            "into the store DST, committing each with a manifest and verifying each copy. Steps "
            "already committed at DST with identical content are skipped; different content is a "
            "conflict (exit 6)."
        ),
    )
    parser.add_argument("src", help="local directory or store URL holding legacy step-NNNNNN/ checkpoints")
    parser.add_argument("dst", help="destination store URL (local path, s3://, gs://, ...)")
    parser.add_argument("--step", type=int, action="append", default=None, help="only this step (repeatable)")
    add_store_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..opd import migrate_legacy
    from ..storage import refuse_mistyped_url

    refuse_mistyped_url(args.src)  # else "s3:/bucket/run" is read as a local directory

    options = store_options(args)
    destination = open_store(args.dst, args, create=True, options=options)
    # A bucket source (a seed checkpoint copied into a bucket by another tool) is read
    # with the same options as the destination.
    source = open_store(args.src, args, options=options) if "://" in args.src else args.src
    callback = progress_callback("migrate", unit="step")
    if callback is None:
        result = migrate_legacy(source, destination, steps=args.step)
    else:
        result = _migrate_with_progress(source, destination, args.step, callback)
    for url in result:
        print(f"migrated {url}")
    for url in result.skipped:
        print(f"skipped {url} (already committed with identical content)")
    if not result and not result.skipped:
        print(f"no legacy checkpoints found under {args.src}")
    return 0


def _migrate_with_progress(source, destination, steps, callback):
    """One ``migrate_legacy`` call per step, advancing a progress bar (a terminal only)."""
    from ..opd import MigrationResult, migrate_legacy
    from ..store import LEGACY, LegacyReader, as_store

    source_store = as_store(source)
    if steps is None:
        steps = [info.step for info in LegacyReader(source_store).checkpoints() if info.status == LEGACY]
    result = MigrationResult()
    try:
        callback.set_size(len(steps))
        for step in sorted(set(steps)):
            done = migrate_legacy(source_store, destination, steps=[step])
            result.extend(done)
            result.skipped.extend(done.skipped)
            callback.relative_update(1)
    finally:
        callback.close()
    return result
