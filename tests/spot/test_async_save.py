"""Asynchronous OPD saves: the snapshot is taken at the call, a failure in the background reaches the
caller (at ``result()``, the next save or close; never only logged), a kill mid-upload leaves the
previous step, and interpreter exit either commits or abandons within the deadline. Real PEFT
students, real stores (local, moto S3)."""

from __future__ import annotations

import copy
import os
import random
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from opd_testkit import forkserver

from opd_store import CheckpointStore
from opd_store.errors import BackgroundSaveError, CommitError, SaveInFlightError
from opd_store.opd import AsyncCheckpointer, load_adapter, load_opd_checkpoint
from opd_store.opd._rng import capture_rng_state, restore_rng_state
from opd_store.testing import Fault, FaultyStorage, InjectedFault

HERE = Path(__file__).parent
DEADLINE_SECS = 120
CHILD_DEADLINE_SECS = 900  # a child imports torch, transformers and peft: minutes on a loaded 2-core host


def _student(peft_factory, steps: int = 2):
    model = peft_factory.model()
    optimizer, scheduler = peft_factory.train(model, steps=steps)
    return model, optimizer, scheduler


def _kwargs(opd, store, model, tokenizer, optimizer, scheduler, successful: int = 2) -> dict:
    return dict(
        checkpoints_dir=store, model=model, processor=tokenizer, optimizer=optimizer, scheduler=scheduler,
        trainer_state=opd.trainer_state(successful), config=opd.TinyConfig(),
        provenance_fingerprints=dict(opd.PROVENANCE),
        teacher_state={"update_count": successful, "ema": torch.arange(3.0)},
    )


def _gated(store: CheckpointStore):
    """The store whose every write waits for ``gate``; ``entered`` is set at the first write."""
    entered, gate = threading.Event(), threading.Event()

    def wait_at_gate(op) -> bool:
        if op.kind == "write":
            entered.set()
            assert gate.wait(DEADLINE_SECS), "the test never opened the gate"
        return False

    return CheckpointStore.from_storage(FaultyStorage(store.storage, Fault(when=wait_at_gate, once=False))), entered, gate


def _trainable(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def _one_more_update(model, optimizer, scheduler) -> None:
    ids = torch.randint(0, 30, (2, 6))
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def _poll(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_SECS
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.01)


def _restore_and_compare(opd, peft_factory, checkpoint, adapter, optimizer_state, scheduler_state, rng, successful=2):
    fresh = peft_factory.model(lora_seed=7)  # another LoRA init: every restored value must come from the store
    load_adapter(checkpoint, fresh)
    for name, tensor in _trainable(fresh).items():
        assert torch.equal(tensor, adapter[name]), name
    optimizer, scheduler = peft_factory.fresh_optim(fresh)
    loaded: list[dict] = []
    kwargs = opd.load_kwargs(loaded=loaded)
    kwargs.update(optimizer=optimizer, scheduler=scheduler)
    trainer = load_opd_checkpoint(checkpoint, **kwargs)
    draws_after_load = opd.next_draws()
    opd.assert_same(optimizer.state_dict(), optimizer_state, "optimizer")
    opd.assert_same(scheduler.state_dict(), scheduler_state, "scheduler")
    assert trainer["successful_updates"] == successful
    assert torch.equal(loaded[0]["ema"], torch.arange(3.0))
    restore_rng_state(rng)
    assert draws_after_load == opd.next_draws()


@pytest.mark.parametrize("backend_name", ["local", "s3"])
def test_changes_right_after_the_call_do_not_leak_into_the_saved_step(request, opd, peft_factory, backend_name):
    backend = opd.backend_named(request, backend_name)
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    model, optimizer, scheduler = _student(peft_factory)
    gated, entered, gate = _gated(store)
    kwargs = _kwargs(opd, gated, model, peft_factory.tokenizer(), optimizer, scheduler)
    adapter, rng = _trainable(model), capture_rng_state()
    optimizer_state, scheduler_state = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(scheduler.state_dict())

    with AsyncCheckpointer() as checkpointer:
        handle = checkpointer.save(**kwargs)
        assert entered.wait(DEADLINE_SECS)  # the writer is streaming the first payload ...
        assert not handle.done() and handle.url is None
        # ... while training goes on: a real update, in-place edits of every saved object, new draws.
        _one_more_update(model, optimizer, scheduler)
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(1.0)
        kwargs["trainer_state"]["successful_updates"] = 99
        kwargs["teacher_state"]["ema"].add_(5.0)
        random.random()
        gate.set()
        url = handle.result(timeout_secs=DEADLINE_SECS)
    assert url == store.step_url(2) == handle.url and handle.done()
    assert handle.staged_bytes > 0
    assert not torch.equal(_trainable(model)["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"],
                           adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"])
    _restore_and_compare(opd, peft_factory, (store, 2), adapter, optimizer_state, scheduler_state, rng)


def _failing_at_commit(store: CheckpointStore) -> CheckpointStore:
    return CheckpointStore.from_storage(FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "create")))


def test_upload_failure_is_raised_by_result_then_the_next_save_commits(tmp_path, opd, peft_factory):
    store = CheckpointStore(tmp_path / "store")
    model, optimizer, scheduler = _student(peft_factory)
    tokenizer = peft_factory.tokenizer()
    checkpointer = AsyncCheckpointer()
    handle = checkpointer.save(**_kwargs(opd, _failing_at_commit(store), model, tokenizer, optimizer, scheduler))
    with pytest.raises(CommitError, match="step 2 is not committed") as caught:
        handle.result(timeout_secs=DEADLINE_SECS)
    assert isinstance(caught.value.__cause__, InjectedFault)
    assert handle.done() and handle.url is None
    assert store.status(2) == "uncommitted"
    # Reported once: the next save goes ahead and commits.
    second = checkpointer.save(**_kwargs(opd, store, model, tokenizer, optimizer, scheduler, successful=3))
    assert checkpointer.close() == store.step_url(3) == second.url
    assert store.latest_step() == 3 and store.status(2) == "uncommitted"


def test_upload_failure_nobody_waited_for_is_raised_by_the_next_save(tmp_path, opd, peft_factory):
    store = CheckpointStore(tmp_path / "store")
    model, optimizer, scheduler = _student(peft_factory)
    tokenizer = peft_factory.tokenizer()
    checkpointer = AsyncCheckpointer()
    handle = checkpointer.save(**_kwargs(opd, _failing_at_commit(store), model, tokenizer, optimizer, scheduler))
    _poll(handle.done, "the failing save to finish")
    with pytest.raises(BackgroundSaveError, match="step 2 failed in the background") as caught:
        checkpointer.save(**_kwargs(opd, store, model, tokenizer, optimizer, scheduler, successful=3))
    assert isinstance(caught.value.__cause__, CommitError)
    assert isinstance(caught.value.__cause__.__cause__, InjectedFault)
    assert isinstance(caught.value, OSError)
    assert 3 not in store.steps()  # the refused save wrote nothing
    third = checkpointer.save(**_kwargs(opd, store, model, tokenizer, optimizer, scheduler, successful=3))
    assert third.result(timeout_secs=DEADLINE_SECS) == store.step_url(3)
    checkpointer.close()
    assert store.latest_step() == 3 and store.status(2) == "uncommitted"


def test_upload_failure_nobody_waited_for_is_raised_by_close(tmp_path, opd, peft_factory):
    store = CheckpointStore(tmp_path / "store")
    model, optimizer, scheduler = _student(peft_factory)
    checkpointer = AsyncCheckpointer()
    checkpointer.save(**_kwargs(opd, _failing_at_commit(store), model, peft_factory.tokenizer(), optimizer, scheduler))
    with pytest.raises(BackgroundSaveError, match=r"step 2 failed in the background \(reported at close\(\)\)"):
        checkpointer.close()
    with pytest.raises(RuntimeError, match="closed"):
        checkpointer.save(**_kwargs(opd, store, model, peft_factory.tokenizer(), optimizer, scheduler))


def test_a_second_save_while_one_is_in_flight_raises_when_configured(tmp_path, opd, peft_factory):
    store = CheckpointStore(tmp_path / "store")
    model, optimizer, scheduler = _student(peft_factory)
    gated, entered, gate = _gated(store)
    checkpointer = AsyncCheckpointer(when_busy="raise")
    first = checkpointer.save(**_kwargs(opd, gated, model, None, optimizer, scheduler))
    assert entered.wait(DEADLINE_SECS)
    assert checkpointer.in_flight is first
    with pytest.raises(SaveInFlightError, match="step 2 is still in flight"):
        checkpointer.save(**_kwargs(opd, store, model, None, optimizer, scheduler, successful=3))
    gate.set()
    assert first.result(timeout_secs=DEADLINE_SECS) == store.step_url(2)
    assert checkpointer.in_flight is None
    checkpointer.save(**_kwargs(opd, store, model, None, optimizer, scheduler, successful=3))
    assert checkpointer.close() == store.step_url(3)
    assert store.steps() == [2, 3]


def test_background_s3_retries_do_not_move_the_callers_random_stream(s3_fault_proxy, opd, peft_factory):
    backend, proxy = s3_fault_proxy
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    model, optimizer, scheduler = _student(peft_factory)
    kwargs = _kwargs(opd, store, model, None, optimizer, scheduler)
    opd.seed_all(9)
    without_save = [opd.next_draws() for _ in range(2)]

    opd.seed_all(9)
    proxy.fail_puts = 2  # two PUTs answered 503: botocore retries with back-off drawn from `random`
    with AsyncCheckpointer() as checkpointer:
        handle = checkpointer.save(**kwargs)
        first = opd.next_draws()  # while the upload (and its retries) runs
        url = handle.result(timeout_secs=DEADLINE_SECS)
        second = opd.next_draws()  # after every retry
    assert len(proxy.failed) == 2
    assert [first, second] == without_save
    assert url == store.step_url(2) and store.status(2) == "complete"


def _child(backend_json: str, out_dir: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    return forkserver.popen(
        [sys.executable, str(HERE / "async_child.py"), backend_json, str(out_dir), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )


def _communicate(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=CHILD_DEADLINE_SECS)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_for_line(proc: subprocess.Popen, expected: str) -> None:
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + CHILD_DEADLINE_SECS
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"child never said {expected!r}"
        if selector.select(left):
            line = proc.stdout.readline()
            assert line, f"child exited before {expected!r}: {proc.stderr.read()}"
            if line.strip() == expected:
                return


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend_name", ["local", "s3"])
def test_kill_during_the_background_upload_leaves_the_previous_step_and_resume_is_exact(
        request, tmp_path, opd, peft_factory, backend_name):
    backend = opd.backend_named(request, backend_name)
    child_backend = type(backend)(backend.name, backend.url,
                                  {k: v for k, v in backend.storage_options.items() if k != "session"})
    proc = _child(child_backend.to_json(), tmp_path, "kill")
    try:
        _wait_for_line(proc, "uploading")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=CHILD_DEADLINE_SECS)
    store = CheckpointStore(backend.url, storage_options=backend.storage_options)
    assert store.status(4) == "uncommitted" and store.latest_step() == 2
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    _restore_and_compare(opd, peft_factory, (store, 2), expected["adapter"], expected["optimizer"],
                         expected["scheduler"], expected["rng"])


@pytest.mark.timeout(1200)
def test_exit_waits_for_the_save_in_flight_to_commit(tmp_path, opd):
    store_dir = tmp_path / "store"
    proc = _child(f'{{"name": "local", "url": "{store_dir}", "storage_options": {{}}}}', tmp_path, "exit-commit")
    out, err = _communicate(proc)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["returning"]
    assert f"opd_store: asynchronous save of step 2 committed: {store_dir}/step-000002" in err.splitlines()
    assert CheckpointStore(store_dir).status(2) == "complete"


@pytest.mark.timeout(1200)
def test_exit_abandons_a_stuck_save_uncommitted_after_the_deadline(tmp_path, opd):
    store_dir = tmp_path / "store"
    proc = _child(f'{{"name": "local", "url": "{store_dir}", "storage_options": {{}}}}', tmp_path, "exit-stuck")
    out, err = _communicate(proc)
    assert proc.returncode == 0, err
    assert "returning" in out.splitlines()
    assert "opd_store: waiting up to 0.25 s for the asynchronous save of step 2 to commit" in err.splitlines()
    assert "opd_store: abandoned the asynchronous save of step 2 after 0.25 s; it stays uncommitted" in err.splitlines()
    assert CheckpointStore(store_dir).status(2) == "uncommitted"
