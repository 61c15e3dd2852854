"""The storage seam: backends behind a few abstract verbs (fsspec is confined to this package).

:class:`Storage` declares the verbs (:mod:`opd_store.storage.base`), :class:`FsspecStorage`
implements them over an fsspec filesystem, :mod:`opd_store.storage.backends` (local, memory,
others) and :mod:`opd_store.storage.buckets` (S3, GCS) add each backend's create-only write, probe
and clock, :mod:`opd_store.storage.open_url` picks the backend for a URL,
:mod:`opd_store.storage.client_options` gives every client opd_store's timeouts,
:mod:`opd_store.storage.reachability` (with :mod:`opd_store.storage.remote_probes`) proves a store
usable in bounded time, and :mod:`opd_store.storage.backend_errors` is the one table that says
what a backend failure means.
"""

from .backend_errors import Meaning, classify
from .backends import CheckThenPutStorage, LocalStorage, MemoryStorage
from .base import Storage, join
from .buckets import GCSStorage, S3Storage
from .fsspec_storage import FsspecStorage, NoMultipartUploads
from .open_url import open_storage

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
