"""The S3 client of a store: opd_store's timeouts, retry policy and request signing, applied to the
s3fs options before the client is built (:func:`client_options`).

botocore waits 60 s to connect and to read; its retry handler (``legacy`` mode: 5 attempts) runs
inside s3fs's retry loop (5 passes), and s3fs wraps a download in that loop twice, so one GET to an
endpoint that accepts connections and never answers made 125 attempts of 60 s each; the CLI's
``latest`` was still waiting after 190 s. Each S3 client gets the store's ``connect_timeout_secs``
and ``read_timeout_secs`` and botocore's retry handler with 3 attempts in all (it retries
throttling, 5xx answers, dropped connections and timeouts, with exponential back-off) inside 2
passes of s3fs's loop (the second pass is what retries a body cut mid-response, which botocore
cannot see): a request that never gets an answer fails after at most 6 attempts (12 for a
download), each bounded by ``read_timeout_secs``. An option the caller set on the client
(``config_kwargs.connect_timeout``, ``read_timeout`` or ``retries``) wins over opd_store's, and so
do botocore's ``AWS_RETRY_MODE`` and ``AWS_MAX_ATTEMPTS`` environment variables.

Requests are also unsigned: ``config_kwargs.s3.payload_signing_enabled = False`` unless the caller set it:
requests carry ``UNSIGNED-PAYLOAD`` instead of the SHA-256 of their body. Over HTTPS that is what
botocore already does for uploads (its S3 signer skips body signing for streaming input that has a
checksum header: TLS and the checksum protect the body); over plain ``http://`` (a MinIO or
SeaweedFS endpoint) it would hash every payload byte, and with awscrt installed (opd_store's
CRC32C) its CRT signer reads the body through a Python callback 4 KiB at a time: about half the
client's CPU in a save (docs/performance.md). The body stays covered: every upload carries a
checksum header, signed like the other headers and checked by the server (a payload part its own
CRC32C, :mod:`opd_store.storage.s3._multipart`; any other body botocore's CRC32), and the manifest's
CRC32C is checked on every load. What plain HTTP cannot give either way is authenticity, since no
response body is signed.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from .._client_options import ClientTimeouts
from ._session import share_data

S3_RETRY_POLICY = {"mode": "legacy", "total_max_attempts": 3}
"""botocore's retry configuration of S3 stores unless the caller gives ``config_kwargs.retries``:
its default ``legacy`` mode (``standard`` and ``adaptive`` bind ``random.random`` at import, which
:mod:`opd_store.runtime._thread_random` cannot route away from the training thread), 3 attempts in all."""
DEFAULT_S3FS_RETRIES = 2
"""Passes of s3fs's retry loop around botocore's (the ``retries`` storage option)."""


def client_options(options: dict[str, Any], timeouts: ClientTimeouts
                   ) -> tuple[dict[str, Any], ClientTimeouts, Callable[[Any], None]]:
    """s3fs options with opd_store's timeouts, retry policy and unsigned payloads filled in.

    Args:
        options (dict): s3fs options (without opd_store's own keys).
        timeouts (ClientTimeouts): the timeouts to apply where the caller set none of the client's.

    Returns:
        tuple[dict, ClientTimeouts, Callable]: a copy of the options, the timeouts really in force
        (a client option the caller set wins and is reported here), and what to do to the client
        once it is built (set s3fs's ``retries``; share botocore's parsed data).

    Raises:
        ValueError: a ``retries`` option that is not an integer >= 1.
    """
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


__all__ = ["DEFAULT_S3FS_RETRIES", "S3_RETRY_POLICY", "client_options"]
