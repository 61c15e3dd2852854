"""opd_store's own storage options, and the timeouts every backend client is built with.

These keys of ``storage_options`` belong to opd_store, not to fsspec; :func:`split_options` takes
them out before the rest reaches the filesystem:

=======================  =======  ===========================================================
``connect_timeout_secs``  15      How long opd_store waits to reach the store: the bound of the
                                  whole reachability check (``check_reachable``: credentials,
                                  listing, probe write), and the connect timeout of every request
                                  of a save or a load. CLI: ``--connect-timeout-secs``.
``read_timeout_secs``     60      How long a request of a save or a load waits for the server's
                                  next bytes before that attempt fails, and how long an upload
                                  waits for the connection to take the next 256 KiB of its body
                                  (:mod:`opd_store.storage.upload_bodies`). On a slow link it must
                                  also cover the drain of the socket buffers (several MiB) after
                                  a body is handed over: 60 s covers about 70 KiB/s.
``retries``               2       S3 only: passes of s3fs's own retry loop (``S3FileSystem.retries``,
                                  5 by default), which wraps botocore's.
=======================  =======  ===========================================================

S3 clients also get ``config_kwargs.s3.payload_signing_enabled = False`` unless the caller set it:
requests carry ``UNSIGNED-PAYLOAD`` instead of the SHA-256 of their body. Over HTTPS that is what
botocore already does for uploads (its S3 signer skips body signing for streaming input that has a
checksum header: TLS and the checksum protect the body); over plain ``http://`` (a MinIO or
SeaweedFS endpoint) it would hash every payload byte, and with awscrt installed (opd_store's
CRC32C) its CRT signer reads the body through a Python callback 4 KiB at a time: about half the
client's CPU in a save (docs/performance.md). The body stays covered: every upload carries a
checksum header, signed like the other headers and checked by the server (a payload part its own
CRC32C, :mod:`opd_store.storage.s3_transfers`; any other body botocore's CRC32), and the manifest's
CRC32C is checked on every load. What plain HTTP cannot give either way is authenticity, since no
response body is signed.

Client libraries' defaults are not what a job on spot capacity needs. botocore waits 60 s to
connect and to read; its retry handler (``legacy`` mode: 5 attempts) runs inside s3fs's retry
loop (5 passes), and s3fs wraps a download in that loop twice, so one GET to an endpoint that
accepts connections and never answers made 125 attempts of 60 s each; gcsfs's requests have no
timeout at all. The CLI's ``latest`` was still waiting after 190 s. :func:`with_timeouts` gives
each client the timeouts above and, for S3, botocore's retry handler with 3 attempts in all (it
retries throttling, 5xx answers, dropped connections and timeouts, with exponential back-off)
inside 2 passes of s3fs's loop (the second pass is what retries a body cut
mid-response, which botocore cannot see): a request that never gets an answer fails after at most
6 attempts (12 for a download), each bounded by ``read_timeout_secs``. An option the caller set on
the client (``config_kwargs.connect_timeout``, ``read_timeout`` or ``retries`` for s3fs,
``requests_timeout`` for gcsfs) wins over opd_store's, and so do botocore's ``AWS_RETRY_MODE`` and
``AWS_MAX_ATTEMPTS`` environment variables.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

from .s3_session import share_data

DEFAULT_CONNECT_TIMEOUT_SECS = 15.0
"""Default bound of the reachability check and connect timeout of every request (seconds)."""
DEFAULT_READ_TIMEOUT_SECS = 60.0
"""Default read timeout of every request of a save or a load (seconds): botocore's own default,
now applied to every backend."""
S3_RETRY_POLICY = {"mode": "legacy", "total_max_attempts": 3}
"""botocore's retry configuration of S3 stores unless the caller gives ``config_kwargs.retries``:
its default ``legacy`` mode (``standard`` and ``adaptive`` bind ``random.random`` at import, which
:mod:`opd_store.thread_random` cannot route away from the training thread), 3 attempts in all."""
DEFAULT_S3FS_RETRIES = 2
"""Passes of s3fs's retry loop around botocore's (the ``retries`` storage option)."""


@dataclasses.dataclass(frozen=True)
class ClientTimeouts:
    """The timeouts a store's client uses.

    Attributes:
        connect_timeout_secs (float): bound of the reachability check; connect timeout of requests.
        read_timeout_secs (float): read timeout of the requests of saves and loads.
    """

    connect_timeout_secs: float = DEFAULT_CONNECT_TIMEOUT_SECS
    read_timeout_secs: float = DEFAULT_READ_TIMEOUT_SECS


def _seconds(key: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"storage option {key} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"storage option {key} must be > 0 seconds, got {value!r}")
    return seconds


def split_options(storage_options: dict[str, Any] | None) -> tuple[dict[str, Any], ClientTimeouts]:
    """Separate opd_store's timeouts from the filesystem's options.

    Args:
        storage_options (dict | None): the options a store was opened with.

    Returns:
        tuple[dict, ClientTimeouts]: a copy of the options without opd_store's timeout keys, and
        the timeouts they set (defaults for the keys not given).

    Raises:
        ValueError: a timeout that is not a positive number of seconds (the message names the key).
    """
    options = dict(storage_options or {})
    timeouts = ClientTimeouts(
        connect_timeout_secs=_seconds("connect_timeout_secs", options.pop("connect_timeout_secs",
                                                                          DEFAULT_CONNECT_TIMEOUT_SECS)),
        read_timeout_secs=_seconds("read_timeout_secs", options.pop("read_timeout_secs", DEFAULT_READ_TIMEOUT_SECS)),
    )
    return options, timeouts


def with_timeouts(protocol: str, options: dict[str, Any], timeouts: ClientTimeouts
                  ) -> tuple[dict[str, Any], ClientTimeouts, Callable[[Any], None]]:
    """The filesystem options of ``protocol`` with the timeouts (and for S3 the retry policy)
    filled in.

    Args:
        protocol (str): the fsspec protocol (``s3``, ``gs``, ...); others are returned unchanged.
        options (dict): filesystem options (without opd_store's timeout keys).
        timeouts (ClientTimeouts): the timeouts to apply where the caller set none of the client's.

    Returns:
        tuple[dict, ClientTimeouts, Callable]: the options (a copy where changed), the timeouts
        really in force (a client option the caller set wins and is reported here), and what to
        do to the client once it is built (set s3fs's ``retries``).

    Raises:
        ValueError: a ``retries`` option (S3) that is not an integer >= 1.
    """
    if protocol in ("s3", "s3a"):
        options = dict(options)
        passes = options.pop("retries", DEFAULT_S3FS_RETRIES)
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"storage option retries must be an integer >= 1, got {passes!r}")
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeouts.connect_timeout_secs)
        config.setdefault("read_timeout", timeouts.read_timeout_secs)
        config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
        if not any(os.environ.get(name) for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")):
            config.setdefault("retries", dict(S3_RETRY_POLICY))  # else botocore's environment settings apply
        options["config_kwargs"] = config

        def configure(fs: Any) -> None:
            fs.retries = passes  # s3fs reads its retry count from this attribute (not a constructor option)
            share_data(fs)  # botocore's parsed data: once per process, not once per store

        return options, ClientTimeouts(float(config["connect_timeout"]), float(config["read_timeout"])), configure
    if protocol in ("gs", "gcs") and "requests_timeout" not in options:
        import aiohttp

        options = dict(options)
        # gcsfs hands requests_timeout to aiohttp as each request's timeout: a connect bound and a
        # bound on the wait for the next bytes, never on a whole (large) transfer.
        options["requests_timeout"] = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.connect_timeout_secs, sock_read=timeouts.read_timeout_secs)
    return options, timeouts, _unchanged


def _unchanged(fs: Any) -> None:
    """Nothing to set on the client once built."""


__all__ = [
    "ClientTimeouts",
    "DEFAULT_CONNECT_TIMEOUT_SECS",
    "DEFAULT_READ_TIMEOUT_SECS",
    "DEFAULT_S3FS_RETRIES",
    "S3_RETRY_POLICY",
    "split_options",
    "with_timeouts",
]
