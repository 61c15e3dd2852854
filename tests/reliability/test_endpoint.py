"""A custom ``endpoint_url`` with explicit keys and no default AWS
credentials anywhere. Save, list, exists, load, delete and gc all reach that endpoint (counted at a
proxy in front of moto); nothing falls back to the default credential chain or to AWS.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from core.helpers import boto3_client
from opd_testkit import forkserver

CHILD = Path(__file__).with_name("endpoint_child.py")


def test_every_verb_uses_the_custom_endpoint_without_default_credentials(s3_proxy, moto_s3, tmp_path):
    backend, proxy = s3_proxy
    empty_config = tmp_path / "aws-config"
    empty_credentials = tmp_path / "aws-credentials"
    empty_config.write_text("")
    empty_credentials.write_text("")
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(empty_config), AWS_SHARED_CREDENTIALS_FILE=str(empty_credentials))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    args = {"url": backend.url, "endpoint_url": proxy.endpoint_url, "key": "endpoint-key", "secret": "endpoint-secret"}
    done = forkserver.run(
        [sys.executable, str(CHILD), json.dumps(args)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "aws_env": [],
        "steps": [1, 2],
        "is_complete": [True, True, False],
        "latest": 2,
        "read": "step two",
        "after_delete": [2],
        "gc_exit": 0,
        "after_gc": [3],
    }
    ops = proxy.ops()
    for op in ("PutObject", "ListObjectsV2", "HeadObject", "GetObject", "DeleteObjects"):
        assert op in ops, (op, ops)
    # Every request was signed with the explicit key (SigV4 "Credential=<key>/...").
    signed = [r.headers.get("authorization", "") for r in proxy.requests]
    assert signed and all("Credential=endpoint-key/" in auth for auth in signed), signed[:3]
    # And the bytes are where the endpoint keeps them.
    bucket, _, prefix = backend.url[len("s3://"):].partition("/")
    client = boto3_client(moto_s3)
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys[-1] == f"{prefix}/step-000003/manifest.json"
    assert not [k for k in keys if "/step-000001/" in k or "/step-000002/" in k]
