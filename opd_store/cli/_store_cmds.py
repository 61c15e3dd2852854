"""Write commands: ``opd-store cp``, ``pin``, ``unpin``, ``delete`` and ``gc``."""

from __future__ import annotations

import argparse
import sys

from ._common import (
    EXIT_OK,
    CliError,
    add_json_option,
    add_store_options,
    open_store,
    parse_duration,
    positive_int,
    print_json,
    progress_callback,
    step_arg,
    store_options,
)


def add_parsers(subparsers) -> None:
    """Register ``cp``, ``pin``, ``unpin``, ``delete`` and ``gc``."""
    cp = subparsers.add_parser(
        "cp", help="copy one committed checkpoint to another store, verified and committed there",
        description="Copy step STEP of SRC_URL into DST_URL payload by payload (size and CRC32C "
        "checked while streaming), commit it there with a manifest, then verify it deeply. The "
        "destination options default to the source's when both use the same protocol.",
    )
    cp.add_argument("src", metavar="SRC_URL", help="source store URL")
    cp.add_argument("step", type=step_arg, metavar="STEP", help="a complete step of SRC_URL")
    cp.add_argument("dst", metavar="DST_URL", help="destination store URL")
    add_store_options(cp)
    cp.add_argument("--dst-storage-option", action="append", default=None, metavar="KEY=VALUE",
                    help="fsspec option for the destination only (repeatable; the destination then "
                    "inherits none of the source's options)")
    cp.add_argument("--dst-s3-endpoint-url", default=None, help="S3 endpoint of the destination only")
    add_json_option(cp)
    cp.set_defaults(handler=run_cp)

    for name, helptext in (("pin", "never delete STEP by retention or gc"), ("unpin", "remove STEP's pin")):
        sub = subparsers.add_parser(name, help=helptext)
        sub.add_argument("url", help="store URL")
        sub.add_argument("step", type=step_arg, help="step number")
        if name == "pin":
            sub.add_argument("--reason", default="", help="free text kept with the pin")
        add_store_options(sub)
        sub.set_defaults(handler=run_pin if name == "pin" else run_unpin)

    delete = subparsers.add_parser(
        "delete", help="delete one damaged step (refused for a step that verifies deeply)",
        description="Delete step STEP of URL, manifest first, only when it is damaged: a payload missing, "
        "short or with another CRC32C than its manifest says, or an unreadable manifest. An intact step is "
        "refused (exit 6): retention (gc) is the way to delete good checkpoints.",
    )
    delete.add_argument("url", help="store URL")
    delete.add_argument("step", type=step_arg, help="the damaged step")
    add_store_options(delete)
    delete.set_defaults(handler=run_delete)

    gc = subparsers.add_parser(
        "gc", help="apply a retention policy and remove orphans (dry run unless --yes)",
        description="Plan retention (--keep-last/--keep-every; without either no step is deleted) "
        "and find orphan attempts and stale S3 multipart uploads that nothing has written to for longer than "
        "the grace period, measured on the store's own clock (never the writer's). "
        "Prints what it would delete and the bytes freed; deletes only with --yes. Never deleted: "
        "pinned steps, the newest complete step, a run's resume parent until the run has a second "
        "checkpoint, damaged or legacy steps, and objects outside the attempt layout.",
    )
    gc.add_argument("url", help="store URL")
    gc.add_argument("--keep-last", type=positive_int, default=None, metavar="N", help="keep the N newest complete steps")
    gc.add_argument("--keep-every", type=positive_int, default=None, metavar="K",
                    help="also keep complete steps that are multiples of K")
    gc.add_argument("--orphans-older-than", type=parse_duration, default=3600.0, metavar="DURATION",
                    help="grace period: an uncommitted attempt or multipart upload is collected only when nothing "
                    "has been written under it for this long by the store's clock (default 1h; 90s, 30m, 2d)")
    gc.add_argument("--deep", action="store_true",
                    help="recompute checksums of the newest complete steps so a corrupt one never counts as kept")
    gc.add_argument("--journal-keep", type=int, default=None, metavar="N",
                    help="keep the newest N run-journal events, deleting older starts whole (default 10000; "
                    "docs/ledger.md)")
    gc.add_argument("--yes", action="store_true", help="really delete (default: dry run)")
    gc.add_argument("--local-tier", default=None, metavar="DIR",
                    help="URL is the bucket of a tiered store whose local tier is DIR (opd-store train --local-tier): "
                    "collect both; the local tier keeps its newest two and every step not yet in the bucket")
    add_json_option(gc)
    add_store_options(gc)
    gc.set_defaults(handler=run_gc)


def _protocol(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def run_cp(args: argparse.Namespace) -> int:
    """``opd-store cp``: copy one step with :func:`opd_store.store._copy.copy_checkpoint` (exit 3/4/6 on errors)."""
    from ..errors import CheckpointNotFoundError, IncompleteCheckpointError
    from ..store import LEGACY, LegacyReader, copy_checkpoint

    src = open_store(args.src, args)
    if args.dst_storage_option is not None or args.dst_s3_endpoint_url:
        args.dst_storage_option = args.dst_storage_option or []
        dst_options = store_options(args, prefix="dst_")
    elif _protocol(args.src) == _protocol(args.dst):
        dst_options = store_options(args)
    else:
        dst_options = {} if args.connect_timeout_secs is None else {"connect_timeout_secs": args.connect_timeout_secs}
    dst = open_store(args.dst, args, create=True, options=dst_options)
    callback = progress_callback(f"cp step {args.step}")
    try:
        url = copy_checkpoint(src, args.step, dst, callback=callback)
    except CheckpointNotFoundError:
        if LegacyReader(src).status(args.step) == LEGACY:
            raise IncompleteCheckpointError(f"{src.step_url(args.step)} is a legacy checkpoint without a manifest; "
                                            "import it with `opd-store migrate` instead") from None
        raise
    finally:
        if callback is not None:
            callback.close()
    if args.json:
        print_json({"source": src.step_url(args.step), "destination": url, "step": args.step})
    else:
        print(url)
    return EXIT_OK


def run_pin(args: argparse.Namespace) -> int:
    """``opd-store pin``: pin a committed step (exit 3 when there is none)."""
    from ..store import pin

    store = open_store(args.url, args, write=True)
    created = pin(store, args.step, reason=args.reason)
    print(f"{'pinned' if created else 'already pinned'}: step {args.step} at {store.step_url(args.step)}")
    return EXIT_OK


def run_unpin(args: argparse.Namespace) -> int:
    """``opd-store unpin``: remove a pin (exit 0 also when there was none)."""
    from ..store import unpin

    store = open_store(args.url, args, write=True)
    if unpin(store, args.step):
        print(f"unpinned: step {args.step} at {store.step_url(args.step)}")
    else:
        print(f"step {args.step} was not pinned at {store.url}", file=sys.stderr)
    return EXIT_OK


def run_delete(args: argparse.Namespace) -> int:
    """``opd-store delete``: remove a damaged step (exit 3: nothing there; exit 6: the step is intact)."""
    from ..errors import CheckpointNotFoundError, CommitConflictError
    from ..store import UNCOMMITTED, LegacyReader

    store = open_store(args.url, args, write=True)
    report = LegacyReader(store).verify(args.step, deep=True)  # a legacy step verifies: never deleted
    if report.status == UNCOMMITTED:
        raise CheckpointNotFoundError(f"{store.step_url(args.step)}: step {args.step} is not committed")
    if report.ok:
        raise CommitConflictError(f"{store.step_url(args.step)}: step {args.step} verifies deeply; "
                                  "only a damaged step is deleted (use gc for retention)")
    store.delete(args.step)
    problems = "; ".join(p.detail for p in report.problems)
    print(f"deleted: step {args.step} at {store.step_url(args.step)} ({report.status}: {problems})")
    return EXIT_OK


def run_gc(args: argparse.Namespace) -> int:
    """``opd-store gc``: retention, orphans and stale uploads; a dry run unless ``--yes``. With
    ``--local-tier`` every tier of the tiered store is collected (the bucket first)."""
    from ..retention import RetentionPolicy, collect_garbage_tiers

    store = open_store(args.url, args, write=args.yes)
    if args.local_tier is not None:
        from ..tiered import TieredStore

        store = TieredStore(args.local_tier, store)
        store.local.check_reachable(write=False)
        if args.yes:
            store.local.check_reachable(write=True)
    from ..ledger import DEFAULT_KEEP_EVENTS

    if args.journal_keep is not None and args.journal_keep < 0:
        raise CliError(f"--journal-keep must be >= 0, got {args.journal_keep}")
    policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
    reports = collect_garbage_tiers(
        store, policy, orphans_older_than_secs=args.orphans_older_than, deep=args.deep, dry_run=not args.yes,
        journal_keep_events=DEFAULT_KEEP_EVENTS if args.journal_keep is None else args.journal_keep,
    )
    if args.json:
        documents = [_gc_json(report) for report in reports]
        if len(documents) > 1:
            documents[0]["local_tier"] = documents[1]
        print_json(documents[0])
        return EXIT_OK
    for index, report in enumerate(reports):
        if index:
            print(f"local tier {report.url}:")
        _print_gc(report)
    return EXIT_OK


def _gc_json(report) -> dict:
    plan = report.plan
    return {
        "url": report.url,
        "dry_run": report.dry_run,
        "policy": {"keep_last": report.policy.keep_last, "keep_every": report.policy.keep_every},
        "delete_steps": [{"step": s, "size_bytes": report.sizes.get(s, 0), "url": report.store.step_url(s)}
                         for s in plan.delete],
        "deleted_steps": report.deleted_steps,
        "keep_steps": {str(s): list(why) for s, why in plan.keep.items()},
        "untouched_steps": {str(s): status for s, status in plan.untouched.items()},
        "orphans": [{"url": o.url, "step": o.step, "attempt_id": o.attempt_id, "size_bytes": o.size_bytes,
                     "age_secs": round(o.age_secs, 1),
                     "writer_clock_age_secs": None if o.writer_clock_age_secs is None else round(o.writer_clock_age_secs, 1)}
                    for o in report.orphans],
        "stale_uploads": [{"key": u.rel, "upload_id": u.upload_id, "age_secs": round(u.age_secs, 1)}
                          for u in report.uploads],
        "journal_events": report.journal_events,
        "freed_bytes": report.freed_bytes,
    }


def _print_gc(report) -> None:
    plan = report.plan
    verb = "would delete" if report.dry_run else "deleted"
    for step in plan.delete:
        if report.dry_run or step in report.deleted_steps:
            print(f"{verb} step {step} ({report.sizes.get(step, 0)} bytes) {report.store.step_url(step)}")
    for step, why in plan.keep.items():
        print(f"keep step {step} ({', '.join(why)})")
    for step, status in plan.untouched.items():
        print(f"leave step {step} ({status}: retention deletes only complete steps)")
    for orphan in report.orphans:
        print(f"{verb} orphan {orphan.url} ({orphan.size_bytes} bytes, age {orphan.age_secs:.0f} s)")
    for upload in report.uploads:
        print(f"{'would abort' if report.dry_run else 'aborted'} multipart upload {upload.rel} "
              f"(upload id {upload.upload_id}, age {upload.age_secs:.0f} s)")
    if report.journal_events:
        print(f"{verb} {len(report.journal_events)} run-journal events ({report.journal_bytes} bytes) beyond the "
              f"journal's bound (oldest starts first)")
    if report.dry_run:
        print(f"would free {report.freed_bytes} bytes (dry run: pass --yes to delete)")
    else:
        print(f"freed {report.freed_bytes} bytes")
