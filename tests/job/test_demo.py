"""The kill-and-resume story end to end on moto S3: subprocesses, SIGKILL (once inside a save),
fresh working directories, HOME and temp dirs for every start, bit-exact comparison."""

from __future__ import annotations

import sys

import pytest

from opd_store.testing import forkserver


@pytest.mark.timeout(1200)
def test_demo_on_s3_emulator_matches_reference_bit_for_bit(tmp_path):
    workdir = tmp_path / "demo"
    result = forkserver.run(
        [sys.executable, "-m", "opd_store", "demo", "--s3-emulator", "--updates", "4", "--checkpoint-every", "2",
         "--kill-seed", "7", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]
    assert "store: s3://opd-demo/" in out
    assert "B of payloads written), step left uncommitted" in out
    assert "match: adapter weights, optimizer state and per-update loss log are bit-identical" in out
    assert "complete checkpoints in the spot store: [2, 4]" in out
    # three starts, each in its own fresh machine directory
    machines = sorted(p.name for p in workdir.iterdir() if p.name.startswith("machine-"))
    assert len(machines) == 4  # reference + three spot starts
    rows = [line for line in out.splitlines() if line.startswith("| start ") and not line.startswith("| start |")]
    assert len(rows) == 3
    assert "| start 2 | 2 |" in out or "| start 2 | 4 |" in out, out
