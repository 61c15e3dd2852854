"""TRL on-policy distillation on spot capacity, end to end, on an S3 server (moto over HTTP).

A tiny real ``GKDTrainer`` run (Llama student with a LoRA adapter, frozen teacher, local tokenizer
with a chat template, no network) with :class:`StoreCallback` committing every save. The spot run is
SIGKILLed once during training and once during a save (payloads written, manifest create refused by
the S3 proxy so the commit cannot land first), and every start is a new process with a new empty
working directory, HOME and temp dir. The final adapter, optimizer state and logged losses equal an
uninterrupted run's bit for bit.
"""

from __future__ import annotations

import io
import signal
import threading

import pytest
import torch

import trl_child
from s3proxy import Rule, S3FaultProxy

from opd_store import CheckpointStore

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run (no store, no callback), in this process."""
    from opd_store.job.trl_demo import run_start

    import tempfile

    with tempfile.TemporaryDirectory() as out:
        return run_start(None, out, spec=trl_child.SPEC)


def _events_until(conn, process, stop):
    """Read the child's events (answering ``go`` to each step) until ``stop(event)`` is true or the
    child ends; return every event read."""
    seen = []
    while True:
        if not conn.poll(300):
            raise TimeoutError(f"no event from the training start in 300 s; seen {seen}")
        event = conn.recv()
        seen.append(event)
        if event["event"] == "error":
            raise AssertionError("training start failed:\n" + event["traceback"])
        if stop(event):
            return seen
        if event["event"] == "step":
            conn.send("go")
        if event["event"] == "done":
            return seen


def _kill(process) -> None:
    process.kill()
    process.join(30)
    assert process.exitcode == -signal.SIGKILL


def test_gkd_killed_in_training_and_in_a_save_resumes_bit_for_bit(s3_backend, moto_s3, tmp_path, reference):
    proxy = S3FaultProxy(moto_s3.endpoint_url)
    try:
        options = dict(s3_backend.storage_options, endpoint_url=proxy.endpoint_url)
        store = CheckpointStore(s3_backend.url, storage_options=s3_backend.storage_options)

        # Start 1: SIGKILLed during training, at step 3 (step 2 committed).
        process, conn = trl_child.start(str(tmp_path / "machine-1"), s3_backend.url, options)
        seen = _events_until(conn, process, lambda e: e["event"] == "step" and e["step"] == 3)
        _kill(process)
        assert {"event": "saved", "step": 2} in seen and not any(e["event"] == "resumed" for e in seen)
        assert store.steps() == [2] and store.is_complete(2)

        # Start 2: resumes from step 2, SIGKILLed while saving step 4 (payloads landed, manifest refused).
        manifest_put = threading.Event()

        def is_step4_manifest(request):
            if request.path.endswith("/step-000004/manifest.json"):
                manifest_put.set()
                return True
            return False

        proxy.add(Rule(ops=("PutObject",), match=is_step4_manifest, fault="status", status=503, code="SlowDown",
                       times=None))
        process, conn = trl_child.start(str(tmp_path / "machine-2"), s3_backend.url, options, step_ack=False)
        assert manifest_put.wait(300), "the save of step 4 never reached its manifest create"
        _kill(process)
        proxy.clear()
        events = []
        try:
            while conn.poll(0):
                events.append(conn.recv())
        except (EOFError, ConnectionResetError):
            pass  # the child's end closed with the kill
        assert {"event": "resumed", "step": 2} in events
        info = {i.step: i for i in store.checkpoints()}
        assert info[4].status == "uncommitted" and len(info[4].attempts) == 1
        assert info[4].total_size_bytes > 0  # the payloads of step 4 had landed
        assert store.steps() == [2]

        # Start 3: skips the uncommitted step 4, resumes from 2 and runs to the end.
        process, conn = trl_child.start(str(tmp_path / "machine-3"), s3_backend.url, options)
        seen = _events_until(conn, process, lambda e: False)
        process.join(60)
        assert process.exitcode == 0
        assert {"event": "resumed", "step": 2} in seen
        done = seen[-1]
        assert done["event"] == "done" and done["cwd_entries"] == ["out"]
        assert store.steps() == [2, 4] and all(store.verify(s, deep=True).ok for s in (2, 4))
        assert len(store.checkpoints()[-1].attempts) == 2  # the killed attempt of step 4 is left to gc
        state = torch.load(io.BytesIO(done["state"]), weights_only=True)
        assert state["global_step"] == reference["global_step"] == 4
        assert [name for name in state["adapter"]] == [name for name in reference["adapter"]]
        for name, tensor in reference["adapter"].items():
            assert torch.equal(state["adapter"][name], tensor), name
        for key, value in reference["optimizer"]["state"].items():
            for field, tensor in value.items():
                assert torch.equal(state["optimizer"]["state"][key][field], tensor), (key, field)
        assert state["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]
        assert state["losses"] == reference["losses"] and len(state["losses"]) == 4
        # each machine started empty: nothing but the run's output dir appeared in its cwd, HOME
        # and temp dir stayed empty
        for n in (1, 2, 3):
            assert sorted(p.name for p in (tmp_path / f"machine-{n}" / "home").iterdir()) == []
    finally:
        proxy.stop()
