"""A new botocore session for every S3 store, with botocore's parsed data shared per process.

botocore reads its data files (the S3 service model, endpoint rules, partitions: JSON of about a
megabyte) through a session's data loader, which keeps what it parsed for that session only.
s3fs builds a new aiobotocore session per filesystem, and opd_store builds a new filesystem per
store (a private instance: the store drops its listing caches before every decision), so every
store parsed that JSON again: 60-140 ms of CPU per store, and per process that touches S3 (a
rank, a CLI command), several times what its first request costs.

:func:`new_session` still builds one session per store, so credentials, profiles and
configuration are resolved per store exactly as s3fs would resolve them; only the data loader is
shared, one per ``AWS_DATA_PATH`` value. botocore itself shares one loader between every client of a
session, so its parsed data is already read by many clients at once and never written to by them.
"""

from __future__ import annotations

import threading
from typing import Any

_LOADERS: dict[str | None, Any] = {}  # AWS_DATA_PATH value -> botocore.loaders.Loader
_LOCK = threading.Lock()


def new_session(session_kwargs: dict[str, Any]) -> Any:
    """An ``aiobotocore.session.AioSession(**session_kwargs)`` whose data loader is this process's
    one for its ``AWS_DATA_PATH``.

    Args:
        session_kwargs (dict): what s3fs would pass to the session it builds itself (its
            filesystem's ``kwargs``: ``profile``, ``session_vars``...).

    Returns:
        aiobotocore.session.AioSession: a new session (credentials not yet resolved).
    """
    import aiobotocore.session
    import botocore.loaders

    session = aiobotocore.session.AioSession(**session_kwargs)
    data_path = session.get_config_variable("data_path")
    with _LOCK:
        loader = _LOADERS.get(data_path)
        if loader is None:
            loader = _LOADERS[data_path] = botocore.loaders.create_loader(data_path)
    session.register_component("data_loader", loader)
    return session


def share_data(fs: Any) -> Any:
    """Give the s3fs filesystem ``fs`` (not yet connected) a :func:`new_session` built from its
    own session arguments, unless its caller passed a ``session``; returns ``fs``."""
    if fs.session is None:
        fs.session = new_session(fs.kwargs)
    return fs


def load_s3_data() -> None:
    """Parse what an S3 client reads from botocore's data files into this process's shared loader
    now, by building one client (no request is sent).

    A process that forks children (a launcher, a fork server) calls it before forking: each child's
    first S3 store then finds the data parsed instead of parsing it again.
    """
    import asyncio

    session = new_session({})

    async def build() -> None:
        async with session.create_client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9",
                                         aws_access_key_id="unused", aws_secret_access_key="unused"):
            pass

    asyncio.run(build())


__all__ = ["load_s3_data", "new_session", "share_data"]
