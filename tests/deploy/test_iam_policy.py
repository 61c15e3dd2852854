"""deploy/iam/s3-policy.json grants every S3 call the store makes for a run, and nothing else.

An end-to-end run on a moto S3 server (its own process, with moto's request recorder on):
``opd-store train`` saves steps 2 and 4; step 4 is deleted; a second ``opd-store train`` resumes
from step 2 and saves step 4 again; then one save with payloads large enough for multipart
uploads, and one aborted mid-payload. Every recorded request is mapped to the IAM checks AWS makes
for it (``s3_access.py``) and evaluated against the policy for the run's bucket and prefix
(``my-bucket``, ``runs/run-1``, as written in the policy). A new S3 call the policy forgot fails
here, as does an action the policy grants that no code path uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from opd_testkit import forkserver  # noqa: E402
from s3_access import Permission, is_allowed, policy_actions, required_permissions  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
POLICY = json.loads((REPO / "deploy/iam/s3-policy.json").read_text())
BUCKET = "my-bucket"
RUN_URL = f"s3://{BUCKET}/runs/run-1"

# Actions the policy grants for code paths this run does not reach, each with the reason.
GRANTED_FOR_OTHER_PATHS = {
    "s3:listbucketmultipartuploads": "opd-store gc finds multipart uploads left by killed writers",
}


def _post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30).read()


def _recorded_entries(text: str) -> list[dict]:
    """moto's recording, one JSON object per request. The recorder writes an entry and its newline
    separately, so requests served at once (parts in flight) can put two entries on one line."""
    decoder, entries, index = json.JSONDecoder(), [], 0
    while True:
        while index < len(text) and text[index].isspace():
            index += 1
        if index == len(text):
            return entries
        entry, index = decoder.raw_decode(text, index)
        entries.append(entry)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Run the scenario once; return (recorded request entries, events of the second train run)."""
    import boto3
    import torch

    from opd_store import CheckpointStore

    work = tmp_path_factory.mktemp("iam")
    env = dict(os.environ, MOTO_RECORDER_FILEPATH=str(work / "recording.jsonl"))
    log = open(work / "moto.log", "w")  # noqa: SIM115 - closed below
    # Port 0: the OS chooses; werkzeug names the port in its "Running on" line once it listens.
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    endpoint = None
    for line in server.stdout:
        log.write(line)
        if "Running on http://127.0.0.1:" in line:
            endpoint = "http://127.0.0.1:" + line.rsplit(":", 1)[1].strip().split()[0].rstrip("/")
            break
    drain = threading.Thread(target=lambda: [log.write(rest) for rest in server.stdout], daemon=True)
    drain.start()  # moto logs every request; an unread pipe would stall it
    try:
        if endpoint is None:
            raise RuntimeError(f"moto server did not start; log at {work / 'moto.log'}")
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        _post(f"{endpoint}/moto-api/recorder/reset-recording")
        _post(f"{endpoint}/moto-api/recorder/start-recording")

        def train(events: Path) -> None:
            errors = open(work / f"{events.stem}.stderr", "wb")  # noqa: SIM115 - closed by GC
            forkserver.run([sys.executable, "-m", "opd_store", "train", "--store", RUN_URL,
                            "--s3-endpoint-url", endpoint, "--updates", "4", "--checkpoint-every", "2",
                            "--log", str(work / "log.jsonl"), "--events", str(events)],
                           check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=errors)

        train(work / "events-1.jsonl")
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
                   "default_block_size": 5 * 2**20}
        store = CheckpointStore(RUN_URL, storage_options=options)
        assert store.steps() == [2, 4]
        store.delete(4)
        train(work / "events-2.jsonl")
        assert store.steps() == [2, 4]

        # Payloads above the 5 MiB block size go up as multipart uploads.
        tensor = torch.arange(3 * 2**20, dtype=torch.float32)  # 12 MiB
        with store.begin(step=5) as txn, txn.open("big.pt") as writer:
            torch.save(tensor, writer)
        assert torch.equal(torch.load(store.open(5, "big.pt"), weights_only=True), tensor)
        with pytest.raises(RuntimeError, match="injected"), store.begin(step=6) as txn:
            with txn.open("big.pt") as writer:
                writer.write(bytes(12 * 2**20))
                raise RuntimeError("injected failure mid-payload")
        assert store.steps() == [2, 4, 5]
        assert store.verify(5, deep=True).ok

        _post(f"{endpoint}/moto-api/recorder/stop-recording")
        text = urllib.request.urlopen(f"{endpoint}/moto-api/recorder/download-recording", timeout=60).read().decode()
        entries = _recorded_entries(text)
        events = [json.loads(line) for line in (work / "events-2.jsonl").read_text().splitlines()]
        return entries, events
    finally:
        server.terminate()
        server.wait(timeout=30)
        drain.join(30)
        log.close()


pytestmark = [
    pytest.mark.timeout(1200),  # two real training runs (~40 s each alone) on a shared CPU
    pytest.mark.xdist_group("iam-recording"),  # one worker builds the module's recording once
]


def _permissions(entries) -> list[tuple[dict, Permission]]:
    return [(entry, permission) for entry in entries for permission in required_permissions(entry)]


def test_the_run_saved_resumed_deleted_and_used_multipart(recorded):
    entries, events = recorded
    assert {"event": "resumed", "url": f"{RUN_URL}/step-000002", "step": 2} in events
    operations = Counter(permission.operation for _, permission in _permissions(entries))
    for operation in ("ListObjectsV2", "GetObject", "HeadObject", "PutObject", "DeleteObject", "DeleteObjects",
                      "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "AbortMultipartUpload"):
        assert operations[operation] >= 1, (operation, operations)
    # Two conditional manifest creates per train run... at least the four committed saves.
    puts = [e for e in entries if e["method"] == "PUT" and e["url"].endswith("/manifest.json")]
    assert len(puts) == 4
    assert all(e["headers"].get("If-None-Match") == "*" for e in puts)


def test_every_recorded_request_is_allowed_by_the_policy(recorded):
    entries, _ = recorded
    denied = [f"{p.operation} {entry['method']} {entry['url']} needs {p.action} on {p.resource} {dict(p.context)}"
              for entry, p in _permissions(entries) if not is_allowed(POLICY, p)]
    assert denied == []


def test_the_policy_grants_no_action_the_store_does_not_use(recorded):
    entries, _ = recorded
    used = {p.action.lower() for _, p in _permissions(entries)}
    assert not used & set(GRANTED_FOR_OTHER_PATHS), "now exercised: drop it from GRANTED_FOR_OTHER_PATHS"
    assert policy_actions(POLICY) == used | set(GRANTED_FOR_OTHER_PATHS)


def test_the_policy_denies_other_runs_and_the_rest_of_the_bucket(recorded):
    entries, _ = recorded
    checked = 0
    for _, permission in _permissions(entries):
        if permission.resource.startswith(f"arn:aws:s3:::{BUCKET}/runs/run-1/"):
            elsewhere = Permission(permission.operation, permission.action,
                                   permission.resource.replace("/runs/run-1/", "/runs/run-2/"), permission.context)
            assert not is_allowed(POLICY, elsewhere), elsewhere
            checked += 1
    assert checked > 20
    listing = Permission("ListObjectsV2", "s3:ListBucket", f"arn:aws:s3:::{BUCKET}",
                         (("s3:prefix", "runs/"), ("s3:delimiter", "/")))
    assert not is_allowed(POLICY, listing)
    head_bucket = Permission("HeadBucket", "s3:ListBucket", f"arn:aws:s3:::{BUCKET}")
    assert not is_allowed(POLICY, head_bucket)


def test_one_save_of_the_main_job_is_15_requests(recorded):
    """The request count of docs/operations.md ("Costs"): a save of the main job's 8 payloads."""
    entries, _ = recorded
    save: list[str] = []
    for entry in entries:
        permissions = required_permissions(entry)
        operation = permissions[0].operation if permissions else None
        if "step-000002" in entry["url"]:
            save.append(operation)
        if operation == "GetObject" and entry["url"].endswith("/step-000002/manifest.json"):
            break  # the read-back that ends the commit
    # begin: 2 HEAD + 2 LIST; 8 payload PUTs; 1 LIST of the attempt (stored sizes checked against
    # the bytes written, so a backend that acknowledged a short write is caught); the manifest PUT;
    # the read-back GET.
    assert Counter(save) == {"HeadObject": 2, "ListObjectsV2": 3, "PutObject": 9, "GetObject": 1}
