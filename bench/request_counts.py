"""S3 requests of ``latest_step()`` and ``steps()``: a section of ``python -m bench`` (:func:`run_requests`).

Committed steps (10 objects and a manifest each) and the leftovers of killed and failed saves are
written straight into moto with boto3; the store's requests are counted by a botocore
``before-send.s3`` handler on its own client (every HTTP attempt, retries included) and cross-checked
at the moto server (:class:`opd_testkit.s3.MotoProcess`). Targets: ``latest_step()`` <= 5
requests at 1,000 steps; ``steps()`` no request per step.
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import secrets
import time
from typing import Any, Callable

from opd_testkit.s3 import MotoProcess, S3RequestCounter

from bench._common import log, timed

LATEST_TARGET_REQUESTS = 5


class FixtureWriter:
    """Writes committed steps (10 objects + a valid manifest) and leftovers straight into moto."""

    OBJECTS_PER_STEP = 10

    def __init__(self, moto: MotoProcess, bucket: str, prefix: str, workers: int = 16) -> None:
        self.client = moto.boto3_client(max_pool_connections=workers)
        self.bucket = bucket
        self.prefix = prefix
        self.pool = concurrent.futures.ThreadPoolExecutor(workers)
        self.leftover_objects = 0

    @staticmethod
    def attempt_id() -> str:
        from opd_store.format import new_attempt_id

        return new_attempt_id()

    def _put_many(self, items: list[tuple[str, bytes]]) -> None:
        futures = [self.pool.submit(self.client.put_object, Bucket=self.bucket, Key=key, Body=body) for key, body in items]
        for future in futures:
            future.result()

    def committed_step_objects(self, step: int) -> list[tuple[str, bytes]]:
        from opd_store.format import Manifest, PayloadEntry, Writer, crc32c_hex, step_dirname

        attempt = self.attempt_id()
        sdir = f"{self.prefix}/{step_dirname(step)}"
        items = []
        entries = []
        for i in range(self.OBJECTS_PER_STEP):
            name = f"rank-{i:02d}/shard.pt"
            body = secrets.token_bytes(64 + i)
            items.append((f"{sdir}/{attempt}/{name}", body))
            entries.append(PayloadEntry(name=name, path=f"{attempt}/{name}", size_bytes=len(body), crc32c=crc32c_hex(body)))
        manifest = Manifest(
            step=step,
            attempt_id=attempt,
            writer=Writer(host="bench", pid=1, rank=0),
            created_at=_dt.datetime.now(_dt.timezone.utc),
            world_size=self.OBJECTS_PER_STEP,
            payloads=tuple(entries),
            metadata={"fixture": True},
        )
        items.append((f"{sdir}/manifest.json", manifest.to_json_bytes()))
        return items

    def failed_attempt_objects(self, step: int, n_objects: int = 3) -> list[tuple[str, bytes]]:
        from opd_store.format import step_dirname

        attempt = self.attempt_id()
        sdir = f"{self.prefix}/{step_dirname(step)}"
        self.leftover_objects += n_objects
        return [(f"{sdir}/{attempt}/rank-{i:02d}/shard.pt", secrets.token_bytes(32)) for i in range(n_objects)]

    def write_steps(self, steps: list[int]) -> None:
        items: list[tuple[str, bytes]] = []
        for step in steps:
            items.extend(self.committed_step_objects(step))
        for start in range(0, len(items), 2000):
            self._put_many(items[start : start + 2000])

    def write_leftovers(self, steps: list[int]) -> None:
        items: list[tuple[str, bytes]] = []
        for step in steps:
            items.extend(self.failed_attempt_objects(step))
        self._put_many(items)

    def delete_prefix(self, rel: str) -> None:
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/{rel}"):
            keys.extend({"Key": o["Key"]} for o in page.get("Contents", []))
        if keys:
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

    def close(self) -> None:
        self.pool.shutdown()


def _count(moto: MotoProcess, counter: S3RequestCounter, fn: Callable[[], Any]) -> dict[str, Any]:
    moto.reset_requests()
    counter.reset()
    secs, value = timed(fn)
    server = moto.requests()
    return {
        "client": counter.total,
        "client_by_op": dict(counter.by_op),
        "server": server["total"],
        "server_by_kind": server["by_kind"],
        "secs": secs,
        "value": value,
    }


def run_requests(args, moto: MotoProcess) -> list[str]:
    from opd_store import CheckpointStore
    from opd_store.format import step_dirname

    bucket = "bench-requests"
    moto.new_bucket(bucket)
    prefix = "runs/demo"
    writer = FixtureWriter(moto, bucket, prefix)
    # Steps are 10, 20, 30, ... (step 0 is skipped: trainers rarely save it).
    targets = sorted(args.steps)
    written = 0
    rows = []
    try:
        for n_steps in targets:
            new = [10 * (k + 1) for k in range(written, n_steps)]
            log(f"requests: writing {len(new)} committed steps ({len(new) * 11} objects) into moto")
            started = time.perf_counter()
            writer.write_steps(new)
            # Leftovers: a killed save (an uncommitted step prefix) between committed steps, and a
            # failed attempt beside the committed one inside a committed step -- including the newest.
            lo = 10 * (written + 1)
            hi = 10 * n_steps
            uncommitted = sorted({lo + 5, (lo + hi) // 2 // 10 * 10 + 5, hi - 5})
            uncommitted = [s for s in uncommitted if s < hi]
            failed_in_committed = sorted({lo, hi})
            writer.write_leftovers(uncommitted + failed_in_committed)
            log(f"requests: fixtures for {n_steps} steps written in {time.perf_counter() - started:.1f}s")
            written = n_steps
            newest = 10 * n_steps

            store = CheckpointStore(f"s3://{bucket}/{prefix}", storage_options=moto.storage_options())
            counter = S3RequestCounter()
            counter.attach(store.storage.fs)
            row: dict[str, Any] = {"steps": n_steps, "objects": n_steps * 11 + writer.leftover_objects,
                                   "leftover_objects": writer.leftover_objects}
            row["latest_step"] = _count(moto, counter, store.latest_step)
            assert row["latest_step"]["value"] == newest, row["latest_step"]["value"]
            row["steps_call"] = _count(moto, counter, store.steps)
            assert len(row["steps_call"]["value"]) == n_steps
            row["is_complete"] = _count(moto, counter, lambda: store.is_complete(newest))
            if args.checkpoints_info:
                row["checkpoints"] = _count(moto, counter, store.checkpoints)
            # Informational: a killed save of a newer step sits above the newest complete one.
            killed = newest + 5
            writer.write_leftovers([killed])
            row["latest_behind_killed"] = _count(moto, counter, store.latest_step)
            assert row["latest_behind_killed"]["value"] == newest
            writer.delete_prefix(step_dirname(killed))
            writer.leftover_objects -= 3
            rows.append(row)
    finally:
        writer.close()

    def cell(res: dict, extra: str = "") -> str:
        flag = "" if res["client"] == res["server"] else f" (server saw {res['server']})"
        return f"{res['client']}{flag}{extra}"

    def ops(res: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(res["client_by_op"].items()))

    lines = [
        "Fixtures written straight into moto with boto3 (16 threads); manifests built with "
        "`opd_store.format._manifest.Manifest`. Each committed step: 10 payload objects + manifest.json. "
        "Leftovers: uncommitted step prefixes (3 objects of a killed save) between committed steps, "
        "and a failed attempt (3 objects) beside the committed one in the oldest and newest step of each batch. "
        "Requests counted by a botocore `before-send.s3` handler on the store's own s3fs client "
        "(every HTTP attempt, retries included) and cross-checked at the moto server.",
        "",
        "| committed steps | objects in store | latest_step() requests | target | steps() requests | "
        "is_complete(newest) | checkpoints() (info) | latest_step() behind a killed newer save (info) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        latest = row["latest_step"]
        target = ""
        if row["steps"] >= 1000:
            target = "PASS" if latest["client"] <= LATEST_TARGET_REQUESTS else "MISS"
            target += f" (<= {LATEST_TARGET_REQUESTS})"
        per_step = row["steps_call"]["client"] / row["steps"]
        chk = cell(row["checkpoints"]) if "checkpoints" in row else "not run"
        lines.append(
            f"| {row['steps']} | {row['objects']} | {cell(latest)} ({latest['secs']:.2f}s) | {target or '-'} | "
            f"{cell(row['steps_call'])} ({row['steps_call']['secs']:.2f}s; {per_step:.3f}/step) | "
            f"{cell(row['is_complete'])} | {chk} | {cell(row['latest_behind_killed'])} |"
        )
    lines.append("")
    last = rows[-1]
    lines.append(f"Breakdown at {last['steps']} steps:")
    lines.append(f"- latest_step(): {ops(last['latest_step'])}")
    lines.append(f"- steps(): {ops(last['steps_call'])} (pagination: {last['objects']} objects / 1000 per page)")
    lines.append(f"- is_complete(newest): {ops(last['is_complete'])}")
    if "checkpoints" in last:
        lines.append(f"- checkpoints(): {ops(last['checkpoints'])}")
    lines.append(f"- latest_step() behind a killed newer save: {ops(last['latest_behind_killed'])}")
    steps_ok = all(r["steps_call"]["client"] <= r["objects"] / 1000 + 3 for r in rows)
    lines.append("")
    lines.append(
        f"steps() target (no per-step request): {'PASS' if steps_ok else 'MISS'} -- requests grow with "
        "listing pages (1 per 1,000 objects), not with steps."
    )
    return lines


__all__ = ["LATEST_TARGET_REQUESTS", "FixtureWriter", "run_requests"]
