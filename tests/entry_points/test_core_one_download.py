"""A resume reads each byte once (docs/resume.md, "One download per resume"), counted against the S3
server: moto behind a proxy that records every request with its ``Range``
(:func:`opd_testkit.reads.payload_reads`: ``(1, 1)`` is every byte of a payload read exactly once).

The Python API (``latest_complete_checkpoint``, ``load_adapter``, ``load_opd_checkpoint``), a sharded
resume (``load_sharded_opd_checkpoint``: two DCP loads, the small state and the tensors, both in the
same rank file) and ``opd_store.dcp.load``. The main job's resume is in test_core_job.py.
"""

from __future__ import annotations

import pytest
import torch
from opd_testkit import opd as objects
from opd_testkit.reads import payload_reads
from opd_testkit.stores import open_store

from opd_store import dcp
from opd_store.opd import (
    latest_complete_checkpoint,
    load_adapter,
    load_opd_checkpoint,
    load_sharded_opd_checkpoint,
    save_opd_checkpoint,
    save_sharded_opd_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_the_python_api_reads_each_payload_once(s3_fault_proxy, peft_factory):
    backend, proxy = s3_fault_proxy
    store = open_store(backend)
    model = peft_factory.model()
    for successful in (2, 4):
        save_opd_checkpoint(**objects.save_kwargs(store, successful=successful, model=model,
                                                  processor=peft_factory.tokenizer()))
    del proxy.requests[:]
    url = latest_complete_checkpoint(store)
    assert url == store.step_url(4)
    assert set(payload_reads(proxy.requests, backend, 4, store.manifest(4)).values()) == {(0, 0)}  # none read yet
    load_adapter(url, peft_factory.model(lora_seed=7), storage_options=store.storage_options)
    state = load_opd_checkpoint(url, **objects.load_kwargs(storage_options=store.storage_options))
    assert state["successful_updates"] == 4
    reads = payload_reads(proxy.requests, backend, 4, store.manifest(4))
    loaded = {name for name in reads if name.startswith("adapter/adapter_model") or name.startswith("processor/")
              or name in ("training_state.pt", "rng.pt")}
    assert {reads[name] for name in loaded} == {(1, 1)}, reads
    assert all(times in ((0, 0), (1, 1)) for times in reads.values()), reads
    assert set(payload_reads(proxy.requests, backend, 2, store.manifest(2)).values()) == {(0, 0)}


def _student(seed: int):
    from opd_store.job import build_student

    model = build_student(vocab_size=32, seed=seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)


def test_a_sharded_resume_and_a_dcp_load_read_each_file_once(s3_fault_proxy):
    from opd_store.opd._sharded import MODEL_KEY, student_state_dicts

    backend, proxy = s3_fault_proxy
    store = open_store(backend)
    model, optimizer, scheduler = _student(0)
    save_sharded_opd_checkpoint(checkpoints_dir=store, model=model, optimizer=optimizer, scheduler=scheduler,
                                trainer_state=objects.trainer_state(2), config=objects.TinyConfig(),
                                provenance_fingerprints=dict(objects.PROVENANCE), teacher_state={"update_count": 2})
    manifest = store.manifest(2)
    files = {entry.name for entry in manifest.payloads if entry.name != "config.yaml"}
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files)

    del proxy.requests[:]
    fresh, fresh_optimizer, fresh_scheduler = _student(1)
    resumed = load_sharded_opd_checkpoint(
        store.step_url(2), model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler,
        config=objects.TinyConfig(), provenance_fingerprints=dict(objects.PROVENANCE),
        teacher_state_loader=lambda state: None, storage_options=store.storage_options)
    assert resumed.trainer_state["successful_updates"] == 2
    saved = {name: p for name, p in model.named_parameters() if p.requires_grad}  # a LoRA student saves these
    assert saved and all(torch.equal(p, saved[name]) for name, p in fresh.named_parameters() if name in saved)
    reads = payload_reads(proxy.requests, backend, 2, manifest)
    assert {reads[name] for name in files} == {(1, 1)}, reads  # both DCP loads from one download

    del proxy.requests[:]
    other, other_optimizer, _scheduler = _student(2)
    state, _optim = student_state_dicts(other, other_optimizer)
    dcp.load({MODEL_KEY: state}, store, 2)
    reads = payload_reads(proxy.requests, backend, 2, manifest)
    assert {reads[name] for name in files} == {(1, 1)}, reads
