"""``opd-store report URL``: goodput, lost work, restart time, checkpoint overhead, cost and the
recommended interval of a run, from its journal and manifests (docs/ledger.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ._common import EXIT_OK, CliError, add_json_option, add_store_options, open_store, print_json


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="what the run's preemptions and checkpoints cost: goodput, lost updates, overhead, dollars",
        description="Read the store's run journal and manifests and report goodput, updates and seconds lost per "
        "preemption, restart time to the first update, checkpoint overhead, bytes and requests with an estimated "
        "cost, and a recommended checkpoint interval (Young/Daly). Events that cannot be read are skipped with a "
        "warning.")
    parser.add_argument("url", help="store URL")
    parser.add_argument("--prices", default=None, metavar="FILE",
                        help="price table (JSON or YAML: name, currency, storage_per_gib_month, requests_per_1000) "
                        "instead of the built-in S3 or GCS one")
    parser.add_argument("--html", default=None, metavar="FILE",
                        help="also write one self-contained HTML page with the run's timeline (the html extra)")
    add_json_option(parser)
    add_store_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..ledger import load_price_file, render_html, report_json, report_lines, report_store

    prices = load_price_file(args.prices) if args.prices is not None else None  # refused before any request
    if args.html is not None:
        import importlib.util

        if importlib.util.find_spec("plotly") is None:
            raise CliError("--html needs plotly: pip install 'opd_store[html]'")
        if not Path(args.html).resolve().parent.is_dir():
            raise CliError(f"--html {args.html}: its directory does not exist")
        if Path(args.html).is_dir():
            raise CliError(f"--html {args.html}: is a directory (name the page's file)")
    store = open_store(args.url, args)
    report = report_store(store, prices=prices)
    if args.html is not None:
        try:
            Path(args.html).write_text(render_html(report), encoding="utf-8")
        except OSError as exc:  # refused before any request where it can be (above); a race or permissions here
            raise CliError(f"--html {args.html}: {exc.strerror or exc}") from None
    if args.json:
        print_json(report_json(report))
    else:
        for line in report_lines(report):
            print(line)
        if args.html is not None:
            print(f"timeline: {args.html}")
    return EXIT_OK
