"""Credentials that may PutObject but not use multipart uploads.

A proxy in front of moto answers ``403 AccessDenied`` to the multipart operations, as S3 does for a
policy without ``s3:PutObject`` on multipart parts... (or one denying the upload explicitly). A
payload above the upload block size needs them: the save fails with a permission error naming the
refused operation, nothing is committed, and no multipart upload is left open (it would be billed
until aborted).
"""

from __future__ import annotations

import pytest
import torch
from core.helpers import boto3_client, open_store, save

from opd_store.errors import StoragePermissionError

from .conftest import BLOCK_BYTES


def _save_large(store, step: int) -> None:
    # 12 MiB of float32: more than two 5 MiB upload blocks, streamed by torch.save.
    with store.begin(step) as txn:
        with txn.open("model.pt") as writer:
            torch.save({"w": torch.ones(3 << 20)}, writer)


@pytest.mark.parametrize("denied", ["CreateMultipartUpload", "UploadPart"])
def test_multipart_denied_fails_naming_the_operation_and_leaves_nothing(s3_proxy, moto_s3, denied):
    backend, proxy = s3_proxy
    proxy.add(ops=(denied,), status=403, code="AccessDenied", times=None)
    store = open_store(backend)
    save(store, 1, {"small.bin": b"fits in one PutObject"})
    assert proxy.count("PutObject") == 2  # the payload and the manifest: allowed

    with pytest.raises(StoragePermissionError) as caught:
        _save_large(store, 2)
    message = str(caught.value)
    assert denied in message
    assert "step 2" in message and "model.pt" in message
    assert f"{backend.url}/step-000002/attempt-" in message
    assert isinstance(caught.value, PermissionError)
    refused = [r for r in proxy.requests if r.op == denied and r.fault is not None]
    # A 403 is final: no request is retried (parts already in flight are refused once each).
    assert refused and len(refused) == len({r.query for r in refused})
    if denied == "UploadPart":
        assert proxy.count("CreateMultipartUpload") == 1
        assert proxy.count("AbortMultipartUpload") == 1  # the open upload was aborted

    assert store.steps() == [1]
    assert store.latest_step() == 1
    assert store.read(1, "small.bin") == b"fits in one PutObject"
    client = boto3_client(moto_s3)
    bucket, _, prefix = backend.url[len("s3://"):].partition("/")
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert not [k for k in keys if k.startswith(f"{prefix}/step-000002/")]


def test_small_payloads_need_no_multipart_permission(s3_proxy):
    backend, proxy = s3_proxy
    proxy.add(ops=("CreateMultipartUpload", "UploadPart"), status=403, code="AccessDenied", times=None)
    store = open_store(backend)
    data = bytes(BLOCK_BYTES - 1)
    save(store, 3, {"below-block.bin": data})
    assert store.read(3, "below-block.bin") == data
    assert proxy.count("CreateMultipartUpload") == 0
