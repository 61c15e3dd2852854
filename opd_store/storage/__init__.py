"""The storage seam: backends behind a few abstract verbs (fsspec is confined to this package).

:class:`Storage` declares the verbs (:mod:`opd_store.storage.base`), :class:`FsspecStorage`
implements them over an fsspec filesystem, :mod:`opd_store.storage.backends` adds each backend's
create-only write and picks the backend for a URL, and :mod:`opd_store.storage.backend_errors` is
the one table that says what a backend failure means.
"""

from .backend_errors import Meaning, classify
from .backends import (
    CheckThenPutStorage,
    GCSStorage,
    LocalStorage,
    MemoryStorage,
    S3Storage,
    open_storage,
)
from .base import NoMultipartUploads, Storage, join
from .fsspec_storage import FsspecStorage

__all__ = [
    "CheckThenPutStorage",
    "FsspecStorage",
    "GCSStorage",
    "LocalStorage",
    "Meaning",
    "MemoryStorage",
    "NoMultipartUploads",
    "S3Storage",
    "Storage",
    "classify",
    "join",
    "open_storage",
]
