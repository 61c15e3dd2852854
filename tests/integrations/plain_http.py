"""S3 clients for the loopback servers built without a TLS context.

Every S3 client aiobotocore builds loads the CA bundle into an SSL context before its first
request, whatever the endpoint's scheme: ~50 CPU-ms per client (docs/testing.md#on-every-core),
and a Lightning or Hugging Face test opens a store, hence a client, per checkpoint name and per
check. The servers here (moto, the proxies) speak plain ``http://``, so ``verify=False`` changes
no request; this folder's S3 fixtures get it from ``conftest.py``, the rest from :func:`plain_http`.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def plain_http_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (s3fs storage options) with ``client_kwargs["verify"] = False``."""
    return dict(options, client_kwargs=dict(options.get("client_kwargs") or {}, verify=False))


def plain_http(backend):
    """An S3 :class:`~opd_testkit.stores.Backend` whose clients skip the TLS context (others as given)."""
    if backend.name != "s3":
        return backend
    return dataclasses.replace(backend, storage_options=plain_http_options(backend.storage_options))


__all__ = ["plain_http", "plain_http_options"]
