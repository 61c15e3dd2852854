"""How a parallel transfer looks on the wire, per object store, for tests that assert the same
behaviour on S3 (multipart uploads) and GCS (parallel composite uploads): which recorded request is
a part, the assembly, a ranged read or the manifest's create, and what a failed upload may leave.

==================  ===============================  =========================================
                    S3                               GCS
==================  ===============================  =========================================
part                ``UploadPart`` (``partNumber``)  ``MediaUpload`` of ``<name>.part-T-0000N``
assembly            ``CompleteMultipartUpload``      ``Compose`` into ``<name>``
ranged read         ``GetObject`` with ``Range``     ``GetMedia`` with ``Range``
size question       ``HeadObject``                   ``GetObject`` (metadata)
manifest create     ``PutObject``                    ``MultipartUpload`` (gcsfs's single request)
leftovers           open multipart uploads           objects named ``*.part-*``
==================  ===============================  =========================================
"""

from __future__ import annotations

import dataclasses
from typing import Callable
from urllib.parse import parse_qs

from .gcs import GCSFaultProxy, GCSHoldProxy, GCSProxy, gcs_object
from .hold_proxy import HoldProxy
from .proxies import Request, S3FaultProxy, S3Proxy


@dataclasses.dataclass(frozen=True)
class Dialect:
    """One store's requests of a parallel transfer (module docstring).

    Attributes:
        name (str): ``s3`` or ``gcs``.
        proxy, fault_proxy, hold_proxy (type): the recording, fault and hold proxies.
        part_op, assemble_op, get_op, stat_op, create_op (str): operation names (module docstring).
        writes (tuple[str, ...]): every operation that writes.
    """

    name: str
    proxy: type
    fault_proxy: type
    hold_proxy: type
    part_op: str
    assemble_op: str
    get_op: str
    stat_op: str
    create_op: str
    writes: tuple[str, ...]
    _object: Callable[[Request], str]
    _part_number: Callable[[Request], int | None]

    def object_of(self, request: Request) -> str:
        """The key a request names; a part's is its payload's (the temporary suffix dropped)."""
        key = self._object(request)
        return key.partition(".part-")[0] if self.name == "gcs" else key

    def names(self, request: Request, name: str) -> bool:
        """``request`` is about the payload ``name`` (a part of it included)."""
        return self.object_of(request).endswith("/" + name)

    def part_number(self, request: Request) -> int | None:
        """The part number (from 1) of a part upload, else ``None``."""
        return self._part_number(request) if request.op == self.part_op else None

    def parts(self, proxy, name: str) -> list[Request]:
        """Forwarded part uploads of the payload ``name``."""
        return [r for r in proxy.requests if r.op == self.part_op and r.fault is None and self.names(r, name)
                and self.part_number(r) is not None]

    def is_part(self, method: str, path: str) -> bool:
        """A part upload, from a :class:`HoldProxy` predicate's ``method`` and ``path?query``."""
        if self.name == "s3":
            return method == "PUT" and "partNumber=" in path
        return method == "POST" and "uploadType=media" in path and ".part-" in path


def _s3_part_number(request: Request) -> int | None:
    numbers = parse_qs(request.query).get("partNumber")
    return int(numbers[0]) if numbers else None


def _gcs_part_number(request: Request) -> int | None:
    key = gcs_object(request)
    marker, _, tail = key.rpartition(".part-")
    return int(tail.rpartition("-")[2]) if marker and tail.rpartition("-")[2].isdigit() else None


S3 = Dialect("s3", S3Proxy, S3FaultProxy, HoldProxy, "UploadPart", "CompleteMultipartUpload", "GetObject",
             "HeadObject", "PutObject", ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"),
             lambda r: r.path, _s3_part_number)
GCS = Dialect("gcs", GCSProxy, GCSFaultProxy, GCSHoldProxy, "MediaUpload", "Compose", "GetMedia", "GetObject",
              "MultipartUpload", ("MediaUpload", "MultipartUpload", "ResumableUpload", "ResumableChunk", "Compose"),
              gcs_object, _gcs_part_number)


def dialect_of(backend) -> Dialect:
    """The dialect of a :class:`~opd_testkit.stores.Backend` (``s3`` or ``gcs``)."""
    return GCS if backend.name == "gcs" else S3


def raw_backend(backend):
    """``backend`` without opd_store's own transfer options (for a raw fsspec client)."""
    options = {k: v for k, v in backend.storage_options.items() if k not in ("part_size_bytes", "parts_in_flight")}
    return dataclasses.replace(backend, storage_options=options)


def stored_keys(backend, under: str = "") -> list[str]:
    """Every object key under ``<store root>/<under>`` (a fresh listing, no cache), relative to the root."""
    plain = raw_backend(backend)
    fs, root = plain.raw_fs(), plain.raw_root()
    base = f"{root}/{under}".rstrip("/")
    # SeaweedFS lists a prefix's directory entry as an object of its own: not a key under it.
    return sorted(p[len(root) + 1:] for p in fs.find(base) if p.rstrip("/") != base)


__all__ = ["GCS", "S3", "Dialect", "dialect_of", "raw_backend", "stored_keys"]
