"""The kill-and-resume story end to end on moto S3 (``opd-store demo --s3-emulator``): the
emulator the command starts, training processes SIGKILLed (once inside a save), fresh working
directories, HOME and temp dirs for every start, bit-exact comparison.

The command's handler runs in this process with the real argument parser; its training processes
are forked from the worker's preloaded fork server (the same command lines and environments, not
a new interpreter's imports each)."""

from __future__ import annotations

import io

import pytest

from opd_store.cli import build_parser, main


@pytest.mark.timeout(1200)
def test_demo_on_s3_emulator_matches_reference_bit_for_bit(tmp_path, fork_server):
    workdir = tmp_path / "demo"
    args = build_parser().parse_args(["demo", "--s3-emulator", "--updates", "4", "--checkpoint-every", "2",
                                      "--kill-seed", "7", "--workdir", str(workdir)])
    report = io.StringIO()
    code = args.handler(args, popen=fork_server.popen, out=report)
    out = report.getvalue()
    assert code == 0, out
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
    # opd-store report of the spot store says where the demo killed it: two preemptions
    assert "report: matches where the demo killed the job" in out
    assert "opd-store report: 2 preemptions; start 1 reached step " in out


@pytest.mark.parametrize("argv, message", [
    (["--updates", "1"], "the demo needs --checkpoint-every >= 1 and --updates >= 2 x --checkpoint-every (got 1 and 2)"),
    (["--updates", "4", "--checkpoint-every", "0"],
     "the demo needs --checkpoint-every >= 1 and --updates >= 2 x --checkpoint-every (got 4 and 0)"),
    (["--s3-emulator", "--s3-endpoint-url", "http://127.0.0.1:9"],
     "--s3-emulator starts its own S3 endpoint; drop --s3-endpoint-url"),
])
def test_bad_demo_arguments_are_refused_in_one_line_leaving_nothing(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", *argv]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err.splitlines()) == ("", [f"opd-store demo: error: {message}"])
    assert list(tmp_path.iterdir()) == []  # no work directory, no store directory
