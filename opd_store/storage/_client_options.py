"""opd_store's own storage options: the timeouts every backend client is built with, and the key
layout of the store's saves.

These keys of ``storage_options`` belong to opd_store, not to fsspec; :func:`split_options` and
:func:`pop_layout` take them out before the rest reaches the filesystem (the transfer options
``part_size_bytes``, ``parts_in_flight``, ``throttle_timeout_secs`` and ``throttle_warn_share`` are
:class:`~opd_store.storage.transfers.TransferSettings`'):

=======================  =======  ===========================================================
``connect_timeout_secs``  15      How long opd_store waits to reach the store: the bound of the
                                  whole reachability check (``check_reachable``: credentials,
                                  listing, probe write), and the connect timeout of every request
                                  of a save or a load. CLI: ``--connect-timeout-secs``.
``read_timeout_secs``     60      How long a request of a save or a load waits for the server's
                                  next bytes before that attempt fails, and how long an upload
                                  waits for the connection to take the next 256 KiB of its body
                                  (:mod:`opd_store.storage.transfers._upload_bodies`). On a slow link it must
                                  also cover the drain of the socket buffers (several MiB) after
                                  a body is handed over: 60 s covers about 70 KiB/s.
``retries``               2       S3 only: passes of s3fs's own retry loop (``S3FileSystem.retries``,
                                  5 by default), which wraps botocore's.
``key_layout``            step    Where a save's payloads go (:mod:`opd_store.format._layout`):
                                  ``step`` (under ``step-NNNNNN/``) or ``spread`` (over
                                  ``key_prefixes`` fixed prefixes, so S3's per-prefix request
                                  rates add up). Anything else is refused naming it.
``key_prefixes``          16      ``spread`` only: how many prefixes (1 to 256).
=======================  =======  ===========================================================

Client libraries' defaults are not what a job on spot capacity needs: botocore waits 60 s to
connect and to read and retries inside s3fs's own retry loop, and gcsfs's requests have no timeout
at all. Each backend class applies the timeouts to its client
(:meth:`Storage.with_client_timeouts <opd_store.storage._base.Storage.with_client_timeouts>`: S3 in
:mod:`opd_store.storage.s3._client`, GCS in :mod:`opd_store.storage.gcs._storage`); an option the
caller set on the client wins over opd_store's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..format import KeyLayout

DEFAULT_CONNECT_TIMEOUT_SECS = 15.0
"""Default bound of the reachability check and connect timeout of every request (seconds)."""
DEFAULT_READ_TIMEOUT_SECS = 60.0
"""Default read timeout of every request of a save or a load (seconds): botocore's own default,
now applied to every backend."""


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


def pop_layout(options: dict[str, Any]) -> KeyLayout:
    """The key layout the storage options ``key_layout`` and ``key_prefixes`` ask for (the step
    layout by default), removed from ``options``.

    Raises:
        ValueError: an unknown layout (named), or a prefix count out of range.
    """
    return KeyLayout.named(options.pop("key_layout", "step"), options.pop("key_prefixes", None))


__all__ = [
    "ClientTimeouts",
    "DEFAULT_CONNECT_TIMEOUT_SECS",
    "DEFAULT_READ_TIMEOUT_SECS",
    "pop_layout",
    "split_options",
]
