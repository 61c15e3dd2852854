"""What the two S3 servers of the suite answer where they differ (docs/protocol.md, "S3 servers").

moto is a Python mock; SeaweedFS is a production S3 server. Each difference docs/protocol.md records
is asserted here on both, with what opd_store makes of it, so the page cannot drift from the servers.
"""

from __future__ import annotations

import botocore.exceptions
import pytest
from opd_testkit.stores import open_store

from opd_store.storage import Meaning, classify

SERVERS = pytest.mark.parametrize("server_name", ["moto_s3", "seaweed_s3"])


@pytest.fixture
def server(request, server_name):
    return request.getfixturevalue(server_name)


def _bucket(backend) -> str:
    return backend.url[len("s3://"):].split("/", 1)[0]


@SERVERS
def test_a_refused_conditional_create_is_a_lost_race_on_both(server, server_name):
    backend = server.new_backend()
    client, bucket = server.boto3_client(), _bucket(backend)
    client.put_object(Bucket=bucket, Key="k", Body=b"first")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        client.put_object(Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
    error = refused.value.response["Error"]
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert error["Code"] == "PreconditionFailed"
    # moto names the condition, as AWS does; SeaweedFS does not, so s3fs raises a plain OSError
    # (EINVAL) instead of FileExistsError. The table of backend failures reads the code: both lose.
    assert error.get("Condition") == ("If-None-Match" if server_name == "moto_s3" else None)
    storage = open_store(backend).storage
    storage.create_exclusive("m.json", b"1")
    with pytest.raises(OSError) as lost:
        storage.create_exclusive("m.json", b"2")
    assert isinstance(lost.value, FileExistsError) == (server_name == "moto_s3")
    assert classify(lost.value) is Meaning.LOST_RACE
    assert storage.read_bytes("m.json") == b"1"


@SERVERS
def test_listing_order(server, server_name):
    backend = server.new_backend()
    client, bucket = server.boto3_client(), _bucket(backend)
    keys = ["p/a-b", "p/a.b", "p/a/x", "p/a0"]  # UTF-8 binary order: '-' < '.' < '/' < '0'
    for key in reversed(keys):
        client.put_object(Bucket=bucket, Key=key, Body=b"")
    listed = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="p/")["Contents"]]
    # AWS documents UTF-8 binary order (moto keeps it); SeaweedFS lists a "directory" before the
    # sibling keys that sort before its name. opd_store never relies on the order of a listing.
    assert listed == (keys if server_name == "moto_s3" else ["p/a/x", "p/a-b", "p/a.b", "p/a0"])
    fs = backend.raw_fs()
    assert sorted(fs.find(f"{bucket}/p")) == sorted(f"{bucket}/{k}" for k in keys)


@SERVERS
def test_a_refused_conditional_completion_leaves_its_upload_open(server):
    backend = server.new_backend()
    client, bucket = server.boto3_client(), _bucket(backend)
    client.put_object(Bucket=bucket, Key="k", Body=b"first")
    upload = client.create_multipart_upload(Bucket=bucket, Key="k")["UploadId"]
    part = client.upload_part(Bucket=bucket, Key="k", UploadId=upload, PartNumber=1, Body=b"x")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        client.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=upload, IfNoneMatch="*",
                                         MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"first"
    # Both enforce the condition on completion, and neither aborts the upload: its client must.
    assert [u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == [upload]
    client.abort_multipart_upload(Bucket=bucket, Key="k", UploadId=upload)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@SERVERS
def test_aborting_an_aborted_upload(server, server_name):
    backend = server.new_backend()
    client, bucket = server.boto3_client(), _bucket(backend)
    upload = client.create_multipart_upload(Bucket=bucket, Key="k")["UploadId"]
    client.abort_multipart_upload(Bucket=bucket, Key="k", UploadId=upload)
    if server_name == "moto_s3":
        with pytest.raises(botocore.exceptions.ClientError) as missing:
            client.abort_multipart_upload(Bucket=bucket, Key="k", UploadId=upload)
        assert classify(missing.value) is Meaning.NOT_FOUND  # NoSuchUpload, 404
    else:
        answer = client.abort_multipart_upload(Bucket=bucket, Key="k", UploadId=upload)
        assert answer["ResponseMetadata"]["HTTPStatusCode"] == 204


def _one_attempt_client(server):
    """A boto3 client of ``server`` that makes one attempt per call: botocore's default (legacy)
    retry rules send a part refused with ``BadDigest`` 4 more times, with back-offs of up to 15 s."""
    import boto3
    from botocore.config import Config
    from opd_testkit.stores import EMULATOR_ENV

    return boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=EMULATOR_ENV["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=EMULATOR_ENV["AWS_SECRET_ACCESS_KEY"],
                        region_name=EMULATOR_ENV["AWS_DEFAULT_REGION"], config=Config(retries={"total_max_attempts": 1}))


@SERVERS
def test_part_checksums(server, server_name):
    from opd_store.format import crc32c_base64

    backend = server.new_backend()
    client, bucket = _one_attempt_client(server), _bucket(backend)
    part = b"p" * (64 << 10)  # one part, so also the last: any size (the checks do not depend on it)
    # A part whose ChecksumCRC32C is not its bytes': AWS and SeaweedFS refuse it (BadDigest); moto
    # stores it (it checks no checksum), so the altered-part tests run on SeaweedFS.
    upload = client.create_multipart_upload(Bucket=bucket, Key="bad", ChecksumAlgorithm="CRC32C")["UploadId"]
    if server_name == "moto_s3":
        client.upload_part(Bucket=bucket, Key="bad", UploadId=upload, PartNumber=1, Body=part,
                           ChecksumCRC32C=crc32c_base64(b"other"))
    else:
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            client.upload_part(Bucket=bucket, Key="bad", UploadId=upload, PartNumber=1, Body=part,
                               ChecksumCRC32C=crc32c_base64(b"other"))
        assert refused.value.response["Error"]["Code"] == "BadDigest"
    client.abort_multipart_upload(Bucket=bucket, Key="bad", UploadId=upload)
    # A CRC32C upload completed without its parts' checksums: SeaweedFS refuses it (InvalidRequest);
    # moto completes it. opd_store always sends them (and the object is then whole on both).
    for with_checksums in (False, True):
        upload = client.create_multipart_upload(Bucket=bucket, Key="k", ChecksumAlgorithm="CRC32C")["UploadId"]
        etag = client.upload_part(Bucket=bucket, Key="k", UploadId=upload, PartNumber=1, Body=part,
                                  ChecksumCRC32C=crc32c_base64(part))["ETag"]
        entry = {"PartNumber": 1, "ETag": etag, **({"ChecksumCRC32C": crc32c_base64(part)} if with_checksums else {})}
        if server_name == "seaweed_s3" and not with_checksums:
            with pytest.raises(botocore.exceptions.ClientError) as refused:
                client.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=upload, MultipartUpload={"Parts": [entry]})
            assert refused.value.response["Error"]["Code"] == "InvalidRequest"
            client.abort_multipart_upload(Bucket=bucket, Key="k", UploadId=upload)
            continue
        client.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=upload, MultipartUpload={"Parts": [entry]})
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == part
