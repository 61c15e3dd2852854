"""Every write path moves a payload larger than one part as parallel parts, on S3 (moto) and on
GCS (fake-gcs-server): an OPD save, an asynchronous save, a rank's part of a multi-rank save, the
tier upload of a tiered store, ``opd-store cp`` and ``opd-store migrate``. Every path hands its
payload to the one part writer of the store's backend; that writer's multipart uploads on
SeaweedFS are proven in ``test_parallel_transfers.py`` (its ``seaweed_s3`` rows: parts in flight,
sizes around a part, checksums), so the paths are not run a third time there.
Each is counted at a recording proxy: on S3 the large payload goes up as one
``CreateMultipartUpload``, its parts (5 MiB, then the rest) and one ``CompleteMultipartUpload``; on
GCS as its parts (temporary objects) and one ``compose``; the manifest is the last request that
writes.

s3fs's own file writer (what the stores used before) would have sent this payload as one
``PutObject`` (its default block is 50 MiB), gcsfs's as one resumable upload.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from opd_testkit.gcs import gcs_object
from opd_testkit.opd import (
    PROVENANCE,
    StubAdapterModel,
    TinyConfig,
    make_training,
    save_kwargs,
    trainer_state,
)
from opd_testkit.proxies import through_proxy
from opd_testkit.stores import open_store
from opd_testkit.transfer_dialects import GCS, S3, dialect_of

from opd_store import AsyncCheckpointer, CheckpointStore, TieredStore, save_opd_checkpoint
from opd_store.cli import main as cli_main
from opd_store.storage.transfers._parts import MIN_PART_SIZE_BYTES

PART = MIN_PART_SIZE_BYTES


@pytest.fixture(params=["moto_s3", "fake_gcs"])
def proxied(request):
    """A clean bucket on moto or fake-gcs-server behind a recording proxy: (backend, proxy)."""
    server = request.getfixturevalue(request.param)
    backend = server.new_backend()
    proxy = dialect_of(backend).proxy(server.endpoint_url)
    try:
        yield through_proxy(backend, proxy, part_size_bytes=PART, parts_in_flight=4), proxy
    finally:
        proxy.stop()


def _large_model() -> StubAdapterModel:
    """An adapter whose weights file is a little over one part (two parts: 5 MiB, then 64 KiB and
    the file's header)."""
    model = StubAdapterModel()
    model.weights = {"lora_A.weight": torch.arange((PART + (64 << 10)) // 4, dtype=torch.float32)}
    return model


def assert_uploaded_in_parts(proxy, name: str, size_bytes: int) -> None:
    """``name`` went up in 5 MiB parts (S3: a multipart upload; GCS: temporary objects composed into
    it, then deleted), and the manifest was written last."""
    dialect = GCS if isinstance(proxy, GCS.proxy) else S3
    mine = [r for r in proxy.requests if dialect.names(r, name) and r.op in dialect.writes]
    assembly = ["Compose"] if dialect is GCS else ["CreateMultipartUpload", "CompleteMultipartUpload"]
    assert [r.op for r in mine if r.op != dialect.part_op] == assembly
    parts = [r for r in mine if r.op == dialect.part_op]
    expected = [PART] * (size_bytes // PART) + ([size_bytes % PART] if size_bytes % PART else [])
    assert sorted(r.request_bytes for r in parts) == sorted(expected)
    assert sorted(dialect.part_number(r) for r in parts) == list(range(1, len(expected) + 1))
    writes = [r for r in proxy.requests if r.op in dialect.writes]
    assert writes[-1].op == dialect.create_op and (dialect is GCS or writes[-1].path.endswith("/manifest.json"))
    if dialect is GCS:  # every temporary part object deleted before the manifest
        deleted = [r for r in proxy.requests if r.op == "DeleteObject" and ".part-" in gcs_object(r)
                   and dialect.names(r, name)]
        assert len(deleted) == len(expected)
        assert proxy.requests.index(deleted[-1]) < proxy.requests.index(writes[-1])


def _adapter_entry(store, step: int):
    return next(e for e in store.manifest(step).payloads if e.name.endswith("adapter_model.safetensors"))


def test_opd_save(proxied):
    backend, proxy = proxied
    store = open_store(backend)
    save_opd_checkpoint(**save_kwargs(store, model=_large_model()))
    entry = _adapter_entry(store, 2)
    assert entry.size_bytes > PART
    assert_uploaded_in_parts(proxy, "adapter_model.safetensors", entry.size_bytes)


def test_async_save(proxied):
    backend, proxy = proxied
    store = open_store(backend)
    with AsyncCheckpointer() as checkpointer:
        checkpointer.save(**save_kwargs(store, model=_large_model())).result(120)
    assert_uploaded_in_parts(proxy, "adapter_model.safetensors", _adapter_entry(store, 2).size_bytes)


def test_a_ranks_part(proxied):
    backend, proxy = proxied
    store, part_store = open_store(backend), open_store(backend)
    data = bytes(range(256)) * ((PART + (64 << 10)) // 256)  # two parts
    txn = store.begin(7, world_size=2)
    txn.write_bytes("shared.bin", b"shared")
    with part_store.begin_part(7, attempt_id=txn.attempt_id, rank=1, world_size=2) as part:
        part.write_bytes("rank-01.bin", data)
    for entry in part.entries:
        txn.add_entry(entry)
    txn.commit()
    assert_uploaded_in_parts(proxy, "rank-01.bin", len(data))
    assert store.read(7, "rank-01.bin") == data


def test_tier_upload(proxied, tmp_path):
    backend, proxy = proxied
    tiered = TieredStore(tmp_path / "local-tier", backend.url, storage_options=backend.storage_options)
    try:
        save_opd_checkpoint(**save_kwargs(tiered, model=_large_model()))
        tiered.flush(120)
    finally:
        tiered.close()
    bucket = CheckpointStore(backend.url, storage_options=backend.storage_options)
    assert_uploaded_in_parts(proxy, "adapter_model.safetensors", _adapter_entry(bucket, 2).size_bytes)


def _cli_options(backend, prefix: str = "") -> list[str]:
    """Command-line options that reach ``backend`` with 5 MiB parts (``prefix``: ``dst-`` for cp)."""
    options = backend.storage_options
    if backend.name == "gcs":
        settings = [f"{key}={options[key]}" for key in ("endpoint_url", "token", "project")]
        return [arg for setting in settings + [f"part_size_bytes={PART}"] for arg in (f"--{prefix}storage-option", setting)]
    return [f"--{prefix}s3-endpoint-url", options["endpoint_url"]] + [
        arg for setting in (f"key={options['key']}", f"secret={options['secret']}", f"part_size_bytes={PART}")
        for arg in (f"--{prefix}storage-option", setting)]


def test_cli_cp(proxied, tmp_path):
    backend, proxy = proxied
    local = CheckpointStore(tmp_path / "local")
    save_opd_checkpoint(**save_kwargs(local, model=_large_model()))
    assert cli_main(["cp", str(tmp_path / "local"), "2", backend.url, *_cli_options(backend, "dst-")]) == 0
    assert_uploaded_in_parts(proxy, "adapter_model.safetensors", _adapter_entry(local, 2).size_bytes)


def test_cli_migrate(proxied, tmp_path):
    backend, proxy = proxied
    seed_layout = runpy.run_path(str(Path(__file__).parents[1] / "opd" / "seed_layout.py"))
    _layer, optimizer, scheduler = make_training()
    seed_layout["write_seed_checkpoint"](
        checkpoints_dir=tmp_path / "seed", model=_large_model(), processor=None, optimizer=optimizer,
        scheduler=scheduler, trainer_state=trainer_state(2), config=TinyConfig(),
        provenance_fingerprints=dict(PROVENANCE), teacher_state={"update_count": 2})
    assert cli_main(["migrate", str(tmp_path / "seed"), backend.url, *_cli_options(backend)]) == 0
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    assert_uploaded_in_parts(proxy, "adapter_model.safetensors", _adapter_entry(store, 2).size_bytes)
