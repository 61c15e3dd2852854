"""Helpers shared by the core store tests: opening stores, saving, and an independent raw view."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c

from opd_store import CheckpointStore

TESTS_DIR = Path(__file__).resolve().parents[1]
PROC_WRITER = TESTS_DIR / "proc_writer.py"
REPO_ROOT = TESTS_DIR.parent


def open_store(backend, **kwargs) -> CheckpointStore:
    """A store on ``backend`` with its storage options (a private fsspec instance)."""
    return CheckpointStore(backend.url, storage_options=backend.storage_options, **kwargs)


def save(store: CheckpointStore, step: int, payloads: dict[str, bytes], *, metadata=None, chunk: int | None = None):
    """Commit ``payloads`` as ``step``; return the committed transaction."""
    with store.begin(step, metadata=metadata) as txn:
        for name, data in payloads.items():
            if chunk is None:
                txn.write_bytes(name, data)
            else:
                with txn.open(name) as writer:
                    for offset in range(0, max(len(data), 1), chunk):
                        writer.write(memoryview(data)[offset:offset + chunk])
    return txn


def crc_hex(data: bytes) -> str:
    """CRC32C via the ``crc32c`` package directly (independent of opd_store.checksum)."""
    return f"{crc32c.crc32c(data):08x}"


class Raw:
    """The backend seen without opd_store: a fresh fsspec instance per call (no caches), and
    boto3 for S3. Keys are relative to the store root."""

    def __init__(self, backend, moto=None) -> None:
        self.backend = backend
        self.moto = moto

    def _fs(self):
        return self.backend.raw_fs(), self.backend.raw_root()

    def keys(self) -> dict[str, int]:
        """{relative key: size} of every object under the root (fresh listing)."""
        fs, root = self._fs()
        try:
            found = fs.find(root, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for full, info in found.items():
            if info.get("type") == "directory":
                continue
            full = fs._strip_protocol(full)
            assert full.startswith(root + "/"), (full, root)
            out[full[len(root) + 1:]] = int(info["size"])
        return out

    def s3_keys(self) -> dict[str, int]:
        """S3 only: {relative key: size} listed with boto3 (paginated)."""
        assert self.backend.name == "s3" and self.moto is not None
        bucket, _, prefix = self.backend.url[len("s3://"):].partition("/")
        client = self.moto.boto3_client()
        out = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(prefix) + 1:]] = obj["Size"]
        return out

    def s3_get(self, rel: str) -> bytes:
        bucket, _, prefix = self.backend.url[len("s3://"):].partition("/")
        return self.moto.boto3_client().get_object(Bucket=bucket, Key=f"{prefix}/{rel}")["Body"].read()

    def cat(self, rel: str) -> bytes:
        fs, root = self._fs()
        return fs.cat_file(f"{root}/{rel}")

    def put(self, rel: str, data: bytes) -> None:
        fs, root = self._fs()
        path = f"{root}/{rel}"
        if self.backend.name == "local":
            os.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)

    def rm(self, rel: str) -> None:
        fs, root = self._fs()
        fs.rm_file(f"{root}/{rel}")

    def exists(self, rel: str) -> bool:
        return rel in self.keys()


def run_proc(backend, *args: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``tests/proc_writer.py`` to completion; return its last stdout line parsed as JSON."""
    done = subprocess.run(
        [sys.executable, str(PROC_WRITER), backend.to_json(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO_ROOT),
    )
    assert done.returncode == 0, f"proc_writer {args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


class Proc:
    """A ``proc_writer.py`` child that talks line by line over pipes (a barrier, not sleeps)."""

    def __init__(self, backend, *args: str) -> None:
        self.args = args
        self.popen = subprocess.Popen(
            [sys.executable, str(PROC_WRITER), backend.to_json(), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(REPO_ROOT),
        )

    def expect(self, word: str) -> str:
        """Block until the child prints a line; assert it starts with ``word``; return it."""
        line = self.popen.stdout.readline()
        if not line.startswith(word):
            rest_out, rest_err = self.kill_and_collect()
            raise AssertionError(f"expected {word!r} from {self.args}, got {line!r}\n{rest_out}\n{rest_err}")
        return line.strip()

    def send(self, line: str) -> None:
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def result(self, timeout: float = 120) -> dict[str, Any]:
        out, err = self.popen.communicate(timeout=timeout)
        assert self.popen.returncode == 0, f"{self.args} exited {self.popen.returncode}:\n{out}\n{err}"
        return json.loads(out.strip().splitlines()[-1])

    def query(self, line: str) -> dict[str, Any]:
        self.send(line)
        reply = self.popen.stdout.readline()
        if not reply:
            _, err = self.kill_and_collect()
            raise AssertionError(f"{self.args} died:\n{err}")
        return json.loads(reply)

    def sigkill(self) -> int:
        self.popen.kill()
        self.popen.wait(timeout=60)
        return self.popen.returncode

    def kill_and_collect(self):
        if self.popen.poll() is None:
            self.popen.kill()
        return self.popen.communicate(timeout=60)
