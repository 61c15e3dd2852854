"""SIGKILL of a process saving through a tiered store (local commit first, then the upload).

* killed after the local commit of step 2 and before its upload finished (the bucket manifest's
  PUT is held by a proxy, so the moment is certain and read from the stores): a new machine with
  an empty local tier resumes from the bucket's step 1; the old machine's local tier still offers
  step 2, never as durable, and uploads it on request;
* killed after both the local commit and the upload: a new machine resumes from step 2;
* the main job (``opd-store train --local-tier``), killed while its last upload is held: a new
  machine resumes from the bucket's newest durable step and replays the same updates bit for bit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opd_testkit import forkserver
from opd_testkit.proxies import through_proxy
from opd_testkit.stores import Backend
from proc_writer import payloads_for

from opd_store import CheckpointStore
from opd_store.cli import main
from opd_store.tiered import TieredStore
from opd_store.tiered._store import same_payloads

CHILD = str(Path(__file__).with_name("tier_child.py"))
REPO = str(Path(__file__).resolve().parents[2])


def poll_until(condition, what: str, timeout_secs: float = 180.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``condition()`` until true; fail after ``timeout_secs`` or when ``proc`` exits first."""
    deadline = time.monotonic() + timeout_secs
    tick = threading.Event()
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before: {what}\n{proc.stderr.read()}")
        if time.monotonic() > deadline:
            detail = ""
            if proc is not None:
                proc.kill()
                detail = proc.communicate()[1][-3000:]
            raise AssertionError(f"timed out waiting for: {what}\n{detail}")
        tick.wait(0.05)


def _manifest_put(step: int):
    suffix = f"/step-{step:06d}/manifest.json"
    return lambda command, path: command == "PUT" and path.split("?")[0].endswith(suffix)


def _through(bucket: Backend, proxy) -> Backend:
    return through_proxy(bucket, proxy)


def _spawn(local_dir: Path, backend: Backend, steps: str) -> subprocess.Popen:
    return forkserver.popen(
        [sys.executable, CHILD, str(local_dir), backend.to_json(), steps],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )


def _sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def _payload_objects(store: CheckpointStore, step: int) -> dict[str, int]:
    """name -> size of every payload object under any attempt of ``step`` (raw listing)."""
    listed = store.storage.list_tree(f"step-{step:06d}")
    return {path.split("/", 1)[1]: size for path, size in listed.items() if path.startswith("attempt-")}


def _upload_stuck_before_manifest(local: CheckpointStore, bucket: CheckpointStore, step: int, proxy) -> bool:
    """Local commit of ``step`` landed; in the bucket every payload landed with its size, the
    manifest did not, and its PUT is the request the proxy holds."""
    if not local.is_complete(step) or not proxy.held:
        return False
    expected = {entry.name: entry.size_bytes for entry in local.manifest(step).payloads}
    return _payload_objects(bucket, step) == expected and bucket.status(step) == "uncommitted"


def test_kill_after_local_commit_before_upload_resumes_from_bucket(bucket, hold_proxy, tmp_path):
    proxy = hold_proxy(_manifest_put(2))
    machine_a = tmp_path / "machine-a"
    remote = CheckpointStore(bucket.url, storage_options=bucket.storage_options)
    child = _spawn(machine_a, _through(bucket, proxy), "1,2")
    try:
        poll_until(lambda: remote.is_complete(1) and _upload_stuck_before_manifest(
            CheckpointStore(machine_a), remote, 2, proxy), "step 2 committed locally, its upload held", proc=child)
        _sigkill(child)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    proxy.drop()  # the held manifest PUT never reaches the bucket: its client is dead
    assert [held.split("?")[0] for held in proxy.held] == ["PUT /opd-test/runs/demo/step-000002/manifest.json"]

    # A new machine: empty local tier, only the bucket.
    fresh = TieredStore(tmp_path / "machine-b", bucket.url, storage_options=bucket.storage_options)
    assert fresh.latest_step() == 1
    assert fresh.durable_steps() == [1] and fresh.latest_durable_step() == 1
    assert not fresh.is_complete(2) and fresh.status(2) == "uncommitted"
    assert fresh.step_url(1) == f"{remote.url}/step-000001"
    for name, data in payloads_for("step1").items():
        assert fresh.read(1, name) == data

    # The old machine's local tier offers step 2, never as durable, and uploads it when asked.
    old = TieredStore(machine_a, bucket.url, storage_options=bucket.storage_options)
    assert old.latest_step() == 2 and old.local_steps() == [1, 2]
    assert not old.is_durable(2) and old.latest_durable_step() == 1 and old.durable_steps() == [1]
    assert old.tier_for(2) is old.local and old.step_url(2) == str(machine_a / "step-000002")
    assert old.upload_pending() == [2]
    assert old.wait_uploaded(2, timeout_secs=120) == f"{remote.url}/step-000002"
    old.close()
    assert old.durable_steps() == [1, 2]
    assert same_payloads(remote.manifest(2), old.local.manifest(2))
    assert remote.manifest(2).attempt_id != old.local.manifest(2).attempt_id
    assert fresh.latest_step() == 2
    for name, data in payloads_for("step2").items():
        assert remote.read(2, name) == data


def test_kill_after_local_commit_and_upload_resumes_from_newest(bucket, tmp_path):
    machine_a = tmp_path / "machine-a"
    remote = CheckpointStore(bucket.url, storage_options=bucket.storage_options)
    local = CheckpointStore(machine_a)
    child = _spawn(machine_a, bucket, "1,2")
    try:
        poll_until(lambda: local.is_complete(2) and remote.is_complete(2), "step 2 in both tiers", proc=child)
        _sigkill(child)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    fresh = TieredStore(tmp_path / "machine-b", bucket.url, storage_options=bucket.storage_options)
    assert fresh.latest_step() == 2 and fresh.latest_durable_step() == 2 and fresh.durable_steps() == [1, 2]
    assert fresh.tier_for(2) is fresh.bucket
    for name, data in payloads_for("step2").items():
        assert fresh.read(2, name) == data
    # On the old machine both copies are complete and match: the local one is read.
    old = TieredStore(machine_a, bucket.url, storage_options=bucket.storage_options)
    assert old.latest_step() == 2 and old.is_durable(2) and old.tier_for(2) is old.local
    assert old.upload_pending() == []


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(1800)  # two runs of the job, each building its models (minutes on a loaded host)
def test_job_killed_while_uploading_resumes_on_new_machine_bit_exact(bucket, hold_proxy, tmp_path):
    """``opd-store train --local-tier``: step 2 durable, step 4 committed locally with its upload
    held, SIGKILL; the job on a new machine resumes from the bucket's step 2 and replays updates
    3-4 with the same losses and learning rates, then makes step 4 durable."""
    proxy = hold_proxy(_manifest_put(4))
    via = _through(bucket, proxy)
    remote = CheckpointStore(bucket.url, storage_options=bucket.storage_options)
    machine_a = tmp_path / "machine-a"
    log_a = tmp_path / "log-a.jsonl"
    job = forkserver.popen(
        [sys.executable, "-m", "opd_store", "train", "--store", bucket.url, "--local-tier", str(machine_a),
         "--updates", "4", "--checkpoint-every", "2", "--log", str(log_a), "--events", str(tmp_path / "ev-a.jsonl"),
         "--s3-endpoint-url", via.storage_options["endpoint_url"],
         "--storage-option", "client_kwargs.region_name=us-east-1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        poll_until(lambda: remote.is_complete(2) and _upload_stuck_before_manifest(
            CheckpointStore(machine_a), remote, 4, proxy), "step 4 committed locally, its upload held",
            timeout_secs=900, proc=job)
        _sigkill(job)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    proxy.drop()
    assert remote.latest_step() == 2 and CheckpointStore(machine_a).latest_step() == 4

    machine_b = tmp_path / "machine-b"
    log_b = tmp_path / "log-b.jsonl"
    events_b = tmp_path / "ev-b.jsonl"
    assert main(["train", "--store", bucket.url, "--local-tier", str(machine_b), "--updates", "4",
                 "--checkpoint-every", "2", "--log", str(log_b), "--events", str(events_b),
                 "--s3-endpoint-url", bucket.storage_options["endpoint_url"],
                 "--storage-option", "client_kwargs.region_name=us-east-1"]) == 0
    events = _jsonl(events_b)
    assert events[0] == {"event": "resumed", "url": f"{remote.url}/step-000002", "step": 2}
    assert events[-1] == {"event": "flushed", "durable_step": 4}
    first = {record["attempted_update"]: record for record in _jsonl(log_a)}
    replayed = _jsonl(log_b)
    assert replayed and replayed[-1]["step"] == 4
    for record in replayed:
        assert record == first[record["attempted_update"]]
    assert remote.steps() == [2, 4] and CheckpointStore(machine_b).steps() == [4]  # B resumed from the bucket
    # Both machines computed the same step 4, bit for bit: every payload, the RNG states included
    # (upload retries draw from a private generator, not the training thread's `random`), except
    # PEFT's adapter_config.json, whose `target_modules` list follows the process's set order (hash
    # seed), so it is compared as JSON with that list as a set.
    def entries(store: CheckpointStore) -> dict:
        return {e.name: (e.size_bytes, e.crc32c) for e in store.manifest(4).payloads}

    def adapter_config(store: CheckpointStore) -> dict:
        config = json.loads(store.read(4, "adapter/adapter_config.json"))
        config["target_modules"] = sorted(config["target_modules"])
        return config

    machine_a_store = CheckpointStore(machine_a)
    on_bucket, on_a = entries(remote), entries(machine_a_store)
    assert on_bucket.keys() == on_a.keys() and "training_state.pt" in on_bucket and "rng.pt" in on_bucket
    for name in on_bucket.keys() - {"adapter/adapter_config.json"}:
        assert on_bucket[name] == on_a[name], name
    assert adapter_config(remote) == adapter_config(machine_a_store)
