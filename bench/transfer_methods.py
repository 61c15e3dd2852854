"""The S3 clients ``python -m bench.transfers`` compares, one class per method (same interface as
:mod:`bench.methods`: ``save(state, tag)``, ``load(template, tag)``, ``cleanup(tag)``).

Every method moves the same state (:func:`bench.methods.make_training_state`) to one S3 endpoint:

=================  ==============================================================================
``s3fs-1stream``   what opd_store did before parallel transfers: the tensors' bytes written into
                   one s3fs file (``fs.open(path, "wb")``, 8 MiB writes, s3fs's 50 MiB block: a
                   multipart upload one part at a time); load: one GET (``cat_file``,
                   ``max_concurrency=1``) and ``torch.frombuffer`` views.
``s3fs-parallel``  s3fs's own concurrency: ``pipe_file`` of the bytes (joined into one buffer,
                   timed) with ``max_concurrency=K`` parts of ``P``; load ``cat_file`` with
                   ``max_concurrency=K`` ranges of ``P`` (gathered, then copied into one buffer).
``obstore``        the Rust client (``obstore.put`` of the tensors' memoryviews, ``chunk_size=P``,
                   ``max_concurrency=K``; load ``obstore.get_ranges`` of ``P``-byte ranges copied
                   into one buffer).
``boto3-tm``       boto3's transfer manager (``upload_fileobj`` / ``download_fileobj`` with
                   ``TransferConfig(multipart_chunksize=P, max_concurrency=K)``), reading from and
                   writing into the tensors' memory.
``opd_store``      a transaction with ``opd_store.format._torch_io.torch_save`` (CRC32C, manifest),
                   ``part_size_bytes=P``, ``parts_in_flight=K``; load ``store.open`` (parallel
                   ranges, size and CRC32C checked) + ``torch.load`` (:class:`bench.methods.Store`).
``dcp-threads``    ``torch.distributed.checkpoint`` with ``FsspecWriter(thread_count=K)`` (K files
                   on K connections); load ``FsspecReader`` (one file at a time).
``opd_store-cp``   the ``opd_store`` save; "load" is ``opd-store cp`` of the step to local disk
                   (``copy_checkpoint``: ``K`` ranged GETs of ``P`` in flight, deep verify), then a
                   mapped load of the copy. ``opd_store-cp-1stream``: the same copy reading each
                   payload as one GET stream (what copies did before).
=================  ==============================================================================

``K`` (parts in flight) and ``P`` (part size) are the same for every method: :data:`PARTS_IN_FLIGHT`,
:data:`PART_BYTES`.
"""

from __future__ import annotations

import io

from bench.methods import PAYLOAD, Dcp, Method, Store, flat_tensors, loaded_as_state

MIB = 2**20
PART_BYTES = 16 * MIB
PARTS_IN_FLIGHT = 8
SLICE_BYTES = 8 * MIB


def _views(state) -> list[memoryview]:
    return [memoryview(t.numpy()).cast("B") for t in flat_tensors(state)]


def _tensors_from(buffer, template) -> dict:
    """The state's tensors as views of ``buffer`` (no copy), in the state's shape."""
    import torch

    out, offset = [], 0
    for tensor in flat_tensors(template):
        count = tensor.numel()
        out.append(torch.frombuffer(buffer, dtype=torch.float32, count=count, offset=offset).view(tensor.shape))
        offset += count * 4
    return loaded_as_state("raw", out, template)


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(state))


class S3fsOneStream(Method):
    name = "s3fs-1stream"

    def save(self, state, tag):
        with self.fs.open(self.key(tag, ".bin"), "wb") as handle:
            for view in _views(state):
                for offset in range(0, view.nbytes, SLICE_BYTES):
                    handle.write(view[offset:offset + SLICE_BYTES])

    def load(self, template, tag):
        return _tensors_from(self.fs.cat_file(self.key(tag, ".bin"), max_concurrency=1), template)

    def cleanup(self, tag):
        self.fs.rm_file(self.key(tag, ".bin"))


class S3fsParallel(S3fsOneStream):
    name = "s3fs-parallel"

    def save(self, state, tag):
        data = b"".join(_views(state))
        self.fs.pipe_file(self.key(tag, ".bin"), data, chunksize=PART_BYTES, max_concurrency=PARTS_IN_FLIGHT)

    def load(self, template, tag):
        data = self.fs.cat_file(self.key(tag, ".bin"), chunksize=PART_BYTES, max_concurrency=PARTS_IN_FLIGHT)
        return _tensors_from(data, template)


class Obstore(Method):
    name = "obstore"

    def __init__(self, backend, root, options=None):
        super().__init__(backend, root, options)
        from obstore.store import S3Store

        bucket, _, self.prefix = self.root.removeprefix("s3://").partition("/")
        self.store = S3Store(bucket, endpoint=self.options["endpoint_url"], access_key_id=self.options["key"],
                             secret_access_key=self.options["secret"], region="us-east-1",
                             client_options={"allow_http": True})

    def _path(self, tag):
        return f"{self.prefix}/{self.name}-{tag}.bin"

    def save(self, state, tag):
        import obstore

        obstore.put(self.store, self._path(tag), _views(state), chunk_size=PART_BYTES,
                    max_concurrency=PARTS_IN_FLIGHT)

    def load(self, template, tag):
        import obstore

        size = _nbytes(template)
        starts = list(range(0, size, PART_BYTES))
        buffer = bytearray(size)
        view = memoryview(buffer)
        for first in range(0, len(starts), PARTS_IN_FLIGHT):
            batch = starts[first:first + PARTS_IN_FLIGHT]
            ends = [min(size, s + PART_BYTES) for s in batch]
            for start, chunk in zip(batch, obstore.get_ranges(self.store, self._path(tag), starts=batch, ends=ends)):
                piece = memoryview(chunk)
                view[start:start + piece.nbytes] = piece
        return _tensors_from(buffer, template)

    def cleanup(self, tag):
        import obstore

        obstore.delete(self.store, self._path(tag))


class _ViewsReader(io.RawIOBase):
    """A readable file over the tensors' memoryviews, in order (no copy but into the caller's buffer)."""

    def __init__(self, views):
        super().__init__()
        self._views, self._index, self._offset = views, 0, 0

    def readable(self):
        return True

    def readinto(self, target):
        out, written = memoryview(target).cast("B"), 0
        while written < out.nbytes and self._index < len(self._views):
            view = self._views[self._index]
            count = min(out.nbytes - written, view.nbytes - self._offset)
            out[written:written + count] = view[self._offset:self._offset + count]
            written += count
            self._offset += count
            if self._offset == view.nbytes:
                self._index, self._offset = self._index + 1, 0
        return written


class _BufferWriter(io.RawIOBase):
    """A writable, seekable file over one preallocated buffer."""

    def __init__(self, buffer):
        super().__init__()
        self._view, self._pos = memoryview(buffer), 0

    def writable(self):
        return True

    def seekable(self):
        return True

    def write(self, data):
        data = memoryview(data).cast("B")
        self._view[self._pos:self._pos + data.nbytes] = data
        self._pos += data.nbytes
        return data.nbytes

    def seek(self, offset, whence=io.SEEK_SET):
        self._pos = offset if whence == io.SEEK_SET else (self._pos + offset if whence == io.SEEK_CUR
                                                           else self._view.nbytes + offset)
        return self._pos

    def tell(self):
        return self._pos


class Boto3TransferManager(Method):
    name = "boto3-tm"

    def __init__(self, backend, root, options=None):
        super().__init__(backend, root, options)
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, _, self.prefix = self.root.removeprefix("s3://").partition("/")
        self.client = boto3.client("s3", endpoint_url=self.options["endpoint_url"],
                                   aws_access_key_id=self.options["key"], aws_secret_access_key=self.options["secret"],
                                   region_name="us-east-1", config=Config(max_pool_connections=2 * PARTS_IN_FLIGHT))
        self.config = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                                     max_concurrency=PARTS_IN_FLIGHT, use_threads=True)

    def connect(self):
        self.client.list_objects_v2(Bucket=self.bucket, MaxKeys=1)

    def _key(self, tag):
        return f"{self.prefix}/{self.name}-{tag}.bin"

    def save(self, state, tag):
        self.client.upload_fileobj(_ViewsReader(_views(state)), self.bucket, self._key(tag), Config=self.config)

    def load(self, template, tag):
        buffer = bytearray(_nbytes(template))
        self.client.download_fileobj(self.bucket, self._key(tag), _BufferWriter(buffer), Config=self.config)
        return _tensors_from(buffer, template)

    def cleanup(self, tag):
        self.client.delete_object(Bucket=self.bucket, Key=self._key(tag))


class StoreParallel(Store):
    """opd_store with the same part size and parts in flight as the raw clients."""

    name = "opd_store"

    def __init__(self, backend, root, options=None):
        super().__init__(backend, root, options)
        from opd_store import CheckpointStore

        self.store = CheckpointStore(f"{self.root}/store", storage_options=dict(
            self.options, part_size_bytes=PART_BYTES, parts_in_flight=PARTS_IN_FLIGHT))


class StoreCopy(StoreParallel):
    """``opd-store cp`` of the saved step from S3 to local disk (``copy_checkpoint``, deep verify);
    its "load" is the copy, then a mapped load of the local copy."""

    name = "opd_store-cp"
    one_stream = False

    def load(self, template, tag):
        import tempfile

        from opd_store import CheckpointStore
        from opd_store.format import torch_load
        from opd_store.store import copy_checkpoint

        storage = self.store.storage
        if self.one_stream:  # what a copy did before ranged reads: one GET stream per payload
            storage.open_read_stream = lambda rel, size_bytes: storage.open_read(rel)
        self.local = tempfile.mkdtemp(prefix="opd-bench-cp-")
        local = CheckpointStore(self.local)
        copy_checkpoint(self.store, tag, local)
        with local.open(tag, PAYLOAD) as handle:
            return torch_load(handle, mmap=True)

    def cleanup(self, tag):
        import shutil

        super().cleanup(tag)
        shutil.rmtree(self.local, ignore_errors=True)


class StoreCopyOneStream(StoreCopy):
    name = "opd_store-cp-1stream"
    one_stream = True


class DcpThreads(Dcp):
    name = "dcp-threads"

    def save(self, state, tag):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(self._url(tag), sync_files=False, thread_count=PARTS_IN_FLIGHT, **self._fs_kwargs())
        dcp.save(state, storage_writer=writer, no_dist=True)


BY_NAME = {cls.name: cls for cls in (S3fsOneStream, S3fsParallel, Obstore, Boto3TransferManager, StoreParallel,
                                     DcpThreads, StoreCopy, StoreCopyOneStream)}
RAW_PARALLEL = ("s3fs-parallel", "obstore", "boto3-tm")
METHODS = tuple(BY_NAME)
