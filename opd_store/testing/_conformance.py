"""The storage conformance suite: every verb of :class:`~opd_store.storage.Storage`, checked
through the backend's own client, never through opd_store (as zarr's ``StoreTests``;
docs/testing.md#testing-your-own-storage). Imports pytest.
"""

from __future__ import annotations

import abc
import time

import pytest

from ..format import new_attempt_id
from ..storage import Meaning, Storage, check_reachable, classify

# CRC32C of READ_DATA as 8 hex digits, computed once with the ``crc32c`` package (not opd_store's).
READ_DATA = bytes(range(256)) * 8
READ_DATA_CRC32C = "5f328b31"


class RawBackend(abc.ABC):
    """The storage's location seen without opd_store (the backend's own client: boto3, a fresh
    fsspec instance, a dict). Keys are relative to the storage's root; every call sees the backend
    as it is now (no cache). The multipart hooks are needed only where
    :attr:`StorageConformance.multipart_uploads` is true."""

    @abc.abstractmethod
    def put(self, rel: str, data: bytes) -> None:
        """Store ``data`` as the object ``rel`` (creating parent directories where the backend has them)."""

    @abc.abstractmethod
    def cat(self, rel: str) -> bytes:
        """The whole object ``rel``."""

    @abc.abstractmethod
    def rm(self, rel: str) -> None:
        """Delete the object ``rel``."""

    @abc.abstractmethod
    def keys(self) -> dict[str, int]:
        """``{rel: size_bytes}`` of every object under the root."""

    def start_upload(self, rel: str) -> str:
        """Start a multipart upload of ``rel``; return its upload id."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart hooks")

    def upload_part(self, rel: str, upload_id: str, part_number: int, data: bytes) -> None:
        """Upload part ``part_number`` (1-based) of an unfinished upload."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart hooks")

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Abort an unfinished upload."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart hooks")

    def start_upload_outside_root(self) -> str:
        """Start a multipart upload outside the root (same bucket); return its key as
        :meth:`unfinished_uploads` spells it."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart hooks")

    def unfinished_uploads(self) -> list[str]:
        """The keys (the backend's whole key, not relative to the root) of every unfinished
        upload in the bucket."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart hooks")


class StorageConformance:
    """The conformance suite; subclass it as ``Test...`` and define the ``storage`` fixture (the
    ``Storage`` under test at a fresh, empty location) and ``raw`` (a :class:`RawBackend` there).

    The checks ask what a commit needs: fresh listings and sizes, an atomic create-only manifest
    write (docs/protocol.md), writers that publish only when finished, and the store's clock on list
    times (garbage collection compares them). A failing check names the verb and the values it saw.

    Attributes:
        multipart_uploads (bool): the backend offers multipart uploads to list and abort.
        clock_skew_secs (float): how far the store's clock may be from this machine's (2 s: S3 and
            GCS give whole seconds in their ``Date`` header).
    """

    multipart_uploads = False
    clock_skew_secs = 2.0

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError(f"{type(self).__name__}: define a `storage` fixture (a Storage at an empty location)")

    @pytest.fixture
    def raw(self) -> RawBackend:
        raise NotImplementedError(f"{type(self).__name__}: define a `raw` fixture (a RawBackend of that location)")

    def test_list_children_and_list_tree(self, storage: Storage, raw: RawBackend) -> None:
        raw.put("a/b.bin", b"12345")
        raw.put("a/c/d.bin", b"xy")
        raw.put("e.bin", b"")
        assert storage.list_children("a") == (["c"], {"b.bin": 5})
        dirs, files = storage.list_children("")
        assert sorted(dirs) == ["a"] and files == {"e.bin": 0}
        assert storage.list_tree("a") == {"b.bin": 5, "c/d.bin": 2}
        assert storage.list_tree("") == {"a/b.bin": 5, "a/c/d.bin": 2, "e.bin": 0}
        assert storage.list_children("missing") == ([], {}) and storage.list_tree("missing") == {}

    def test_listings_and_sizes_are_fresh(self, storage: Storage, raw: RawBackend) -> None:
        assert storage.list_tree("p") == {} and storage.size("p/x.bin") is None
        raw.put("p/x.bin", b"abc")  # written behind the storage's back, after it looked
        assert storage.list_tree("p") == {"x.bin": 3} and storage.size("p/x.bin") == 3
        raw.rm("p/x.bin")
        assert storage.list_tree("p") == {} and storage.size("p/x.bin") is None

    def test_size(self, storage: Storage, raw: RawBackend) -> None:
        raw.put("s/obj.bin", bytes(1000))
        assert storage.size("s/obj.bin") == 1000
        assert storage.size("s/none.bin") is None
        assert storage.size("s") is None  # a prefix is no object

    def test_read_bytes_whole_capped_and_missing(self, storage: Storage, raw: RawBackend) -> None:
        data = READ_DATA
        raw.put("r/obj.bin", data)
        assert storage.read_bytes("r/obj.bin") == data
        assert storage.read_bytes("r/obj.bin", small=True) == data
        assert storage.read_bytes("r/obj.bin", max_bytes=99) == data[:100]  # at most max_bytes + 1
        with pytest.raises(Exception) as caught:
            storage.read_bytes("r/none.bin")
        assert classify(caught.value) is Meaning.NOT_FOUND
        with storage.open_read("r/obj.bin") as reader:
            assert reader.read() == data
        reader, size_bytes, crc = storage.open_checked("r/obj.bin")
        with reader:
            assert (reader.read(), size_bytes, crc) == (data, len(data), READ_DATA_CRC32C)

    def test_open_write_publishes_at_finish_and_abort_leaves_nothing(self, storage: Storage, raw: RawBackend) -> None:
        data = b"payload-" * 1000
        handle = storage.open_write("w/kept.bin")
        for offset in range(0, len(data), 1000):
            handle.write(data[offset:offset + 1000])
        storage.finish_write(handle, "w/kept.bin")
        assert raw.cat("w/kept.bin") == data
        handle = storage.open_write("w/dropped.bin")
        handle.write(b"partial bytes")
        storage.abort_write(handle, "w/dropped.bin")
        assert "w/dropped.bin" not in raw.keys() and raw.keys()["w/kept.bin"] == len(data)
        handle = storage.open_write("w/kept.bin")  # overwrite mode
        handle.write(b"second")
        storage.finish_write(handle, "w/kept.bin")
        assert raw.cat("w/kept.bin") == b"second"

    def test_create_exclusive_is_create_only(self, storage: Storage, raw: RawBackend) -> None:
        storage.create_exclusive("c/manifest.json", b'{"first": 1}')
        assert raw.cat("c/manifest.json") == b'{"first": 1}'
        with pytest.raises(Exception) as caught:
            storage.create_exclusive("c/manifest.json", b'{"second": 2}')
        assert classify(caught.value) is Meaning.LOST_RACE
        assert raw.cat("c/manifest.json") == b'{"first": 1}'
        assert storage.atomic_create and storage.commit_primitive != "none"

    def test_delete_and_delete_tree(self, storage: Storage, raw: RawBackend) -> None:
        for rel in ("d/x/1.bin", "d/x/2.bin", "d/y.bin", "other.bin"):
            raw.put(rel, b"z")
        storage.delete("d/y.bin")
        assert "d/y.bin" not in raw.keys()
        storage.delete("d/y.bin")  # missing: no error
        storage.delete_tree("d/x")
        assert sorted(raw.keys()) == ["other.bin"]
        storage.delete_tree("d/x")  # missing: no error

    def test_multipart_upload_listing_and_abort(self, storage: Storage, raw: RawBackend) -> None:
        uploads = storage.multipart_uploads()
        if not self.multipart_uploads:
            assert uploads is None  # no multipart uploads to list or abort on this backend
            return
        key = f"step-000001/{new_attempt_id()}/model.bin"
        upload_id = raw.start_upload(key)
        outside = raw.start_upload_outside_root()  # no listing of the root may show it
        (listed,) = uploads.list()
        assert listed[:2] == (key, upload_id) and listed[2] <= time.time()
        uploads.abort(key, upload_id)
        assert raw.unfinished_uploads() == [outside]

    def test_the_store_clock_and_modification_times(self, storage: Storage, raw: RawBackend) -> None:
        """Every backend reports each object's modification time and its own notion of now on one
        clock (within :attr:`clock_skew_secs` of this machine's)."""
        skew = self.clock_skew_secs
        before = time.time()
        raw.put("a/b.bin", b"12345")
        raw.put("c.bin", b"")
        now = storage.clock_secs()
        after = time.time()
        assert before - skew <= now <= after + skew
        listed = storage.list_tree_modified("")
        assert sorted(listed) == ["a/b.bin", "c.bin"] and listed["a/b.bin"][0] == 5
        for _size, modified in listed.values():
            assert before - skew <= modified <= now + 1
        assert storage.list_tree_modified("a") == {"b.bin": listed["a/b.bin"]}
        assert storage.list_tree_modified("missing") == {}
        uploads = storage.multipart_uploads()
        if not self.multipart_uploads:
            assert uploads is None  # no upload whose parts could be aged
            return
        rel = f"step-000001/{new_attempt_id()}/model.bin"
        upload_id = raw.start_upload(rel)
        assert uploads.newest_part_secs(rel, upload_id) is None
        raw.upload_part(rel, upload_id, 1, b"x" * 10)
        assert before - skew <= uploads.newest_part_secs(rel, upload_id) <= time.time() + 1
        raw.abort_upload(rel, upload_id)

    def test_check_reachable_and_names(self, storage: Storage, raw: RawBackend) -> None:
        check_reachable(storage)  # an empty store is usable: the first save creates it
        assert storage.url("step-000001/manifest.json") == f"{storage.url_root}/step-000001/manifest.json"
        assert storage.path("a/b").endswith("/a/b")


__all__ = ["RawBackend", "StorageConformance"]
