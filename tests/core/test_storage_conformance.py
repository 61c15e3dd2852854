"""The storage seam's conformance suite: every verb of :class:`~opd_store.storage.Storage`, on every
backend (local, memory, S3 on moto, GCS on fake-gcs-server), checked through the raw backend
(boto3 for S3, a fresh fsspec instance otherwise; ``tests/core/helpers.py``'s ``Raw``), never
through opd_store itself. S3 runs on two servers: moto and SeaweedFS (a production S3 server). A backend that forgets a verb cannot even be constructed.
Multipart uploads are a capability (``Storage.multipart_uploads``): S3 offers them, the others none.
"""

from __future__ import annotations

import time

import pytest

from opd_store.format import new_attempt_id
from opd_store.storage import FsspecStorage, LocalStorage, Meaning, Storage, check_reachable, classify

from .helpers import crc_hex, open_store

ABSTRACT_VERBS = {"list_children", "list_tree", "list_tree_modified", "size", "read_bytes", "open_write", "create_exclusive", "delete",
                  "delete_tree"}


def test_the_seam_declares_its_verbs_abstract():
    assert Storage.__abstractmethods__ == frozenset(ABSTRACT_VERBS)
    assert FsspecStorage.__abstractmethods__ == frozenset({"create_exclusive"})


def test_a_backend_that_forgets_a_verb_fails_when_constructed(tmp_path):
    class NoCreate(FsspecStorage):
        """A backend without the create-only write: a commit would be impossible."""

    class NoUploads(FsspecStorage):
        def create_exclusive(self, rel: str, data: bytes) -> None:
            raise NotImplementedError

    fs = LocalStorage.__mro__  # any object: construction must fail before fs is used
    with pytest.raises(TypeError, match="abstract method.*create_exclusive"):
        NoCreate(fs, str(tmp_path), str(tmp_path))
    # Multipart uploads are a capability, not a verb: a backend without them says nothing.
    assert NoUploads(fs, str(tmp_path), str(tmp_path)).multipart_uploads() is None


EVERY_BACKEND = pytest.mark.parametrize("backend", ["local", "memory", "s3", "seaweed", "gcs"], indirect=True)


def _storage(backend):
    return open_store(backend).storage


@EVERY_BACKEND
def test_list_children_and_list_tree(backend, raw):
    storage = _storage(backend)
    raw.put("a/b.bin", b"12345")
    raw.put("a/c/d.bin", b"xy")
    raw.put("e.bin", b"")
    assert storage.list_children("a") == (["c"], {"b.bin": 5})
    dirs, files = storage.list_children("")
    assert sorted(dirs) == ["a"] and files == {"e.bin": 0}
    assert storage.list_tree("a") == {"b.bin": 5, "c/d.bin": 2}
    assert storage.list_tree("") == {"a/b.bin": 5, "a/c/d.bin": 2, "e.bin": 0}
    assert storage.list_children("missing") == ([], {}) and storage.list_tree("missing") == {}


@EVERY_BACKEND
def test_listings_and_sizes_are_fresh(backend, raw):
    storage = _storage(backend)
    assert storage.list_tree("p") == {} and storage.size("p/x.bin") is None
    raw.put("p/x.bin", b"abc")  # written behind the storage's back, after it looked
    assert storage.list_tree("p") == {"x.bin": 3} and storage.size("p/x.bin") == 3
    raw.rm("p/x.bin")
    assert storage.list_tree("p") == {} and storage.size("p/x.bin") is None


@EVERY_BACKEND
def test_size(backend, raw):
    storage = _storage(backend)
    raw.put("s/obj.bin", bytes(1000))
    assert storage.size("s/obj.bin") == 1000
    assert storage.size("s/none.bin") is None
    assert storage.size("s") is None  # a prefix is no object


@EVERY_BACKEND
def test_read_bytes_whole_capped_and_missing(backend, raw):
    storage = _storage(backend)
    data = bytes(range(256)) * 8
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
        assert (reader.read(), size_bytes, crc) == (data, len(data), crc_hex(data))


@EVERY_BACKEND
def test_open_write_publishes_at_finish_and_abort_leaves_nothing(backend, raw):
    storage = _storage(backend)
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


@EVERY_BACKEND
def test_create_exclusive_is_create_only(backend, raw):
    storage = _storage(backend)
    storage.create_exclusive("c/manifest.json", b'{"first": 1}')
    assert raw.cat("c/manifest.json") == b'{"first": 1}'
    with pytest.raises(Exception) as caught:
        storage.create_exclusive("c/manifest.json", b'{"second": 2}')
    assert classify(caught.value) is Meaning.LOST_RACE
    assert raw.cat("c/manifest.json") == b'{"first": 1}'
    assert storage.atomic_create and storage.commit_primitive != "none"


@EVERY_BACKEND
def test_delete_and_delete_tree(backend, raw):
    storage = _storage(backend)
    for rel in ("d/x/1.bin", "d/x/2.bin", "d/y.bin", "other.bin"):
        raw.put(rel, b"z")
    storage.delete("d/y.bin")
    assert "d/y.bin" not in raw.keys()
    storage.delete("d/y.bin")  # missing: no error
    storage.delete_tree("d/x")
    assert sorted(raw.keys()) == ["other.bin"]
    storage.delete_tree("d/x")  # missing: no error


@EVERY_BACKEND
def test_multipart_upload_listing_and_abort(backend, raw):
    storage = _storage(backend)
    uploads = storage.multipart_uploads()
    if backend.name != "s3":
        assert uploads is None  # no multipart uploads to list or abort on this backend
        return
    key = f"step-000001/{new_attempt_id()}/model.bin"
    started = raw.client.create_multipart_upload(Bucket=raw.bucket, Key=f"{raw.prefix}/{key}")
    raw.client.create_multipart_upload(Bucket=raw.bucket, Key="elsewhere/big.bin")  # outside the root
    (listed,) = uploads.list()
    assert listed[:2] == (key, started["UploadId"]) and listed[2] <= time.time()
    uploads.abort(key, started["UploadId"])
    left = raw.client.list_multipart_uploads(Bucket=raw.bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == ["elsewhere/big.bin"]


@EVERY_BACKEND
def test_the_store_clock_and_modification_times(backend, raw):
    """Every backend reports each object's modification time and its own notion of now on one
    clock (here the servers run on this machine, so both are this machine's time too)."""
    storage = _storage(backend)
    before = time.time()
    raw.put("a/b.bin", b"12345")
    raw.put("c.bin", b"")
    now = storage.clock_secs()
    after = time.time()
    assert before - 2 <= now <= after + 2  # S3 and GCS: the server's Date header (whole seconds)
    listed = storage.list_tree_modified("")
    assert sorted(listed) == ["a/b.bin", "c.bin"] and listed["a/b.bin"][0] == 5
    for _size, modified in listed.values():
        assert before - 2 <= modified <= now + 1
    assert storage.list_tree_modified("a") == {"b.bin": listed["a/b.bin"]}
    assert storage.list_tree_modified("missing") == {}
    uploads = storage.multipart_uploads()
    if backend.name != "s3":
        assert uploads is None  # no upload whose parts could be aged
        return
    key = f"{raw.prefix}/step-000001/{new_attempt_id()}/model.bin"
    upload = raw.client.create_multipart_upload(Bucket=raw.bucket, Key=key)
    rel = key[len(raw.prefix) + 1:]
    assert uploads.newest_part_secs(rel, upload["UploadId"]) is None
    raw.client.upload_part(Bucket=raw.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 10)
    assert before - 2 <= uploads.newest_part_secs(rel, upload["UploadId"]) <= time.time() + 1
    raw.client.abort_multipart_upload(Bucket=raw.bucket, Key=key, UploadId=upload["UploadId"])


@EVERY_BACKEND
def test_check_reachable_and_names(backend):
    storage = _storage(backend)
    check_reachable(storage)  # an empty store is usable: the first save creates it
    assert storage.url("step-000001/manifest.json") == f"{storage.url_root}/step-000001/manifest.json"
    assert storage.path("a/b").endswith("/a/b")
