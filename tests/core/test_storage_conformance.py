"""The storage seam's conformance suite (:class:`opd_store.testing.StorageConformance`) on every
backend: local, memory, S3 on two servers (moto, and SeaweedFS, a production S3 server) and GCS on
fake-gcs-server, each checked through its raw backend (boto3 for S3, a fresh fsspec instance
otherwise; ``tests/core/helpers.py``'s ``Raw``), never through opd_store itself. Besides: the seam
declares its verbs abstract, so a backend that forgets one cannot even be constructed; multipart
uploads are a capability (``Storage.multipart_uploads``): S3 offers them, the others none.
"""

from __future__ import annotations

import pytest
from store_fixtures import s3_server

from opd_store.storage import FsspecStorage, LocalStorage, Storage
from opd_store.testing import StorageConformance

from .helpers import Raw, open_store

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


class OnTestBackend(StorageConformance):
    """The suite on a location of this suite's ``backend`` fixture (each class parametrizes it)."""

    @pytest.fixture
    def storage(self, backend) -> Storage:
        return open_store(backend).storage

    @pytest.fixture
    def raw(self, backend, request) -> Raw:
        return Raw(backend, s3_server(request, backend) if backend.name == "s3" else None)


@pytest.mark.parametrize("backend", ["local"], indirect=True)
class TestLocal(OnTestBackend):
    pass


@pytest.mark.parametrize("backend", ["memory"], indirect=True)
class TestMemory(OnTestBackend):
    pass


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
class TestS3OnMoto(OnTestBackend):
    multipart_uploads = True


@pytest.mark.parametrize("backend", ["seaweed"], indirect=True)
class TestS3OnSeaweedFS(OnTestBackend):
    multipart_uploads = True


@pytest.mark.parametrize("backend", ["gcs"], indirect=True)
class TestGCS(OnTestBackend):
    pass
