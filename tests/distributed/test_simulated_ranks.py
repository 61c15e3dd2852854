"""Sixteen virtual ranks (opd_testkit.simulation) through opd_store's own multi-rank and DCP write
paths, against moto behind the request-rate proxy (opd_testkit.rate_limit): with every payload
under one prefix the save is throttled and still commits; spread over prefixes it is not. The large
N (up to 512) run in ``python -m bench.simulation`` (docs/performance.md)."""

from __future__ import annotations

import pytest
from opd_testkit.rate_limit import RateLimitProxy, RateLimits
from opd_testkit.simulation import DCP, SimSpec, lower_moto_min_part, rank_payload, simulate
from opd_testkit.stores import aio_session

from opd_store import CheckpointStore

RANKS = 16
PART = 64 << 10
PREFIXES = 16


@pytest.fixture
def throttled_bucket(moto_s3):
    """``(url, storage options, proxy)``: a clean bucket behind a proxy allowing 40 writes per
    second per partition (a quarter of a second of burst: 10 writes at once), the 16 spread
    prefixes partitioned."""
    moto_s3.new_backend(bucket="opd-sim")
    partitions = tuple(f"opd-sim/run/.spread/{i:02x}/" for i in range(PREFIXES))
    proxy = RateLimitProxy(moto_s3.endpoint_url, RateLimits(prefix_writes_per_sec=40, prefix_reads_per_sec=None,
                                                            partitions=partitions, burst_secs=0.25))
    options = dict(moto_s3.storage_options(), endpoint_url=proxy.endpoint_url, session=aio_session())
    with lower_moto_min_part(PART):
        yield "s3://opd-sim/run", options, proxy
    proxy.stop()


def test_one_prefix_is_throttled_and_the_spread_layout_is_not(throttled_bucket):
    url, options, proxy = throttled_bucket
    outcomes = {}
    for step, layout in ((1, "step"), (2, "spread")):
        proxy.reset()
        spec = SimSpec(world_size=RANKS, step=step, state_bytes=2 * PART, part_size_bytes=PART, key_layout=layout,
                       key_prefixes=PREFIXES)
        result = simulate(spec, url, options)
        assert result.errors == {} and result.url == f"{url}/step-{step:06d}"
        outcomes[layout] = (result, proxy.stats())
    store = CheckpointStore(url, storage_options={k: v for k, v in options.items() if k != "session"})
    for step, layout in ((1, "step"), (2, "spread")):
        manifest = store.manifest(step)
        assert (manifest.world_size, manifest.layout.strategy, len(manifest.payloads)) == (RANKS, layout, RANKS + 1)
        assert store.read(step, "shard-00007.bin") == rank_payload(7, 2 * PART)
        assert store.verify(step).ok
    one, one_stats = outcomes["step"]
    spread, spread_stats = outcomes["spread"]
    # The real request pattern: per rank one upload created, 2 parts, one completion.
    for stats in (one_stats, spread_stats):
        admitted = {op: n - stats["throttled_by_op"].get(op, 0) for op, n in stats["by_op"].items()}
        assert (admitted["CreateMultipartUpload"], admitted["UploadPart"], admitted["CompleteMultipartUpload"]) == (
            RANKS, 2 * RANKS, RANKS)
    # Every rank starts at once: one partition refuses what its burst cannot hold, and the ranks'
    # pacers hear it; spread over 16 partitions of the same rate, nothing is refused.
    assert one_stats["throttled"] > 0 and one.total("throttled_answers") == one_stats["throttled"]
    assert spread_stats["throttled"] == 0 and spread.total("throttled_answers") == 0
    assert len([p for p in spread_stats["by_partition"] if p]) == PREFIXES


def test_the_dcp_write_path_of_sixteen_ranks(throttled_bucket):
    url, options, proxy = throttled_bucket
    spec = SimSpec(world_size=RANKS, step=3, state_bytes=2 * PART, part_size_bytes=PART, key_layout="spread",
                   key_prefixes=PREFIXES, path=DCP)
    result = simulate(spec, url, options)
    assert result.errors == {} and result.url == f"{url}/step-000003"
    store = CheckpointStore(url, storage_options={k: v for k, v in options.items() if k != "session"})
    manifest = store.manifest(3)
    assert manifest.metadata["checkpoint_format"] == "dcp" and manifest.metadata["dcp_world_size"] == RANKS
    assert sorted(e.name for e in manifest.payloads) == sorted([".metadata", *(f"__{r}_1.distcp" for r in range(RANKS))])
    assert len({e.prefix for e in manifest.payloads if e.name != ".metadata"}) == PREFIXES
    assert store.verify(3, deep=True).ok
    assert proxy.stats()["throttled"] == 0
