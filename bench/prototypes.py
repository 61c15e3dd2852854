"""Prototypes of proposed opd_store changes, measured by ``bench.core`` next to the real code.

Nothing here is used by opd_store; each function mirrors a diff proposed to the lead.

``verified_local_open``: the store's ``open()`` for local stores. Today ``CheckpointStore.open``
returns ``io.BytesIO(store.read(...))``: the whole payload is copied into a fresh ``bytes``
(``LocalFileSystem.cat_file``), checksummed, and then ``torch.load`` copies it a second time into
the tensors. The prototype opens the payload file, checks its size with ``fstat``, checksums it
through a read-only ``mmap`` of the same descriptor (no copy into process memory), rewinds, and
returns the real file: ``torch.load`` then reads straight into tensor storage once, like
``torch.load(path)``.

``crc_function``: the CRC32C used over a buffer: ``awscrt.checksums.crc32c`` (what opd_store uses)
or the ``crc32c`` package (what it used before 2026-11-30; about half as fast here).
"""

from __future__ import annotations

import mmap
import os
from typing import Callable

from opd_store.errors import IntegrityError
from opd_store.layout import step_dirname


def crc_function(name: str) -> Callable[[object, int], int]:
    """``fn(buffer, previous_crc) -> crc`` for ``crc32c`` or ``awscrt``."""
    if name == "crc32c":
        import crc32c

        return crc32c.crc32c
    if name == "awscrt":
        from awscrt import checksums

        return checksums.crc32c
    raise ValueError(name)


def crc32c_package_available() -> bool:
    try:
        import crc32c  # noqa: F401
    except ImportError:
        return False
    return True


def verified_local_open(store, step: int, name: str, crc: Callable[[object, int], int]):
    """A real, checked file object for a local store's payload (see module docstring)."""
    manifest = store.manifest(step)
    entry = manifest.entry(name)
    path = store.storage.path(f"{step_dirname(step)}/{entry.path}")
    handle = open(path, "rb")  # noqa: SIM115 - returned to the caller
    try:
        size = os.fstat(handle.fileno()).st_size
        if size != entry.size_bytes:
            raise IntegrityError(f"{path}: {size} bytes, manifest says {entry.size_bytes}")
        value = 0
        if size:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                mapped.madvise(mmap.MADV_SEQUENTIAL)
                value = crc(mapped, 0)
        if f"{value:08x}" != entry.crc32c:
            raise IntegrityError(f"{path}: crc32c {value:08x}, manifest says {entry.crc32c}")
        handle.seek(0)
        return handle
    except BaseException:
        handle.close()
        raise


# -- fewer requests on S3 ------------------------------------------------------------------------
def read_bytes_one_get(storage, rel: str, **_ignored) -> bytes:
    """``Storage.read_bytes`` without s3fs's size probe: ``cat_file`` issues a HEAD before the GET
    (to decide on a concurrent ranged download) unless ``max_concurrency=1``.

    (opd_store has since adopted this for manifests: ``read_bytes(rel, small=True)``.)
    """
    storage.refresh()
    try:
        return storage.fs.cat_file(storage.path(rel), max_concurrency=1)
    except TypeError:  # an s3fs without the keyword
        return storage.fs.cat_file(storage.path(rel))


def patch_one_get_reads(store) -> None:
    """Make one store instance read small objects with a single GET (prototype of the diff)."""
    storage = store.storage
    storage.read_bytes = lambda rel, **kwargs: read_bytes_one_get(storage, rel)


def latest_step_one_listing(store) -> int:
    """``latest_step`` deciding each candidate from one listing of its step prefix.

    Per candidate: one recursive listing of ``step-N/`` (shows ``manifest.json``, a legacy
    ``COMPLETE`` marker and every attempt object with its size), then one GET of the manifest only
    when the listing shows one. An uncommitted step costs one request instead of four.
    """
    from opd_store.errors import CheckpointNotFoundError, ManifestError
    from opd_store.layout import MANIFEST_NAME
    from opd_store.manifest import parse_manifest

    for step in reversed(store._step_prefixes()):
        objects = store.storage.list_tree(step_dirname(step))
        if MANIFEST_NAME not in objects:
            continue
        rel = f"{step_dirname(step)}/{MANIFEST_NAME}"
        try:
            manifest = parse_manifest(read_bytes_one_get(store.storage, rel), url=rel, expected_step=step)
        except (FileNotFoundError, ManifestError):
            continue
        if all(objects.get(e.path) == e.size_bytes for e in manifest.payloads):
            return step
    raise CheckpointNotFoundError(f"no complete checkpoint in {store.url}")


# -- bounded upload buffer -----------------------------------------------------------------------
class SlicedWrites:
    """Pass writes on in slices of at most ``slice_bytes`` (zero-copy memoryview slices).

    fsspec's buffered writers append a whole ``write()`` to their buffer before uploading a block,
    so one 1 GiB tensor handed over in one call sits in the s3fs buffer whole, and is copied again
    for the part upload. ``PayloadWriter.write`` slicing its input bounds that buffer at the block
    size plus one slice, whatever the largest tensor.
    """

    def __init__(self, inner, slice_bytes: int = 8 * 2**20) -> None:
        self.inner = inner
        self.slice_bytes = slice_bytes

    def write(self, data) -> int:
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        for offset in range(0, view.nbytes, self.slice_bytes):
            self.inner.write(view[offset : offset + self.slice_bytes])
        return view.nbytes

    def flush(self) -> None:
        self.inner.flush()
