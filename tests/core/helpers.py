"""Helpers shared by the core store tests: opening stores, saving, and an independent raw view."""

from __future__ import annotations

import json
import os
from typing import Any

import crc32c
from opd_testkit.stores import open_store  # noqa: F401 - the tests import it from here

from opd_store import CheckpointStore
from opd_store.testing import RawBackend


def boto3_client(moto):
    """The moto server's boto3 client (one per server: moto's reset between tests keeps the endpoint)."""
    return moto.boto3_client()


def save(store: CheckpointStore, step: int, payloads: dict[str, bytes], *, metadata=None, chunk: int | None = None):
    """Commit ``payloads`` as ``step``; return the committed transaction."""
    with store.begin(step, metadata=metadata) as txn:
        for name, data in payloads.items():
            if chunk is None:
                txn.write_bytes(name, data)
            else:
                with txn.open(name) as writer:
                    for offset in range(0, len(data), chunk):
                        writer.write(memoryview(data)[offset:offset + chunk])
    return txn


def crc_hex(data: bytes) -> str:
    """CRC32C via the ``crc32c`` package directly (independent of opd_store.format._checksum)."""
    return f"{crc32c.crc32c(data):08x}"


class Raw(RawBackend):
    """The backend seen without opd_store. Keys are relative to the store root.

    S3 is read and written with boto3 (no s3fs at all); the other backends with one private fsspec
    instance whose caches are dropped before every call, so each call sees the backend as it is now.
    The multipart hooks of :class:`~opd_store.testing.RawBackend` are S3's.
    """

    def __init__(self, backend, moto=None) -> None:
        self.backend = backend
        self.moto = moto
        self._raw_fs = None
        if backend.name == "s3":
            assert moto is not None, "S3 raw checks need the moto server"
            self.bucket, _, self.prefix = backend.url[len("s3://"):].partition("/")

    def _fs(self):
        if self._raw_fs is None:
            self._raw_fs = self.backend.raw_fs()
        self._raw_fs.invalidate_cache()
        return self._raw_fs, self.backend.raw_root()

    @property
    def client(self):
        return boto3_client(self.moto)

    def keys(self) -> dict[str, int]:
        """{relative key: size} of every object under the root (fresh listing)."""
        if self.backend.name == "s3":
            return self.s3_keys()
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
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(self.prefix) + 1:]] = obj["Size"]
        return out

    def cat(self, rel: str) -> bytes:
        if self.backend.name == "s3":
            return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{rel}")["Body"].read()
        fs, root = self._fs()
        return fs.cat_file(f"{root}/{rel}")

    def put(self, rel: str, data: bytes) -> None:
        if self.backend.name == "s3":
            self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{rel}", Body=data)
            return
        fs, root = self._fs()
        path = f"{root}/{rel}"
        if self.backend.name == "local":
            os.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)

    def rm(self, rel: str) -> None:
        if self.backend.name == "s3":
            self.client.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{rel}")
            return
        fs, root = self._fs()
        fs.rm_file(f"{root}/{rel}")

    def _s3_key(self, rel: str) -> str:
        if self.backend.name != "s3":
            raise NotImplementedError(f"{self.backend.name} has no multipart uploads")
        return f"{self.prefix}/{rel}"

    def start_upload(self, rel: str) -> str:
        return self.client.create_multipart_upload(Bucket=self.bucket, Key=self._s3_key(rel))["UploadId"]

    def upload_part(self, rel: str, upload_id: str, part_number: int, data: bytes) -> None:
        self.client.upload_part(Bucket=self.bucket, Key=self._s3_key(rel), UploadId=upload_id,
                                PartNumber=part_number, Body=data)

    def abort_upload(self, rel: str, upload_id: str) -> None:
        self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._s3_key(rel), UploadId=upload_id)

    def start_upload_outside_root(self) -> str:
        self._s3_key("")
        self.client.create_multipart_upload(Bucket=self.bucket, Key="elsewhere/big.bin")
        return "elsewhere/big.bin"

    def unfinished_uploads(self) -> list[str]:
        self._s3_key("")
        return [upload["Key"] for upload in self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])]

    def fsspec_keys(self) -> dict[str, int]:
        """Like :meth:`keys` but always through a fresh fsspec instance (for S3: s3fs)."""
        fs = self.backend.raw_fs()
        root = self.backend.raw_root()
        out = {}
        for full, info in fs.find(root, detail=True).items():
            if info.get("type") != "directory":
                out[fs._strip_protocol(full)[len(root) + 1:]] = int(info["size"])
        return out


def run_proc(backend, *args: str, timeout: float = 120) -> dict[str, Any]:
    """Run a ``tests/proc_writer.py`` command in a separate process to completion; return its result."""
    return Proc(backend, *args).result(timeout=timeout)


class Proc:
    """A ``proc_writer`` child process (forked from a preloaded forkserver), talking over a pipe.

    Messages are the synchronisation (a barrier, not sleeps): :meth:`expect` blocks until the
    child reports a point in its work, :meth:`send` releases it.
    """

    def __init__(self, backend, *args: str) -> None:
        import proc_writer

        self.args = args
        self.process, self.conn = proc_writer.start(backend.to_json(), *args)

    def _recv(self, timeout: float) -> str:
        if not self.conn.poll(timeout):
            self.kill()
            raise AssertionError(f"proc_writer {self.args}: no message within {timeout} s")
        try:
            message = self.conn.recv()
        except EOFError:
            self.process.join(30)
            raise AssertionError(f"proc_writer {self.args} exited ({self.process.exitcode}) without a message")
        if message.startswith('{"child_error"'):
            raise AssertionError(f"proc_writer {self.args} failed:\n{json.loads(message)['child_error']}")
        return message

    def expect(self, word: str, timeout: float = 120) -> str:
        """Block until the child sends a message; assert it is ``word``."""
        message = self._recv(timeout)
        assert message == word, (self.args, message)
        return message

    def send(self, line: str) -> None:
        self.conn.send(line)

    def query(self, line: str, timeout: float = 120) -> dict[str, Any]:
        self.send(line)
        return json.loads(self._recv(timeout))

    def result(self, timeout: float = 120) -> dict[str, Any]:
        """The child's final JSON message; the child must then exit with status 0."""
        message = json.loads(self._recv(timeout))
        self.process.join(timeout)
        assert self.process.exitcode == 0, (self.args, self.process.exitcode)
        return message

    def sigkill(self) -> int:
        """SIGKILL the child; return its exit code (``-SIGKILL``)."""
        self.process.kill()
        self.process.join(60)
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(60)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()
