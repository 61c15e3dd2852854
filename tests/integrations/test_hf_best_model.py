"""What the Trainer still refers to is kept: its best checkpoint (``state.best_model_checkpoint``)
survives store retention while it is best, ``store_checkpoint`` fetches it with the resumed step,
and ``load_best_model_at_end`` on a fresh machine ends on the same weights as an uninterrupted run,
bit for bit. The resume on S3 downloads each payload once (request counts at the proxy)."""

from __future__ import annotations

import re
import shutil

import torch
from opd_testkit.hf import tiny_trainer, weights
from transformers import TrainerCallback

from opd_store import CheckpointStore
from opd_store.integrations.transformers import StoreCallback, store_checkpoint
from opd_store.retention import RetentionPolicy

SCORES = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.2}  # the best checkpoint is step 2 of 4
RUN = dict(scores=SCORES, save_steps=1, save_total_limit=1, learning_rate=1e-2)


class Crash(Exception):
    pass


class CrashAfterSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise Crash


def _ranges_read(proxy, backend, rel: str) -> list[tuple[int, int | None]]:
    """(first, last) byte of every GET of ``rel`` at the proxy (``None``: to the end)."""
    path = "/" + backend.url[len("s3://"):] + "/" + rel
    ranges = []
    for request in proxy.requests:
        if request.op == "GetObject" and request.path == path:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", request.headers.get("range", "bytes=0-"))
            ranges.append((int(match[1]), int(match[2]) if match[2] else None))
    return sorted(ranges)


def test_load_best_model_at_end_after_a_resume_on_a_fresh_machine_is_bit_exact(s3_fault_proxy, tmp_path):
    backend, proxy = s3_fault_proxy
    options = backend.storage_options
    reference = tiny_trainer(str(tmp_path / "reference"), **RUN)
    reference.train()
    assert reference.state.best_model_checkpoint.endswith("checkpoint-2")

    # first machine: keep_last=1 in the store; it dies right after step 3's commit
    first = tiny_trainer(str(tmp_path / "first"), **RUN, callbacks=[
        StoreCallback(backend.url, storage_options=options, retention=RetentionPolicy(keep_last=1)), CrashAfterSave()])
    try:
        first.train()
    except Crash:
        pass
    store = CheckpointStore(backend.url, storage_options=options)
    assert store.steps() == [2, 3]  # step 2 kept as step 3's best, step 1 deleted
    assert store.manifest(3).metadata["best_step"] == 2
    shutil.rmtree(tmp_path / "first")  # the machine is gone

    second = tiny_trainer(str(tmp_path / "second"), **RUN, callbacks=[
        StoreCallback(backend.url, storage_options=options, retention=RetentionPolicy(keep_last=1))])
    proxy.requests.clear()
    path = store_checkpoint(backend.url, storage_options=options, trainer=second)
    assert path == str(tmp_path / "second" / "checkpoint-3")
    # one download per payload: each fetched payload read once (one GET, or ranges tiling it once)
    for step in (3, 2):
        for entry in store.manifest(step).payloads:
            ranges = _ranges_read(proxy, backend, f"step-{step:06d}/{entry.path}")
            covered = [(first, entry.size_bytes - 1 if last is None else last) for first, last in ranges]
            assert covered and covered[0][0] == 0 and covered[-1][1] == entry.size_bytes - 1, (entry.name, ranges)
            assert all(b[0] == a[1] + 1 for a, b in zip(covered, covered[1:])), (entry.name, ranges)
    second.train(resume_from_checkpoint=path)
    assert second.state.best_model_checkpoint == str(tmp_path / "second" / "checkpoint-2")
    final, best = weights(second), weights(reference)
    assert all(torch.equal(final[name], best[name]) for name in best)
    last = store.read(4, "model.safetensors")  # the last weights differ: the best ones were loaded
    assert last != store.read(2, "model.safetensors")
    assert store.steps() == [2, 3, 4]  # 4 newest, 2 its best, 3 the resume parent until a second save
