"""What the commit relies on, proven against the backends themselves first:
if a moto or fake-gcs-server version stops enforcing a precondition, these fail loudly instead of
the race tests passing by luck."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from .helpers import boto3_client, open_store


def test_create_exclusive_refuses_an_existing_object(backend, raw):
    storage = open_store(backend).storage
    storage.create_exclusive("probe/manifest.json", b"first")
    with pytest.raises(FileExistsError):
        storage.create_exclusive("probe/manifest.json", b"second")
    assert raw.cat("probe/manifest.json") == b"first"


def test_moto_enforces_if_none_match_and_if_match(s3_backend, moto_s3):
    client = boto3_client(moto_s3)
    bucket, _, prefix = s3_backend.url[len("s3://"):].partition("/")
    key = f"{prefix}/probe"
    client.put_object(Bucket=bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    stale = client.head_object(Bucket=bucket, Key=key)["ETag"]
    client.put_object(Bucket=bucket, Key=key, Body=b"third")
    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=bucket, Key=key, Body=b"fourth", IfMatch=stale)
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"third"


@pytest.mark.parametrize("backend", ["s3", "gcs"], indirect=True)
def test_s3fs_and_gcsfs_create_mode_map_412_to_file_exists(backend):
    fs = backend.raw_fs()
    path = f"{backend.raw_root()}/probe-create"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    fs.invalidate_cache()
    assert fs.cat_file(path) == b"first"
