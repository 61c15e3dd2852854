"""``opd-store`` says when a save spent more than ``throttle_warn_share`` of its time throttled: a
real ``opd-store cp`` process writing to S3 (moto) through a proxy that answers its payload's
``PutObject`` with ``503 SlowDown`` once (the pacer's retries: tests/core/test_pacing.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from opd_testkit import forkserver
from opd_testkit.proxies import Rule

import opd_store
from opd_store import CheckpointStore

REPO_ROOT = Path(opd_store.__file__).resolve().parents[1]


def test_cp_warns_when_its_save_was_throttled(s3_fault_proxy, tmp_path):
    backend, proxy = s3_fault_proxy
    source = CheckpointStore(tmp_path / "src")
    with source.begin(4) as txn:
        txn.write_bytes("model.bin", b"weights" * 100)
    rule = proxy.add(Rule(ops=("PutObject",), match=lambda r: "/attempt-" in r.path, times=1))
    options = backend.storage_options
    args = ["cp", tmp_path / "src", 4, backend.url, "--dst-s3-endpoint-url", options["endpoint_url"],
            *(f"--dst-storage-option={o}" for o in (
                f"key={options['key']}", f"secret={options['secret']}", "client_kwargs.region_name=us-east-1",
                "throttle_warn_share=0.01", "retries=1", "config_kwargs.retries.total_max_attempts=1"))]
    proc = forkserver.popen([sys.executable, "-m", "opd_store", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), cwd=REPO_ROOT)
    out, err = (stream.decode() for stream in proc.communicate(timeout=300))
    assert proc.returncode == 0, err
    assert out == f"{backend.url}/step-000004\n" and rule.hits == 1
    warnings = [line for line in err.splitlines() if "throttled by the store" in line]
    assert len(warnings) == 1, err
    assert warnings[0].startswith(f"WARNING opd_store.commit: the save of step 4 at {backend.url}/step-000004 spent ")
    assert "(1 throttled answers, 1 retries; warning above 1%, storage option throttle_warn_share)" in warnings[0]
    assert CheckpointStore(backend.url, storage_options=options).read(4, "model.bin") == b"weights" * 100
