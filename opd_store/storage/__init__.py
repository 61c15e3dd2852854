"""Storage seam (fsspec is confined to this package)."""

from .backends import (
    CheckThenPutStorage,
    GCSStorage,
    LocalStorage,
    MemoryStorage,
    S3Storage,
    open_storage,
)
from .base import Storage, join

__all__ = [
    "CheckThenPutStorage",
    "GCSStorage",
    "LocalStorage",
    "MemoryStorage",
    "S3Storage",
    "Storage",
    "join",
    "open_storage",
]
