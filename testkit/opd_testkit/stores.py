"""Store locations for tests and benchmarks: a :class:`Backend` (URL and fsspec options that another
process can rebuild), :func:`open_store`, one aiobotocore session per process, and ``memory://``
reset. No server is started here (see :mod:`opd_testkit.s3` and :mod:`opd_testkit.gcs`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

# A CA bundle of one public root certificate (the first of certifi's bundle). Every endpoint the
# tests and benchmarks reach is plain HTTP on loopback, so no certificate is ever checked, but each
# botocore/aiobotocore client loads its CA bundle when it opens its connection pool: certifi's
# ~150 certificates cost 30 ms of CPU per client (every store has its own client), this one 0.5 ms.
LOOPBACK_CA_BUNDLE = str(Path(__file__).with_name("loopback-ca.pem"))

# Credentials and switches for the emulators on loopback. gcsfs probes the bucket type on its first
# call and stalls about two minutes against an emulator unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is
# false before gcsfs is imported (field notes); the AWS values keep botocore from looking for real
# credentials or the instance metadata service, and from parsing a full CA bundle for nothing (an
# HTTPS endpoint needs AWS_CA_BUNDLE set to a real bundle, which use_emulator_environment keeps).
EMULATOR_ENV = {
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CA_BUNDLE": LOOPBACK_CA_BUNDLE,
}


def use_emulator_environment() -> None:
    """Set :data:`EMULATOR_ENV` in ``os.environ`` where unset (call before gcsfs is imported)."""
    for key, value in EMULATOR_ENV.items():
        os.environ.setdefault(key, value)


@dataclasses.dataclass
class Backend:
    """One store location for a test.

    Attributes:
        name (str): ``local``, ``memory``, ``s3`` or ``gcs`` (the protocol's semantics).
        url (str): the store root URL.
        storage_options (dict): fsspec options the store must be given (may hold an aiobotocore
            ``session``, which :meth:`to_json` leaves out).
        server (str): which server answers an ``s3`` location: ``moto`` or ``seaweed``
            (SeaweedFS); empty for the other backends.
    """

    name: str
    url: str
    storage_options: dict[str, Any]
    server: str = ""

    @property
    def label(self) -> str:
        """``local``, ``memory``, ``s3`` (moto), ``seaweed`` or ``gcs``: the test parameter's name."""
        return "seaweed" if self.server == "seaweed" else self.name

    def raw_fs(self):
        """A fresh fsspec filesystem (own instance, no caches) for checking results independently."""
        import fsspec

        fs, _ = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **self.storage_options)
        return fs

    def raw_root(self) -> str:
        import fsspec

        _, root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **self.storage_options)
        return root.rstrip("/")

    def portable_options(self) -> dict[str, Any]:
        """The storage options without objects that live in this process (the shared session)."""
        return {k: v for k, v in self.storage_options.items() if k != "session"}

    def to_json(self) -> str:
        """JSON another process rebuilds the backend from (:meth:`from_json`)."""
        return json.dumps({"name": self.name, "url": self.url, "storage_options": self.portable_options(),
                           "server": self.server})

    @classmethod
    def from_json(cls, text: str) -> "Backend":
        return cls(**json.loads(text))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS chose it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_SESSION = None
_SESSION_LOCK = threading.Lock()


def aio_session():
    """This process's aiobotocore session, shared by every S3 store :func:`open_store` opens.

    Each ``CheckpointStore`` builds a private s3fs instance, hence a new S3 client; with a session of
    its own that client re-reads botocore's service model (0.5-2 s per store on a 2-core host). A
    shared session keeps the parsed model; each store still has its own client, connections and
    caches, and requests still go over HTTP.
    """
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is None:
            import aiobotocore.session

            _SESSION = aiobotocore.session.AioSession()
        return _SESSION


def with_session(backend: Backend) -> Backend:
    """``backend`` whose S3 stores share :func:`aio_session` (other backends unchanged)."""
    if backend.name != "s3":
        return backend
    return dataclasses.replace(backend, storage_options=dict(backend.storage_options, session=aio_session()))


def open_store(backend: Backend, *, fresh_session: bool = False, **kwargs: Any):
    """A :class:`~opd_store.CheckpointStore` on ``backend`` (a private fsspec instance).

    S3 stores share :func:`aio_session` unless ``fresh_session`` (then the options are passed as
    given). ``kwargs`` go to ``CheckpointStore``.
    """
    from opd_store import CheckpointStore

    options = dict(backend.storage_options)
    if backend.name == "s3" and not fresh_session:
        options["session"] = aio_session()
    return CheckpointStore(backend.url, storage_options=options, **kwargs)


def raw_put(backend: Backend, rel: str, data: bytes) -> None:
    """Write ``data`` at ``rel`` under the store root without opd_store (a fresh fsspec instance;
    local parent directories are created)."""
    fs = backend.raw_fs()
    path = f"{backend.raw_root()}/{rel}"
    if backend.name == "local":
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def clear_memory_fs() -> None:
    """Empty fsspec's process-global ``memory://`` filesystem."""
    from fsspec.implementations.memory import MemoryFileSystem

    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs.clear()
    MemoryFileSystem.pseudo_dirs.append("")


__all__ = ["EMULATOR_ENV", "LOOPBACK_CA_BUNDLE", "Backend", "aio_session", "clear_memory_fs", "free_port", "open_store", "raw_put",
           "use_emulator_environment", "with_session"]
