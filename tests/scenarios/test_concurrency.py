"""Concurrency: two jobs on one prefix save step 5 through
``save_opd_checkpoint`` at the same moment: exactly one commits, the other gets the conflict
error, and every payload of the committed checkpoint is the winner's, byte for byte."""

from __future__ import annotations

import threading

import pytest
import torch

from opd_store.commit import Transaction
from opd_store.errors import CommitConflictError
from opd_store.opd._rng import capture_rng_state

from .helpers import adapter_tensors, base_state, load, open_store, save, seed_all, student, trainable

STEP = 5


class Job:
    """One training job's objects at step 5 (each job trains from its own seed)."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        seed_all(seed)
        self.model = student(seed=seed)
        self.optimizer = torch.optim.AdamW(trainable(self.model), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (step + 1))
        for _ in range(2):
            ids = torch.randint(0, 32, (2, 6))
            loss = self.model(input_ids=ids, labels=ids).loss
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
        self.rng = capture_rng_state()
        self.outcome: str | None = None
        self.error: BaseException | None = None

    def save(self, store) -> str:
        return save(store, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                    trainer_state=base_state(STEP, job=self.name), teacher_state={"update_count": STEP, "job": self.name},
                    rank_rng_states=[self.rng])


def _payload_bytes(store, step: int) -> dict[str, bytes]:
    return {name: store.read(step, name) for name in store.names(step)}


def test_two_jobs_save_the_same_step_at_once(backend, monkeypatch, tmp_path):
    """Both jobs write every payload, meet at a barrier, and create the manifest at
    the same moment, each through its own store instance (own clients and caches): one commit
    wins, the other raises ``CommitConflictError``; the manifest names only the winner's attempt;
    every payload's bytes equal what the winner saves alone; the loser's payloads are gone; the
    checkpoint loads as the winner's state."""
    jobs = [Job("job-a", 1), Job("job-b", 2)]
    # What each job's checkpoint is, byte for byte, when it saves alone (a private local store).
    alone = {}
    for job in jobs:
        private = open_store(type(backend)("local", str(tmp_path / job.name), {}))
        job.save(private)
        alone[job.name] = _payload_bytes(private, STEP)
    assert alone["job-a"].keys() == alone["job-b"].keys()
    differing = [n for n in alone["job-a"] if alone["job-a"][n] != alone["job-b"][n]]
    assert {"adapter/adapter_model.safetensors", "training_state.pt", "rng.pt"} <= set(differing)

    barrier = threading.Barrier(2, timeout=120)
    original_commit = Transaction.commit
    attempts = {}

    def commit_together(txn):
        attempts[threading.current_thread().name] = txn.attempt_id
        barrier.wait()  # both attempts hold all their payloads; now both create the manifest
        return original_commit(txn)

    monkeypatch.setattr(Transaction, "commit", commit_together)

    def run(job: Job) -> None:
        try:
            job.save(open_store(backend))
            job.outcome = "committed"
        except CommitConflictError as exc:
            job.outcome, job.error = "conflict", exc
        except BaseException as exc:  # noqa: BLE001 - reported below
            job.outcome, job.error = "error", exc

    threads = [threading.Thread(target=run, args=(job,), name=job.name) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(job.outcome for job in jobs) == ["committed", "conflict"], [(j.outcome, j.error) for j in jobs]
    winner = next(job for job in jobs if job.outcome == "committed")
    loser = next(job for job in jobs if job.outcome == "conflict")
    assert f"step-{STEP:06d}" in str(loser.error)

    store = open_store(backend)
    assert store.steps() == [STEP] and store.is_complete(STEP)
    manifest = store.manifest(STEP)
    assert manifest.attempt_id == attempts[winner.name] != attempts[loser.name]
    assert all(entry.path.startswith(f"{attempts[winner.name]}/") for entry in manifest.payloads)
    assert _payload_bytes(store, STEP) == alone[winner.name]
    assert store.verify(STEP, deep=True).ok
    # Nothing of the loser's attempt is left under the step.
    fs, root = backend.raw_fs(), backend.raw_root()
    left = [path for path in fs.find(f"{root}/step-{STEP:06d}") if attempts[loser.name] in path]
    assert left == []

    model = student(seed=99)
    optimizer = torch.optim.AdamW(trainable(model), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = load(store.step_url(STEP), model=model, optimizer=optimizer, scheduler=scheduler,
                 storage_options=store.storage_options)
    assert state["job"] == winner.name
    for name, tensor in adapter_tensors(model).items():
        assert torch.equal(tensor, adapter_tensors(winner.model)[name]), name
    with pytest.raises(CommitConflictError):
        loser.save(open_store(backend))  # a retry of the loser is refused, the winner's stays
    assert _payload_bytes(store, STEP) == alone[winner.name]
