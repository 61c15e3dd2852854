"""Read commands: ``opd-store ls``, ``latest``, ``show`` and ``verify``."""

from __future__ import annotations

import argparse

from ._common import (
    EXIT_CORRUPT,
    EXIT_NOT_FOUND,
    EXIT_OK,
    CliError,
    add_json_option,
    add_store_options,
    open_store,
    print_json,
    progress_callback,
    step_arg,
)

_COUNTERS = ("successful_updates", "attempted_updates", "query_update")


def add_parsers(subparsers) -> None:
    """Register ``ls``, ``latest``, ``show`` and ``verify``."""
    ls = subparsers.add_parser(
        "ls", help="one row per step: status, created_at, size, trainer counters",
        description="List the checkpoints of a store (uncommitted steps and leftover attempts with --all).",
    )
    ls.add_argument("url", help="store URL (local path, s3://, gs://, memory://, ...)")
    ls.add_argument("--all", action="store_true", help="also show uncommitted steps and leftover attempts with their age")
    add_json_option(ls)
    add_store_options(ls)
    ls.set_defaults(handler=run_ls)

    latest = subparsers.add_parser(
        "latest", help="print the newest complete step number (exit 3 when there is none)",
        description="Print only the newest complete step (legacy steps count, as for resume).",
    )
    latest.add_argument("url", help="store URL")
    add_json_option(latest)
    add_store_options(latest)
    latest.set_defaults(handler=run_latest)

    show = subparsers.add_parser("show", help="print a step's manifest and the config it was saved with")
    show.add_argument("url", help="store URL")
    show.add_argument("step", type=step_arg, help="step number")
    add_json_option(show)
    add_store_options(show)
    show.set_defaults(handler=run_show)

    verify = subparsers.add_parser(
        "verify", help="check sizes (and with --deep checksums) of one or all steps",
        description="Check every object a manifest lists: size, and with --deep its CRC32C. "
        "Exit 4 when any step is bad, 3 when there is nothing to verify.",
    )
    verify.add_argument("url", help="store URL")
    verify.add_argument("step", type=step_arg, nargs="?", default=None, help="only this step")
    verify.add_argument("--deep", action="store_true", help="read every object and recompute its CRC32C")
    add_json_option(verify)
    add_store_options(verify)
    verify.set_defaults(handler=run_verify)


def _iso(value) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value is not None else None


def _stores_below(store) -> list[str]:
    """The names one level below ``store`` that hold step prefixes (a Lightning plugin's root: a store
    per checkpoint name, ``<root>/<name>/step-NNNNNN``): one listing of the root, one per name."""
    from ..format import parse_step_dirname

    prefixes, _objects = store.storage.list_children("")
    names = [p.rstrip("/") for p in prefixes if not p.startswith(".") and parse_step_dirname(p.rstrip("/")) is None]
    return [name for name in names
            if any(parse_step_dirname(p.rstrip("/")) is not None for p in store.storage.list_children(name)[0])]


def run_ls(args: argparse.Namespace) -> int:
    """``opd-store ls``: one row per step (exit 0; 2 when the store is unreachable)."""
    from ..retention import survey
    from ..store import UNCOMMITTED, LegacyReader, pinned_steps

    store = open_store(args.url, args)
    infos = [info for info in LegacyReader(store).checkpoints() if args.all or info.status != UNCOMMITTED]
    pinned = pinned_steps(store)
    leftovers: dict[int, list] = {}
    if args.all:
        found = survey(store, older_than_secs=0.0)  # every uncommitted attempt, aged on the store's clock
        for orphan in sorted(found.orphans + found.live, key=lambda o: (o.step, o.attempt_id)):
            leftovers.setdefault(orphan.step, []).append(orphan)
    rows = []
    for info in infos:
        metadata = info.metadata
        row = {
            "step": info.step,
            "status": info.status,
            "created_at": _iso(info.created_at),
            "total_size_bytes": info.total_size_bytes,
            "pinned": info.step in pinned,
            **{key: metadata.get(key) for key in _COUNTERS},
            "run_id": metadata.get("run_id"),
            "parent_step": metadata.get("parent_step"),
            "url": info.url,
            "problems": [f"{p.name}: {p.detail}" for p in info.problems],
        }
        if args.all:
            row["uncommitted_attempts"] = [
                {"attempt_id": o.attempt_id, "age_secs": round(o.age_secs, 1), "size_bytes": o.size_bytes,
                 "writer_clock_age_secs": None if o.writer_clock_age_secs is None else round(o.writer_clock_age_secs, 1)}
                for o in leftovers.get(info.step, [])
            ]
        rows.append(row)
    if args.json:
        print_json({"url": store.url, "steps": rows})
        return EXIT_OK
    if not rows:
        below = _stores_below(store)
        if below:
            root = store.url.rstrip("/")
            print(f"no checkpoints in {store.url} itself; the stores one level below hold them (a Lightning "
                  "plugin's root: a store per checkpoint name), listed by:")
            for name in below:
                print(f"  opd-store ls {root}/{name}")
        else:
            print(f"no checkpoints in {store.url}")
        return EXIT_OK
    header = f"{'STEP':>8}  {'STATUS':<11} {'CREATED_AT':<27} {'SIZE_BYTES':>12}  {'SUCCESSFUL':>10} {'ATTEMPTED':>9}  PIN"
    print(header)
    for row in rows:
        counters = [row["successful_updates"], row["attempted_updates"]]
        print(
            f"{row['step']:>8}  {row['status']:<11} {row['created_at'] or '-':<27} {row['total_size_bytes']:>12}  "
            f"{'-' if counters[0] is None else counters[0]:>10} {'-' if counters[1] is None else counters[1]:>9}  "
            f"{'pinned' if row['pinned'] else ''}".rstrip()
        )
        for attempt in row.get("uncommitted_attempts", []):
            print(f"{'':>8}  {attempt['attempt_id']} uncommitted, age {attempt['age_secs']:.0f} s, "
                  f"{attempt['size_bytes']} bytes")
    return EXIT_OK


def run_latest(args: argparse.Namespace) -> int:
    """``opd-store latest``: the newest complete or legacy step (exit 3 when none)."""
    from ..store import LegacyReader

    store = LegacyReader(open_store(args.url, args))
    step = store.latest_step()  # CheckpointNotFoundError: exit 3
    if args.json:
        print_json({"step": step, "url": store.step_url(step)})
    else:
        print(step)
    return EXIT_OK


def run_show(args: argparse.Namespace) -> int:
    """``opd-store show``: manifest and config.yaml of one step (exit 3 no manifest, 4 unreadable)."""
    import sys

    from ..errors import CheckpointNotFoundError, OpdStoreError
    from ..store import LEGACY, LegacyReader, pinned_steps

    plain = open_store(args.url, args)
    store = LegacyReader(plain)
    status = store.status(args.step)
    pinned = args.step in pinned_steps(plain)
    if status == LEGACY:
        names = store.names(args.step)
        if args.json:
            print_json({"url": store.step_url(args.step), "status": status, "pinned": pinned, "files": names})
        else:
            print(f"{store.step_url(args.step)}: legacy checkpoint (no manifest); files:")
            for name in names:
                print(f"  {name}")
        return EXIT_OK
    manifest = store.manifest(args.step)  # CheckpointNotFoundError 3, ManifestError 4
    code = EXIT_OK
    config_text = None
    if manifest.entry("config.yaml") is not None:
        try:
            config_text = store.read(args.step, "config.yaml", manifest=manifest).decode("utf-8", "replace")
        except (OpdStoreError, CheckpointNotFoundError) as exc:
            print(f"opd-store show: config.yaml unreadable: {exc}", file=sys.stderr)
            code = EXIT_CORRUPT
    if args.json:
        print_json({
            "url": store.step_url(args.step),
            "status": status,
            "pinned": pinned,
            "manifest": manifest.model_dump(mode="json"),
            "config_yaml": config_text,
        })
        return code
    print(f"{store.step_url(args.step)}  status: {status}{'  (pinned)' if pinned else ''}")
    print(f"created_at: {_iso(manifest.created_at)}  writer: {manifest.writer.host} pid {manifest.writer.pid} "
          f"rank {manifest.writer.rank}  world_size: {manifest.world_size}  attempt: {manifest.attempt_id}")
    print(f"payloads ({len(manifest.payloads)}, {manifest.total_size_bytes} bytes):")
    for entry in manifest.payloads:
        print(f"  {entry.name:<48} {entry.size_bytes:>12}  crc32c {entry.crc32c}")
    if manifest.metadata:
        print("metadata:")
        for key, value in manifest.metadata.items():
            print(f"  {key}: {value}")
    if config_text is not None:
        print("config.yaml:")
        for line in config_text.splitlines():
            print(f"  {line}")
    return code


def run_verify(args: argparse.Namespace) -> int:
    """``opd-store verify``: sizes or checksums of one or all steps (exit 4 when any is bad, 3 when none)."""
    from ..store import UNCOMMITTED, LegacyReader

    store = LegacyReader(open_store(args.url, args))
    if args.step is not None:
        if store.status(args.step) == UNCOMMITTED:
            raise CliError(f"no checkpoint at {store.step_url(args.step)}", EXIT_NOT_FOUND)
        steps = [args.step]
    else:
        steps = [info.step for info in store.checkpoints() if info.status != UNCOMMITTED]
        if not steps:
            raise CliError(f"no checkpoints to verify in {store.url}", EXIT_NOT_FOUND)
    callback = progress_callback("verify", unit="step") if args.deep else None
    reports = []
    try:
        if callback is not None:
            callback.set_size(len(steps))
        for step in steps:
            reports.append(store.verify(step, deep=args.deep))
            if callback is not None:
                callback.relative_update(1)
    finally:
        if callback is not None:
            callback.close()
    bad = [report for report in reports if not report.ok]
    if args.json:
        print_json({
            "url": store.url,
            "deep": args.deep,
            "ok": not bad,
            "steps": [
                {
                    "step": r.step, "url": r.url, "status": r.status, "ok": r.ok,
                    "checked_objects": r.checked_objects,
                    "problems": [{"name": p.name, "kind": p.kind, "detail": p.detail} for p in r.problems],
                }
                for r in reports
            ],
        })
    else:
        for r in reports:
            verdict = "ok" if r.ok else "BAD"
            print(f"step {r.step}: {verdict} ({r.status}, {r.checked_objects} objects, {'checksums' if r.deep else 'sizes'})")
            for p in r.problems:
                print(f"  {p.kind}: {p.name}: {p.detail}")
        print(f"{len(reports) - len(bad)} of {len(reports)} step(s) ok" + (f"; bad: {[r.step for r in bad]}" if bad else ""))
    return EXIT_CORRUPT if bad else EXIT_OK
