"""S3's request-rate limits on loopback (opd_testkit.rate_limit): token buckets per partitioned
prefix and per bucket, reads and writes apart, ``503 SlowDown`` with S3's XML error above them,
every request recorded. The limiter runs on a clock the test moves, so the answers are exact."""

from __future__ import annotations

import pytest
from opd_testkit.rate_limit import UNPARTITIONED, RateLimitProxy, RateLimits, RequestRateLimiter, request_key


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0  # moved in steps of 1/8 s: exact in binary, so token counts are too

    def __call__(self) -> float:
        return self.now


def test_token_buckets_per_partition_and_per_bucket():
    clock = Clock()
    limits = RateLimits(prefix_writes_per_sec=10, prefix_reads_per_sec=20, bucket_writes_per_sec=20,
                        partitions=("b/run/.spread/00/", "b/run/.spread/01/"), burst_secs=0.2)
    limiter = RequestRateLimiter(limits, clock)
    put = lambda key: limiter.admit("PUT", f"/b/{key}")[0]  # noqa: E731 - a name for the table below
    # Each partition holds 2 writes (10/s x 0.2 s); the unpartitioned range is one more partition.
    assert [put("run/.spread/00/step-000001/a") for _ in range(3)] == [True, True, False]
    assert [put("run/.spread/01/step-000001/a") for _ in range(2)] == [True, True]
    assert put("run/step-000001/manifest.json") is False  # the bucket's 4 writes (20/s x 0.2 s) are taken
    assert limiter.admit("GET", "/b/run/.spread/00/step-000001/a") == (True, "b/run/.spread/00/", "read")
    clock.now += 0.125  # 1.25 writes per partition and 2.5 for the bucket come back
    assert [put("run/.spread/00/x"), put("run/.spread/01/x"), put("run/step-000001/x")] == [True, True, False]
    clock.now += 1.0
    assert put("run/step-000001/x") and limiter.partition_of("b/run/step-000001/x") == UNPARTITIONED
    # A listing draws on the partition of its prefix; a refused request takes no token.
    assert request_key("GET", "/b", "list-type=2&prefix=run%2F.spread%2F01%2Fstep") == "b/run/.spread/01/step"
    assert limiter.partition_of(request_key("GET", "/b", "list-type=2&prefix=run%2F.spread%2F01%2F")) == \
        "b/run/.spread/01/"


def test_limits_are_checked():
    with pytest.raises(ValueError, match="prefix_writes_per_sec must be > 0"):
        RateLimits(prefix_writes_per_sec=0)
    limits = RateLimits(bucket_writes_per_sec=300, partitions=("b/p/",))
    assert RateLimits.from_json(limits.to_json()) == limits


def test_the_proxy_answers_slowdown_above_the_rate_and_records_every_request(moto_s3):
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    moto_s3.new_backend(bucket="opd-rates")
    clock = Clock()
    proxy = RateLimitProxy(moto_s3.endpoint_url, RateLimits(prefix_writes_per_sec=1, prefix_reads_per_sec=None,
                                                            burst_secs=1.0), clock)
    client = boto3.client("s3", endpoint_url=proxy.endpoint_url, region_name="us-east-1",
                          config=Config(retries={"total_max_attempts": 1, "mode": "legacy"}))
    try:
        client.put_object(Bucket="opd-rates", Key="a.bin", Body=b"first")
        with pytest.raises(ClientError) as refused:
            client.put_object(Bucket="opd-rates", Key="b.bin", Body=b"second")
        error = refused.value.response
        assert (error["ResponseMetadata"]["HTTPStatusCode"], error["Error"]["Code"], error["Error"]["Message"]) == (
            503, "SlowDown", "Please reduce your request rate.")  # S3's XML error, parsed by botocore
        assert client.get_object(Bucket="opd-rates", Key="a.bin")["Body"].read() == b"first"  # reads: no limit
        clock.now += 1.0
        client.put_object(Bucket="opd-rates", Key="b.bin", Body=b"second")
        assert [(r.op, r.fault) for r in proxy.requests] == [
            ("PutObject", None), ("PutObject", "503 SlowDown"), ("GetObject", None), ("PutObject", None)]
        assert [r.status for r in proxy.requests[:3]] == [200, 503, 200]
        stats = proxy.stats()
        assert (stats["requests"], stats["throttled"], stats["writes"], stats["throttled_by_op"]) == (
            4, 1, 3, {"PutObject": 1})
        assert moto_s3.boto3_client().get_object(Bucket="opd-rates", Key="b.bin")["Body"].read() == b"second"
    finally:
        proxy.stop()
