"""A copy (``opd-store cp``, ``copy_checkpoint``, and ``migrate`` from a bucket) reads its source bucket over several
connections in bounded memory, on both S3 servers of the suite (moto and SeaweedFS) and on GCS
(fake-gcs-server; the CLI and migrate tests run on moto only: their set-up speaks S3, and the
ranged reads they use are proven on SeaweedFS by the copy tests here and by
``test_parallel_transfers.py``'s ranged-read rows): ranged GETs of
``part_size_bytes``, ``parts_in_flight`` of them at once, each into a reused part buffer of the
source store's read pool, handed to the destination in order. Proven at a proxy in front of the
server: which ranges were asked for, how many were held in flight at once, what the read pool
allocated, and what a short or altered range does to the copy (nothing committed).

Every store uses S3's smallest part (5 MiB) and 3 ranges in flight, so that a payload of a little
over 15 MiB is four ranges and the fourth can only start once the first was handed out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import runpy
import threading
import warnings
from pathlib import Path

import pytest
import torch
from core.helpers import save
from opd_testkit.opd import PROVENANCE, StubAdapterModel, TinyConfig, make_training, trainer_state
from opd_testkit.proxies import S3FaultProxy, through_proxy
from opd_testkit.stores import open_store
from opd_testkit.transfer_dialects import dialect_of

from opd_store import CheckpointStore, IntegrityError
from opd_store.cli import main as cli_main
from opd_store.opd import migrate_legacy
from opd_store.storage.transfers._parts import MIN_PART_SIZE_BYTES
from opd_store.store import copy_checkpoint

PART = MIN_PART_SIZE_BYTES
IN_FLIGHT = 3
LARGE = bytes((i * 13 + 5) % 251 for i in range(251)) * ((3 * PART + PART // 5) // 251)  # four ranges
SMALL = b"small payload " * 10
RANGES = [f"bytes={s}-{min(len(LARGE), s + PART) - 1}" for s in range(0, len(LARGE), PART)]


@pytest.fixture(params=["moto_s3", "seaweed_s3", "fake_gcs"])
def server(request):
    """One of the suite's bucket servers (moto's mock, SeaweedFS's production server, fake-gcs-server)."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def committed(server):
    """A clean bucket whose store holds step 2 (``model.bin``: :data:`LARGE`, ``small.bin``),
    written straight to the server: the backend."""
    backend = server.new_backend()
    save(open_store(backend), 2, {"model.bin": LARGE, "small.bin": SMALL})
    return backend


def _source(backend, proxy) -> CheckpointStore:
    """The store of ``backend`` read through ``proxy`` with 5 MiB ranges, 3 in flight."""
    return open_store(through_proxy(backend, proxy, part_size_bytes=PART, parts_in_flight=IN_FLIGHT))


def _model_gets(proxy, backend) -> list:
    dialect = dialect_of(backend)
    return [r for r in proxy.requests if r.op == dialect.get_op and dialect.names(r, "model.bin")]


def _ranges(requests) -> list[str]:
    """The ``Range`` headers of ``requests``, by first byte."""
    return sorted((r.headers["range"] for r in requests), key=lambda h: int(h[len("bytes="):].partition("-")[0]))


def _holding_model_gets(backend):
    """A hold proxy in front of ``backend``'s server holding every read of ``model.bin``'s bytes."""
    dialect = dialect_of(backend)
    return dialect.hold_proxy(backend.storage_options["endpoint_url"],
                              lambda method, path: method == "GET" and "model.bin" in path
                              and (dialect.name == "s3" or "alt=media" in path))


def _fetches_running(loop) -> int:
    """asyncio tasks of range fetches still on ``loop`` (s3fs's event loop)."""
    from fsspec.asyn import sync

    async def count() -> int:
        return sum(1 for task in asyncio.all_tasks() if "range_fetcher" in task.get_coro().__qualname__)

    return sync(loop, count)


def test_cp_to_local_keeps_ranges_in_flight_in_bounded_buffers(committed, tmp_path):
    """Three ranges are in flight at once (all held by the proxy) and no fourth starts until the
    first is handed out; the copy is bit exact, every range was asked for once, and the read pool
    made three buffers for both payloads."""
    proxy = _holding_model_gets(committed)
    try:
        src, dst = _source(committed, proxy), CheckpointStore(tmp_path / "copy")
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(copy_checkpoint(src, 2, dst)), daemon=True)
        thread.start()
        held = proxy.wait_held(IN_FLIGHT)
        pool = src.storage.transfers.read_pool
        assert pool.stats()["in_use"] == IN_FLIGHT and pool.stats()["allocated"] == IN_FLIGHT
        assert _ranges(_model_gets(proxy, committed)) == RANGES[:IN_FLIGHT]
        assert len(held) == IN_FLIGHT and thread.is_alive() and dst.steps() == []
        proxy.release()
        thread.join(120)
        assert outcome == [dst.step_url(2)]
        assert dst.read(2, "model.bin") == LARGE and dst.read(2, "small.bin") == SMALL
        gets = _model_gets(proxy, committed)
        assert _ranges(gets) == RANGES
        assert sum(r.response_bytes for r in gets) == len(LARGE)
        assert proxy.count(dialect_of(committed).stat_op) == 0  # planned from the manifest's sizes
        assert pool.stats() == {"in_use": 0, "in_flight": 0, "free": IN_FLIGHT, "allocated": IN_FLIGHT,
                                "peak_in_use": IN_FLIGHT}
    finally:
        proxy.stop()


def test_cli_cp_s3_to_s3_is_bit_exact(moto_s3):
    """``opd-store cp`` from one bucket prefix to another: the source read in ranges, the copy
    committed with the source's entries and bit exact."""
    committed = moto_s3.new_backend()
    save(open_store(committed), 2, {"model.bin": LARGE, "small.bin": SMALL})
    proxy = S3FaultProxy(committed.storage_options["endpoint_url"])
    try:
        options = through_proxy(committed, proxy).storage_options
        args = ["--s3-endpoint-url", proxy.endpoint_url, "--dst-s3-endpoint-url", options["endpoint_url"]]
        for prefix in ("", "dst-"):
            for setting in (f"key={options['key']}", f"secret={options['secret']}", f"part_size_bytes={PART}",
                            f"parts_in_flight={IN_FLIGHT}"):
                args += [f"--{prefix}storage-option", setting]
        dst_url = committed.url.replace("/runs/demo", "/runs/copy")
        assert cli_main(["cp", committed.url, "2", dst_url, *args]) == 0
        src = open_store(committed)
        dst = open_store(dataclasses.replace(committed, url=dst_url))
        assert dst.read(2, "model.bin") == LARGE and dst.read(2, "small.bin") == SMALL
        assert [(e.name, e.size_bytes, e.crc32c) for e in dst.manifest(2).payloads] == \
            [(e.name, e.size_bytes, e.crc32c) for e in src.manifest(2).payloads]
        source_gets = [r for r in _model_gets(proxy, committed) if "/runs/demo/" in r.path]
        assert _ranges(source_gets) == RANGES
    finally:
        proxy.stop()


def test_a_short_or_altered_range_fails_the_copy_and_commits_nothing(committed, tmp_path):
    """The second range answers half its bytes (well formed) or its bytes altered: the copy raises
    :class:`IntegrityError` naming the step, the payload and (short) the range; the destination
    holds no step and no object. Both kinds copy the same committed source, each into a destination
    of its own through a fresh proxy."""
    dialect = dialect_of(committed)
    for kind in ("short", "corrupt"):
        proxy = dialect.fault_proxy(committed.storage_options["endpoint_url"])
        try:
            rule = proxy.add(ops=(dialect.get_op,), times=1, fault=kind,
                             match=lambda r: dialect.names(r, "model.bin") and r.headers.get("range") == RANGES[1])
            dst = CheckpointStore(tmp_path / f"copy-{kind}")
            with pytest.raises(IntegrityError) as caught:
                copy_checkpoint(_source(committed, proxy), 2, dst)
            assert rule.hits == 1, kind
            message = str(caught.value)
            assert message.startswith("step 2: source payload 'model.bin'") and f"nothing committed at {dst.url}" in message
            if kind == "short":
                assert f"/model.bin: a ranged read of bytes {PART}-{2 * PART - 1} returned {PART // 2} bytes" in message
            else:
                assert f"expected {len(LARGE)} bytes" in message and f"read {len(LARGE)} bytes" in message
            assert dst.steps() == [] and dst.storage.list_tree("") == {}, kind
        finally:
            proxy.stop()


@pytest.mark.usefixtures("gc_of_this_test")  # its gc.collect() scans only what the test made
def test_closing_a_reader_early_cancels_its_ranges(committed):
    """A reader closed while its three ranges are held at the proxy: every fetch task has settled
    when ``close`` returns, its buffers are back in the pool, no coroutine was left unawaited."""
    proxy = _holding_model_gets(committed)
    try:
        src = _source(committed, proxy)
        entry = next(e for e in src.manifest(2).payloads if e.name == "model.bin")
        storage = src.storage
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader = storage.open_read_stream(f"step-000002/{entry.path}", entry.size_bytes)
            proxy.wait_held(IN_FLIGHT)
            assert _fetches_running(storage.fs.loop) == IN_FLIGHT
            reader.close()
            assert _fetches_running(storage.fs.loop) == 0
            del reader
            gc.collect()
        assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
        assert storage.transfers.read_pool.stats() == {"in_use": 0, "in_flight": 0, "free": IN_FLIGHT,
                                               "allocated": IN_FLIGHT, "peak_in_use": IN_FLIGHT}
        assert len(proxy.held) == IN_FLIGHT  # the fourth range never started
    finally:
        proxy.stop()


def test_migrate_from_a_bucket_streams_the_adapter_in_ranges(moto_s3, tmp_path):
    """``migrate_legacy`` from a seed layout in a bucket: the adapter's weights (two ranges) stream
    through parallel ranged GETs, the pickled files are read whole, the copy is bit exact."""
    seed_layout = runpy.run_path(str(Path(__file__).parents[1] / "opd" / "seed_layout.py"))
    model = StubAdapterModel()
    model.weights = {"lora_A.weight": torch.arange(int(1.3 * PART) // 4, dtype=torch.float32)}
    _layer, optimizer, scheduler = make_training()
    seed_layout["write_seed_checkpoint"](
        checkpoints_dir=tmp_path / "seed", model=model, processor=None, optimizer=optimizer,
        scheduler=scheduler, trainer_state=trainer_state(2), config=TinyConfig(),
        provenance_fingerprints=dict(PROVENANCE), teacher_state={"update_count": 2})
    backend = moto_s3.new_backend()
    bucket, _, prefix = backend.url[len("s3://"):].partition("/")
    files = {p.relative_to(tmp_path / "seed").as_posix(): p.read_bytes() for p in (tmp_path / "seed").rglob("*")
             if p.is_file()}
    for rel, data in files.items():
        moto_s3.boto3_client().put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=data)
    proxy = S3FaultProxy(backend.storage_options["endpoint_url"])
    try:
        assert migrate_legacy(_source(backend, proxy), tmp_path / "migrated") == [str(tmp_path / "migrated" / "step-000002")]
        migrated = CheckpointStore(tmp_path / "migrated")
        for name in migrated.names(2):
            assert migrated.read(2, name) == files[f"step-000002/{name}"], name
        weights = "adapter/adapter_model.safetensors"
        size = len(files[f"step-000002/{weights}"])
        gets = [r for r in proxy.requests if r.op == "GetObject" and r.path.endswith("/" + weights)]
        assert size > PART and _ranges(gets) == [f"bytes=0-{PART - 1}", f"bytes={PART}-{size - 1}"]
    finally:
        proxy.stop()
