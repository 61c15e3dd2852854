"""The storage seam: backends behind a few abstract verbs (fsspec and the backends' clients are
confined to this package).

:class:`Storage` declares the verbs (:mod:`._base`), :class:`FsspecStorage` implements them over an
fsspec filesystem (:mod:`._fsspec`); :mod:`._backends` (local, memory, others), :mod:`.s3` and
:mod:`.gcs` (over their shared :mod:`._bucket`) add each backend's create-only write, probe and
clock, and S3 its :class:`MultipartUploads`; :mod:`.transfers` moves payloads over several
connections; :func:`open_storage` picks the backend for a URL (:mod:`._open_url`) with opd_store's
timeouts (:mod:`._client_options`); :func:`check_reachable` proves a store usable in bounded time
(:mod:`._reachability`); :mod:`._backend_errors` is the one table that says what a backend failure
means (:func:`classify`).
"""

from ._backend_errors import Meaning, backend_operation, classify, describe, is_backend_failure, is_missing
from ._backends import CheckThenPutStorage, LocalStorage, MemoryStorage
from ._base import MultipartUploads, Storage, join
from ._fsspec import FsspecStorage
from ._open_url import open_storage, refuse_mistyped_url
from ._reachability import LocalProbe, Probe, check_reachable
from .gcs import GCSStorage
from .s3 import S3Storage

__all__ = [
    "CheckThenPutStorage",
    "FsspecStorage",
    "GCSStorage",
    "LocalStorage",
    "Meaning",
    "backend_operation",
    "describe",
    "is_backend_failure",
    "is_missing",
    "LocalProbe",
    "MemoryStorage",
    "MultipartUploads",
    "Probe",
    "S3Storage",
    "Storage",
    "check_reachable",
    "classify",
    "join",
    "open_storage",
    "refuse_mistyped_url",
]
