"""What the run journal costs a save: requests and seconds per save with and without it, side by side.

``python -m bench.ledger_cost`` saves a state of ``--sizes`` MiB (8 payloads, one manifest: the
commit protocol of every save) to moto S3 behind the per-connection-capped proxy that models a real
object store (:mod:`opd_testkit.throttle`, ``--cap-mib`` MiB/s per connection, as AWS gives one
connection roughly 50-100 MB/s), alternating saves without the journal and saves that journal
themselves as the main job does (:class:`opd_store.job._ledger.JobLedger`: the request count read
before and after, one ``save`` event queued after the commit for the journal's writer thread). Requests are counted at the moto
server (every request that reached it) and on the store's client (botocore's ``before-send``), and
agree. Printed: per size, the median seconds of each, the extra seconds as a share of the save, the
requests of each and the difference. Targets (the goodput ledger's): at most one extra request per
save, and under 2% of a save's time; the fixed cost of one event (one small PUT) is printed too, so
the size where a save passes 2% can be read off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from pathlib import Path

from bench._common import MIB, REPO_ROOT, log, machine_description

EXTRA_REQUESTS_TARGET = 1
SHARE_TARGET = 0.02
PAYLOADS = 8


def _save(store, step: int, payload: bytes) -> None:
    with store.begin(step, metadata={"successful_updates": step}) as txn:
        for index in range(PAYLOADS):
            with txn.open(f"part-{index}.bin") as writer:
                writer.write(payload)


def measure(size_mib: int, *, repeats: int, cap_mib: float) -> dict:
    """One size: ``repeats`` saves without and with the journal, alternating."""
    from opd_testkit.s3 import MotoProcess, S3RequestCounter
    from opd_testkit.throttle import CappedProxyProcess

    from opd_store import CheckpointStore
    from opd_store.job._ledger import JobLedger

    moto = MotoProcess()
    proxy = CappedProxyProcess(moto.endpoint_url, cap_bytes_per_sec=cap_mib * MIB)
    try:
        moto.new_bucket("bench")
        options = dict(moto.storage_options(), endpoint_url=proxy.endpoint_url)
        store = CheckpointStore("s3://bench/ledger", storage_options=options)
        store.check_reachable()
        counter = S3RequestCounter()
        counter.attach(store.storage.fs)
        ledger = JobLedger(store, group=None, updates=10**6, checkpoint_every=1, progress_every_secs=60.0)
        ledger.start(None)
        payload = bytes(size_mib * MIB // PAYLOADS)
        rows = {"without": [], "with": []}
        journal_shares = []
        step = 0
        for repeat in range(repeats):
            for mode in (("without", "with") if repeat % 2 == 0 else ("with", "without")):
                step += 1
                moto.reset_requests()
                counter.reset()
                started = time.perf_counter()
                mark = ledger.mark()
                _save(store, step, payload)
                if mode == "with":
                    committed = time.perf_counter()
                    record = {"seconds": committed - started, "size_bytes": size_mib * MIB}
                    ledger.saved(step, record, mark=mark, blocking_secs=record["seconds"], attempted_updates=step)
                    journal_shares.append((time.perf_counter() - committed) / (committed - started))
                seconds = time.perf_counter() - started  # what training waits for
                ledger.journal.flush()  # the save event's request, written meanwhile, belongs to this save
                rows[mode].append((seconds, moto.requests()["total"], counter.total))
                store.delete(step)  # the next save starts from the same store
        event_secs = []
        for index in range(repeats):
            began = time.perf_counter()
            ledger.journal.record("progress", step=index, attempted_updates=index, update_secs=0.0)
            event_secs.append(time.perf_counter() - began)
    finally:
        proxy.stop()
        moto.stop()
    without = statistics.median(r[0] for r in rows["without"])
    with_journal = statistics.median(r[0] for r in rows["with"])
    requests = {mode: sorted({r[1] for r in rows[mode]}) for mode in rows}
    client = {mode: sorted({r[2] for r in rows[mode]}) for mode in rows}
    return {"size_mib": size_mib, "without_secs": without, "with_secs": with_journal,
            "side_by_side": (with_journal - without) / without, "share": statistics.median(journal_shares),
            "event_secs": statistics.median(event_secs),
            "requests_without": requests["without"], "requests_with": requests["with"],
            "client_without": client["without"], "client_with": client["with"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ledger_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="save sizes in MiB, comma-separated (default 64,256)")
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind per size (default 5)")
    parser.add_argument("--cap-mib", type=float, default=64.0, help="MiB/s per connection of the store model")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"),
                        help="where ledger-cost-<date>.md goes (default bench/results)")
    args = parser.parse_args(argv)
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        log(f"{size} MiB: {args.repeats} saves without and with the journal")
        results.append(measure(size, repeats=args.repeats, cap_mib=args.cap_mib))
    text, failed = _render(results, args)
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ledger-cost-{time.strftime('%Y-%m-%d', time.gmtime())}.md"
    machine = "; ".join(f"{key}: {value}" for key, value in machine_description())
    command = " ".join(sys.argv[1:] if argv is None else argv)
    path.write_text(f"# The run journal's cost\n\n`python -m bench.ledger_cost {command}`\n\n{machine}\n{text}\n",
                    encoding="utf-8")
    log(f"written to {path}")
    return 0 if not failed else 1


def _render(results: list[dict], args) -> tuple[str, list[str]]:
    """The report's markdown, and the targets missed."""
    lines = [f"\n## The run journal's cost per save (moto S3 behind a {args.cap_mib:g} MiB/s-per-connection cap, "
             f"medians of {args.repeats})\n",
             "| save | without journal | with journal | side by side | the journal's own share | requests without | "
             "requests with | extra |",
             "|---|---|---|---|---|---|---|---|"]
    failed = []
    for r in results:
        extra = [w - o for w in r["requests_with"] for o in r["requests_without"]]
        lines.append(f"| {r['size_mib']} MiB | {r['without_secs']:.3f} s | {r['with_secs']:.3f} s | "
                     f"{r['side_by_side']:+.2%} | {r['share']:.2%} | {r['requests_without']} | {r['requests_with']} | "
                     f"{sorted(set(extra))} |")
        if max(extra) > EXTRA_REQUESTS_TARGET:
            failed.append(f"{r['size_mib']} MiB: {max(extra)} extra requests")
        if r["share"] >= SHARE_TARGET:
            failed.append(f"{r['size_mib']} MiB: {r['share']:.2%} of a save's time")
        if r["requests_with"] != r["client_with"] or r["requests_without"] != r["client_without"]:
            failed.append(f"{r['size_mib']} MiB: the server counted {r['requests_with']}, the client {r['client_with']}")
    event = statistics.median(r["event_secs"] for r in results)
    lines.append("\n*side by side*: median seconds of the saves with the journal over those without, minus 1 (the "
                 "order alternates; on a shared machine the difference between two saves is mostly noise); *the "
                 "journal's own share*: the seconds of the journaling after each commit over that save's seconds, "
                 "median (what the target is held against).")
    lines.append(f"\none journal event written alone (what the writer thread spends on a save's event; the save "
                 f"does not wait for it): {event * 1000:.1f} ms")
    lines.append("targets: at most 1 extra request per save, under 2% of a save's time: "
                 + ("met" if not failed else "MISSED: " + "; ".join(failed)))
    return "\n".join(lines), failed

if __name__ == "__main__":
    sys.exit(main())
