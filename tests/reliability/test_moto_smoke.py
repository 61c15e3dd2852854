"""s3fs talks to moto's server over HTTP: list, write, read, multipart, delete. The same check runs
when the session's server starts (``tests/conftest.py``), so it precedes every S3 test and a
failure names the step; here its observations are asserted value by value."""

from __future__ import annotations


def test_s3fs_list_write_read_multipart_delete_over_http(moto_s3):
    assert moto_s3.endpoint_url.startswith("http://127.0.0.1:")
    seen = moto_s3.smoke_check()
    assert seen["listed"] == ["opd-smoke/smoke/small.bin"]
    assert seen["read_back"] == b"opd-store smoke"
    # 2 x 5 MiB + 1 KiB in 5 MiB blocks: three parts, and S3's multipart ETag says so.
    assert seen["parts"] == 3
    assert seen["multipart_etag"].strip('"').endswith("-3")
    assert seen["after_delete"] == 0
