"""``opd-store`` ls/latest/show/verify/pin/unpin/gc/cp in-process (``main(argv) -> int``) on local
disk and S3 (moto server): output, JSON and the documented exit codes."""

from __future__ import annotations

import json
import time

import pytest
from cli_helpers import cli_store_args
from fsspec.callbacks import Callback
from opd_testkit.aged_objects import backdate
from opd_testkit.stores import open_store, raw_put

from opd_store import CheckpointStore
from opd_store.cli import main
from opd_store.format import new_attempt_id
from opd_store.retention._gc import find_orphans
from opd_store.store import copy_checkpoint


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def commit(store: CheckpointStore, step: int, size: int = 64) -> None:
    metadata = {"successful_updates": step, "attempted_updates": step + 1, "query_update": step}
    with store.begin(step, metadata=metadata) as txn:
        txn.write_bytes("model.bin", bytes([step % 251]) * size)
        txn.write_bytes("config.yaml", f"lr: 0.1\nstep: {step}\n".encode())


def test_read_commands(backend, store_args, capsys):
    store = open_store(backend)
    for step in (1, 2, 3):
        commit(store, step)
    young = new_attempt_id(time.time() - 30)
    raw_put(backend, f"step-000004/{young}/model.bin", b"z" * 9)

    code, out, err = run(capsys, "ls", backend.url, *store_args)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["STEP", "STATUS", "CREATED_AT", "SIZE_BYTES", "SUCCESSFUL", "ATTEMPTED"]
    assert [line.split()[:2] for line in lines[1:]] == [["1", "complete"], ["2", "complete"], ["3", "complete"]]

    code, out, _ = run(capsys, "ls", backend.url, "--all", "--json", *store_args)
    rows = json.loads(out)["steps"]
    assert [(r["step"], r["status"]) for r in rows] == [(1, "complete"), (2, "complete"), (3, "complete"), (4, "uncommitted")]
    assert [(r["successful_updates"], r["attempted_updates"]) for r in rows[:3]] == [(1, 2), (2, 3), (3, 4)]
    assert rows[3]["uncommitted_attempts"][0]["attempt_id"] == young
    assert rows[3]["uncommitted_attempts"][0]["size_bytes"] == 9
    # Its age is the store's (written a moment ago); its id's time, 30 s ago, is only a hint.
    assert 0 <= rows[3]["uncommitted_attempts"][0]["age_secs"] < 20
    assert 20 <= rows[3]["uncommitted_attempts"][0]["writer_clock_age_secs"] < 3600
    assert rows[1]["total_size_bytes"] == store.checkpoints()[1].total_size_bytes

    assert run(capsys, "latest", backend.url, *store_args)[:2] == (0, "3\n")

    code, out, _ = run(capsys, "show", backend.url, 2, "--json", *store_args)
    shown = json.loads(out)
    assert code == 0 and shown["manifest"]["step"] == 2
    assert [p["name"] for p in shown["manifest"]["payloads"]] == ["model.bin", "config.yaml"]
    assert shown["config_yaml"] == "lr: 0.1\nstep: 2\n"
    code, out, _ = run(capsys, "show", backend.url, 2, *store_args)
    assert code == 0 and "config.yaml:\n  lr: 0.1\n  step: 2" in out and "successful_updates: 2" in out

    assert run(capsys, "verify", backend.url, "--deep", *store_args)[0] == 0
    # Same-size corruption of step 3: sizes pass, checksums fail and name the object.
    raw_put(backend, f"step-000003/{store.manifest(3).entry('model.bin').path}", b"\x00" * 64)
    assert run(capsys, "verify", backend.url, 3, *store_args)[0] == 0
    code, out, _ = run(capsys, "verify", backend.url, 3, "--deep", *store_args)
    assert code == 4 and "checksum: model.bin" in out and "step 3: BAD" in out
    # Truncated payload of step 2: a plain verify finds it; the JSON names the object.
    raw_put(backend, f"step-000002/{store.manifest(2).entry('model.bin').path}", b"short")
    code, out, _ = run(capsys, "verify", backend.url, "--json", *store_args)
    report = json.loads(out)
    assert code == 4 and report["ok"] is False
    bad = {s["step"]: s for s in report["steps"] if not s["ok"]}
    assert list(bad) == [2] and bad[2]["problems"][0]["name"] == "model.bin"
    assert bad[2]["problems"][0]["kind"] == "size"


def test_not_found_corrupt_and_usage_exit_codes(local_backend, tmp_path, capsys):
    url = local_backend.url
    assert run(capsys, "latest", url)[0] == 3
    assert run(capsys, "verify", url)[0] == 3
    store = open_store(local_backend)
    commit(store, 5)
    code, _, err = run(capsys, "show", url, 6)
    assert code == 3 and "step 6" in err
    assert run(capsys, "verify", url, 6)[0] == 3
    assert run(capsys, "pin", url, 6)[0] == 3
    raw_put(local_backend, "step-000005/manifest.json", b"{broken")
    code, _, err = run(capsys, "show", url, 5)
    assert code == 4 and "unreadable manifest" in err
    raw_put(local_backend, "step-000005/manifest.json", b'{"a": 1}')  # JSON, but not a manifest: one line
    line = (f"opd-store show: error: unreadable manifest at {url}/step-000005/manifest.json: not a manifest: "
            "step: Field required (and 5 more problems)\n")
    assert run(capsys, "show", url, 5) == (4, "", line)
    assert run(capsys, "verify", url)[0] == 4
    assert run(capsys, "gc", url, "--keep-last", "0")[0] == 2
    assert run(capsys, "gc", url, "--orphans-older-than", "soon")[0] == 2
    assert run(capsys, "ls", url, "--storage-option", "novalue")[0] == 2
    assert run(capsys, "show", url, "x")[0] == 2
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    code, _, err = run(capsys, "ls", str(not_a_dir / "store"))
    assert code == 2 and "not a directory" in err


def test_unreachable_bucket_is_exit_2(s3_backend, capsys):
    code, out, err = run(capsys, "ls", "s3://no-such-bucket/run", *cli_store_args(s3_backend))
    assert code == 2 and out == "" and "no-such-bucket" in err


def test_gc_dry_run_then_yes_and_pins(backend, store_args, capsys, request):
    store = open_store(backend)
    for step in (10, 20, 30, 40):
        commit(store, step, size=100 + step)
    old = new_attempt_id()
    raw_put(backend, f"step-000050/{old}/model.bin", b"o" * 77)
    # Written two hours ago by the store's clock (the grace is one hour).
    backdate(backend, f"step-000050/{old}", 7200, request.getfixturevalue("moto_s3") if backend.name == "s3" else None)
    sizes = {info.step: info.total_size_bytes for info in store.checkpoints()}

    assert run(capsys, "pin", backend.url, 10, *store_args)[:2] == (0, f"pinned: step 10 at {store.step_url(10)}\n")
    code, out, _ = run(capsys, "gc", backend.url, "--keep-last", 1, *store_args)
    assert code == 0
    assert f"would delete step 20 ({sizes[20]} bytes)" in out and f"would delete step 30 ({sizes[30]} bytes)" in out
    assert "keep step 10 (pinned)" in out and "keep step 40 (keep-last, newest-complete)" in out
    assert "would delete orphan" in out and "(77 bytes" in out
    assert f"would free {sizes[20] + sizes[30] + 77} bytes" in out
    assert store.steps() == [10, 20, 30, 40]

    code, out, _ = run(capsys, "gc", backend.url, "--keep-last", 1, "--yes", "--json", *store_args)
    report = json.loads(out)
    assert code == 0 and report["deleted_steps"] == [20, 30]
    assert report["freed_bytes"] == sizes[20] + sizes[30] + 77
    assert store.steps() == [10, 40]
    assert find_orphans(store, older_than_secs=0) == []

    assert run(capsys, "unpin", backend.url, 10, *store_args)[0] == 0
    code, _, err = run(capsys, "unpin", backend.url, 10, *store_args)
    assert code == 0 and "was not pinned" in err
    assert run(capsys, "gc", backend.url, "--keep-last", 1, "--yes", *store_args)[0] == 0
    assert store.steps() == [40]


@pytest.mark.parametrize("direction", ["local-to-s3", "s3-to-local"])
def test_cp_between_local_and_s3(direction, local_backend, s3_backend, capsys):
    src_backend, dst_backend = (local_backend, s3_backend) if direction == "local-to-s3" else (s3_backend, local_backend)
    src = open_store(src_backend)
    commit(src, 7, size=3000)
    commit(src, 8)
    args = cli_store_args(s3_backend)
    dst_args = [] if dst_backend.name == "local" else ["--dst-" + a[2:] if a.startswith("--") else a for a in args]
    code, out, err = run(capsys, "cp", src_backend.url, 7, dst_backend.url, *(args if src_backend.name == "s3" else []), *dst_args)
    dst = open_store(dst_backend)
    assert (code, out, err) == (0, f"{dst.step_url(7)}\n", "")
    assert dst.steps() == [7] and dst.verify(7, deep=True).ok
    source_manifest, copied = src.manifest(7), dst.manifest(7)
    assert [(e.name, e.size_bytes, e.crc32c) for e in copied.payloads] == [
        (e.name, e.size_bytes, e.crc32c) for e in source_manifest.payloads
    ]
    assert copied.metadata == source_manifest.metadata and copied.attempt_id != source_manifest.attempt_id
    assert dst.read(7, "model.bin") == bytes([7]) * 3000
    # Again: the destination step exists, a commit conflict.
    code, _, err = run(capsys, "cp", src_backend.url, 7, dst_backend.url, *(args if src_backend.name == "s3" else []), *dst_args)
    assert code == 6 and "already exists" in err


def test_cp_refuses_a_corrupt_source_and_commits_nothing(local_backend, tmp_path, capsys):
    src = open_store(local_backend)
    commit(src, 3)
    raw_put(local_backend, f"step-000003/{src.manifest(3).entry('model.bin').path}", b"\x01" * 64)
    dst_url = str(tmp_path / "dst")
    code, _, err = run(capsys, "cp", local_backend.url, 3, dst_url)
    assert code == 4 and "model.bin" in err and "does not match its manifest" in err
    dst = CheckpointStore(dst_url)
    assert dst.steps() == [] and dst.storage.list_tree("") == {}
    assert run(capsys, "cp", local_backend.url, 99, dst_url)[0] == 3


def test_copy_checkpoint_reports_progress_through_an_fsspec_callback(local_backend, tmp_path):
    src = open_store(local_backend)
    commit(src, 2, size=5000)

    class Recorder(Callback):
        def __init__(self):
            super().__init__()
            self.sizes, self.updates = [], []

        def set_size(self, size):
            self.sizes.append(size)

        def relative_update(self, inc=1):
            self.updates.append(inc)

    recorder = Recorder()
    url = copy_checkpoint(src, 2, CheckpointStore(tmp_path / "dst"), callback=recorder)
    assert url == str(tmp_path / "dst" / "step-000002")
    total = src.manifest(2).total_size_bytes
    assert recorder.sizes == [total] and sum(recorder.updates) == total == 5000 + len(b"lr: 0.1\nstep: 2\n")


def test_progress_stays_quiet_when_stderr_is_not_a_terminal(local_backend, tmp_path, capsys):
    src = open_store(local_backend)
    commit(src, 2, size=5000)
    code, out, err = run(capsys, "cp", local_backend.url, 2, tmp_path / "dst")
    assert code == 0 and err == ""
    code, out, err = run(capsys, "verify", tmp_path / "dst", "--deep")
    assert code == 0 and err == ""


def test_ls_of_a_url_without_a_bucket_says_so_exit_2(capsys):
    assert main(["ls", "s3://"]) == 2
    assert capsys.readouterr().err == (
        "opd-store ls: error: s3://: the URL names no bucket (expected s3://BUCKET or s3://BUCKET/PREFIX)\n")


def test_ls_of_a_root_whose_names_hold_the_steps_says_how_to_list_them(tmp_path, capsys):
    """A Lightning plugin's root holds a store per checkpoint name (``<root>/<name>/step-NNNNNN``):
    ``ls`` of the root names the commands that list them rather than saying there are none."""
    root = tmp_path / "root"
    for name in ("last.ckpt", "epoch=0-step=4.ckpt"):
        commit(CheckpointStore(root / name), 1)
    (root / "notes").mkdir()  # a folder without steps is no store
    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and out.splitlines() == [
        f"no checkpoints in {root} itself; the stores one level below hold them (a Lightning plugin's root: a store "
        "per checkpoint name), listed by:",
        f"  opd-store ls {root}/epoch=0-step=4.ckpt", f"  opd-store ls {root}/last.ckpt"]
    assert run(capsys, "ls", root / "notes")[:2] == (0, f"no checkpoints in {root / 'notes'}\n")


@pytest.mark.parametrize(("typo", "meant"), [("s3:/bkt/run", "s3://bkt/run"), ("s3:bkt/run", "s3://bkt/run"),
                                             ("gs:/bkt/run", "gs://bkt/run"), ("s3//bkt/run", "s3://bkt/run")])
def test_a_mistyped_bucket_url_is_a_usage_error_not_a_local_directory(tmp_path, monkeypatch, capsys, typo, meant):
    """Before, ``s3:/bkt/run`` was a relative directory named ``s3:``: train checkpointed onto the
    machine's disk and exited 0."""
    monkeypatch.chdir(tmp_path)

    def refusal(command, text, url):
        return (f"opd-store {command}: error: {text}: looks like a mistyped store URL, not a local path "
                f"(did you mean {url}?); write ./{text} for a local directory of that name\n")

    assert run(capsys, "train", "--store", typo, "--updates", 1, "--checkpoint-every", 1) == (
        2, "", refusal("train", typo, meant))
    assert run(capsys, "verify", f"{typo}/step-000001") == (
        2, "", refusal("verify", f"{typo}/step-000001", f"{meant}/step-000001"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("option", "value", "line"), [
    ("--metrics-port", "99999", "must be a port from 0 (one the OS picks) to 65535, got 99999"),
    ("--metrics-port", "-1", "must be a port from 0 (one the OS picks) to 65535, got -1"),
    ("--metrics-textfile", "{tmp}/no/m.prom", "{tmp}/no/m.prom: its directory does not exist"),
    ("--rank-timeout-secs", "nan", "must be a finite number of seconds > 0, got 'nan'"),
    ("--journal-progress-secs", "inf", "must be a finite number of seconds >= 0, got 'inf'"),
    ("--notice-poll-secs", "-1", "must be a finite number of seconds > 0, got '-1'"),
    ("--dist-timeout-secs", "0", "must be a finite number of seconds > 0, got '0'"),
    ("--connect-timeout-secs", "nan", "must be a finite number of seconds > 0, got 'nan'"),
])
def test_a_bad_metrics_or_seconds_option_is_a_usage_error_naming_it(tmp_path, capsys, option, value, line):
    """Before, --metrics-port 99999 exited 1 (an OverflowError from bind()), -1 named neither option
    nor value, a textfile in a missing directory named a temporary file, and NaN seconds passed."""
    value, line = value.format(tmp=tmp_path), line.format(tmp=tmp_path)
    code, out, err = run(capsys, "train", "--store", tmp_path / "store", "--updates", 1, option, value)
    assert (code, out, err.splitlines()[-1]) == (2, "", f"opd-store train: error: argument {option}: {line}")
    assert not (tmp_path / "store").exists()
