"""Google Cloud Storage through gcsfs: the backend, its parallel composite uploads, ranged reads
and probes."""

from ._storage import GCSStorage

__all__ = ["GCSStorage"]
