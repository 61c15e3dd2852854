"""The choice of backend for a store URL: :func:`open_storage`.

A URL whose scheme has a create-only write (local paths and ``file://``, ``memory://``, ``s3://``
and ``s3a://``, ``gs://`` and ``gcs://``) gets its backend from :mod:`opd_store.storage._backends` or
:mod:`opd_store.storage._bucket`;
any other fsspec protocol only with ``allow_check_then_put=True`` (a commit that two writers can
both win); a scheme no fsspec filesystem implements is refused naming the URL and what is
supported (before, ``ftp://host/x`` reached a DNS lookup and reported only ``[Errno -2] Name or
service not known``); a local path that starts like a mistyped store URL (``s3:/bucket/run``,
``s3:bucket/run``, ``s3//bucket/run``) is refused naming the likely intended URL (before, it was a
relative directory named ``s3:`` on the machine's disk, and a spot instance's checkpoints never
reached the bucket).

:func:`open_storage` does no I/O: the client is built on first use (gcsfs looks for credentials
when it is built, which off-cloud takes tens of seconds), so the reachability check bounds it.
"""

from __future__ import annotations

import os
import re
from typing import Any

import fsspec

from ..errors import UnsupportedBackendError
from ._backends import CheckThenPutStorage, LocalStorage, MemoryStorage
from ._base import Storage
from ._client_options import pop_layout, split_options
from .gcs import GCSStorage
from .s3 import S3Storage
from .transfers import Transfers, TransferSettings

_BY_PROTOCOL: dict[str, type[Storage]] = {
    "file": LocalStorage,
    "local": LocalStorage,
    "memory": MemoryStorage,
    "s3": S3Storage,
    "s3a": S3Storage,
    "gs": GCSStorage,
    "gcs": GCSStorage,
}


SUPPORTED = ("local paths (or file://), memory://, s3:// (s3a://) and gs:// (gcs://) commit create-only; "
             "any other fsspec protocol only with allow_check_then_put=True (CLI: --allow-check-then-put), "
             "which lets two writers of one step both commit (docs/protocol.md)")
"""What :func:`open_storage` accepts, in the words of its refusal."""

_MISTYPED_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+)(?::/?(?!/)|//)(?P<rest>.*)$", re.DOTALL)
"""A scheme of two or more letters followed by ``:``, ``:/`` or ``//`` but not ``://`` (a Windows
drive ``C:`` has one letter)."""


def refuse_mistyped_url(text: str) -> None:
    """Refuse a local path (a ``text`` without ``://``) that starts with a known scheme (opd_store's
    or any fsspec protocol) and ``:`` (``s3:/b/r``, ``gs:b/r``, ``file:/x``) or ``//`` (``s3//b/r``):
    a store URL missing a ``/`` or the ``:``. Every entry point that makes a path absolute before
    opening it calls this first (``os.path.abspath("s3:/b")`` is a local path).

    Raises:
        UnsupportedBackendError: naming the path and the URL it most likely meant.
    """
    if "://" in text:
        return
    match = _MISTYPED_URL.match(text)
    if match is None:
        return
    scheme = match["scheme"]
    if scheme.lower() not in _BY_PROTOCOL and scheme.lower() not in fsspec.available_protocols():
        return
    rest = match["rest"].lstrip("/")
    meant = f"{scheme.lower()}://{rest}"
    if scheme.lower() in ("file", "local"):
        meant = os.path.abspath("/" + rest if text[len(scheme) + 1:].startswith("/") else rest)
    raise UnsupportedBackendError(
        f"{text}: looks like a mistyped store URL, not a local path (did you mean {meant}?); "
        f"write ./{text} for a local directory of that name")


def open_storage(
    url: str | os.PathLike,
    storage_options: dict[str, Any] | None = None,
    *,
    allow_check_then_put: bool = False,
) -> Storage:
    """Build the :class:`Storage` for a store URL (no I/O: the client is built on first use).

    Args:
        url (str | os.PathLike): a local path, ``file://``, ``memory://``, ``s3://``, ``gs://``, or
            with ``allow_check_then_put`` any fsspec URL naming the store root.
        storage_options (dict | None): keyword arguments for the fsspec filesystem (``endpoint_url``,
            ``key``, ``token``, ...), which reach every request the store makes, and opd_store's
            own ``connect_timeout_secs``, ``read_timeout_secs``, ``key_layout`` and ``key_prefixes``
            (:mod:`opd_store.storage._client_options`), ``part_size_bytes``, ``parts_in_flight``,
            ``throttle_timeout_secs`` and ``throttle_warn_share`` (parallel transfers,
            :class:`~opd_store.storage.transfers._parts.TransferSettings`).
        allow_check_then_put (bool): accept a non-atomic commit on backends without a create-only
            write (see module docstring).

    Raises:
        UnsupportedBackendError: a URL scheme no fsspec filesystem implements, or one without a
            create-only write and no ``allow_check_then_put`` (the message names the URL and what
            is supported), or a backend whose package is not installed, or a local path that
            starts like a mistyped URL (``s3:/bucket/run``, ``gs:bkt``, ``s3//bucket``).
        ValueError: the URL is empty or chained (``a::b``), an S3 or GCS URL names no bucket
            (``s3://``), a timeout option is not a positive
            number, a transfer setting is out of range, or ``key_layout`` names no layout.
    """
    text = os.fspath(url)
    if not text:
        raise ValueError("store URL is empty")
    if "::" in text:
        raise ValueError(f"chained fsspec URLs are not supported as stores: {text}")
    scheme = fsspec.core.split_protocol(text)[0]
    if scheme is None:
        refuse_mistyped_url(text)
        scheme = "file"
    try:
        fs_cls = fsspec.get_filesystem_class(scheme)
    except ImportError as exc:  # a known protocol whose package is missing (s3fs, gcsfs)
        raise UnsupportedBackendError(f"{text}: {exc}") from exc
    except ValueError:
        raise UnsupportedBackendError(f"{text}: unknown URL scheme {scheme!r}; {SUPPORTED}") from None
    protocols = (fs_cls.protocol,) if isinstance(fs_cls.protocol, str) else tuple(fs_cls.protocol)
    cls = _BY_PROTOCOL.get(protocols[0])
    if cls is None and not allow_check_then_put:
        raise UnsupportedBackendError(f"{text}: URL scheme {scheme!r} has no create-only write; {SUPPORTED}")
    options, timeouts = split_options(storage_options)
    transfers = TransferSettings.pop_from(options)  # opd_store's own options, never fsspec's
    layout = pop_layout(options)
    options, timeouts, configure = (cls or CheckThenPutStorage).with_client_timeouts(options, timeouts)
    # A private instance: fsspec returns one cached instance per argument set, and the store drops
    # that instance's listing caches before every decision.
    options.setdefault("skip_instance_cache", True)

    def build_client():
        fs = fsspec.core.url_to_fs(text, **options)[0]
        configure(fs)
        return fs

    root = fs_cls._strip_protocol(text).rstrip("/") or "/"  # noqa: SLF001 - what url_to_fs does
    if cls is not None and getattr(cls, "bucketed", False) and root.strip("/") == "":
        # Else the client fails at the first request with a validation error about an empty Bucket.
        raise ValueError(f"{text}: the URL names no bucket (expected {scheme}://BUCKET or {scheme}://BUCKET/PREFIX)")
    if cls is LocalStorage:
        root = os.path.abspath(root)
        storage: Storage = LocalStorage(build_client, root, root, timeouts=timeouts)
    else:
        unstripped = root if root.startswith(tuple(f"{p}://" for p in protocols)) else f"{protocols[0]}://{root}"
        url_root = _keep_scheme(text, protocols, unstripped)
        if cls is None:
            storage = CheckThenPutStorage(build_client, root, url_root, allow_check_then_put=True, timeouts=timeouts)
        else:
            storage = cls(build_client, root, url_root, timeouts=timeouts)
    storage.client_options = options
    storage.transfers = Transfers(transfers)
    storage.layout = layout
    return storage


def _keep_scheme(text: str, protocols: tuple[str, ...], url_root: str) -> str:
    """``url_root`` spelled with the scheme the caller wrote, when it is an alias of ``fs``.

    fsspec's ``unstrip_protocol`` spells every URL with the filesystem's first protocol, so a store
    opened as ``gcs://bucket/run`` (an alias of ``gs``) or ``s3a://bucket/run`` would hand back
    ``gs://``/``s3://`` URLs. Every URL the API returns keeps the caller's protocol: tools that
    match on the prefix, or configs that compare URLs, see what they gave.
    """
    scheme, sep, _rest = text.partition("://")
    current, sep2, tail = url_root.partition("://")
    if sep and sep2 and scheme != current and scheme in protocols:
        return f"{scheme}://{tail}"
    return url_root


__all__ = ["SUPPORTED", "open_storage", "refuse_mistyped_url"]
