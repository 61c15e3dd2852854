"""``python -m opd_store`` as a real process against S3 (moto server): output, exit codes, and the
progress bar that appears only on a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

from cli_helpers import cli_store_args
from opd_testkit import forkserver

import opd_store
from opd_store import CheckpointStore

REPO_ROOT = Path(opd_store.__file__).resolve().parents[1]


def cli(*argv, stderr=subprocess.PIPE) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return forkserver.popen(
        [sys.executable, "-m", "opd_store", *map(str, argv)],
        stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=REPO_ROOT,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out.decode(), (err or b"").decode()


def test_cli_in_a_subprocess_on_s3(s3_backend, tmp_path):
    args = cli_store_args(s3_backend)
    store = CheckpointStore(s3_backend.url, storage_options=s3_backend.storage_options)
    for step in (4, 8):
        with store.begin(step, metadata={"successful_updates": step}) as txn:
            txn.write_bytes("model.bin", bytes([step]) * (3 << 20))

    code, out, err = finish(cli("ls", s3_backend.url, "--json", *args))
    assert code == 0, err
    assert [(row["step"], row["status"], row["successful_updates"]) for row in json.loads(out)["steps"]] == [
        (4, "complete", 4), (8, "complete", 8)
    ]
    code, out, err = finish(cli("latest", "s3://opd-test/empty", *args))
    assert (code, out) == (3, "") and "no complete checkpoint" in err

    # Not a terminal: the copy prints only the URL, no progress bar.
    code, out, err = finish(cli("cp", s3_backend.url, 4, tmp_path / "plain", *args))
    assert (code, out, err) == (0, f"{tmp_path / 'plain' / 'step-000004'}\n", "")

    # stderr on a terminal: a tqdm bar reaches it.
    master, slave = pty.openpty()
    # A terminal has a size (tqdm draws nothing on a 0-column one).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = cli("cp", s3_backend.url, 8, tmp_path / "tty", *args, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    code, out, _ = finish(proc)
    terminal = b"".join(chunks).decode(errors="replace")
    assert code == 0 and out == f"{tmp_path / 'tty' / 'step-000008'}\n"
    assert "cp step 8:" in terminal and "%|" in terminal and "3.00M" in terminal
    copied = CheckpointStore(tmp_path / "tty")
    assert copied.read(8, "model.bin") == bytes([8]) * (3 << 20)


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    # `opd-store ls DIR | head -0`: the pipe's reader is gone before the command writes.
    store = CheckpointStore(tmp_path / "store")
    for step in (1, 2, 3):
        with store.begin(step) as txn:
            txn.write_bytes("model.bin", bytes([step]) * 10)
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = forkserver.popen([sys.executable, "-m", "opd_store", "ls", str(tmp_path / "store")],
                            stdout=write_fd, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
    os.close(write_fd)
    _, err = proc.communicate(timeout=300)
    assert (proc.returncode, err.decode()) == (141, "")
    assert store.steps() == [1, 2, 3]
