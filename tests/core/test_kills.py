"""SIGKILL of a writer process: while payload bytes stream, and
between two payloads of one save. After the kill the previous step is latest, loads cleanly and
is never mixed with the killed save's objects; a new save of the killed step succeeds."""

from __future__ import annotations

import signal

import pytest
from proc_writer import payloads_for

from .helpers import Proc, open_store, save

KILL_BACKENDS = ["local", "s3", "gcs"]


def _assert_resumes_from(store, step: int, payloads: dict[str, bytes], killed: int) -> None:
    assert store.latest_step() == step
    assert store.steps() == [step]
    assert not store.is_complete(killed) and store.status(killed) == "uncommitted"
    assert store.verify(step, deep=True).ok
    for name, data in payloads.items():
        assert store.read(step, name) == data


@pytest.mark.parametrize("backend", KILL_BACKENDS, indirect=True)
def test_sigkill_while_payload_streams(backend, raw):
    store = open_store(backend)
    prev = payloads_for("prev")
    save(store, 1, prev)
    proc = Proc(backend, "stream", "2", "killed")
    proc.expect("streaming")  # 1 MiB already written into model.pt, the writer is mid-payload
    assert proc.sigkill() == -signal.SIGKILL
    _assert_resumes_from(open_store(backend), 1, prev, killed=2)
    # Whatever the killed writer left lies under its attempt prefix only.
    assert all("/attempt-" in k for k in raw.keys() if k.startswith("step-000002/"))
    save(store, 2, {"model.pt": b"resumed"})
    assert store.latest_step() == 2 and store.read(2, "model.pt") == b"resumed"


@pytest.mark.parametrize("backend", KILL_BACKENDS, indirect=True)
def test_sigkill_between_model_and_optimizer(backend, raw):
    """Step 8 committed; the save of step 9 dies after the model object, before the optimizer:
    resume uses step 8 for every part, never a mix."""
    store = open_store(backend)
    eight = payloads_for("eight")
    save(store, 8, eight)
    proc = Proc(backend, "partial", "9", "nine")
    proc.expect("model-done")
    assert proc.sigkill() == -signal.SIGKILL
    # The model object of step 9 is there, complete, under its attempt prefix...
    nine_keys = [k for k in raw.keys() if k.startswith("step-000009/")]
    assert len(nine_keys) == 1 and nine_keys[0].endswith("/model.pt")
    assert raw.cat(nine_keys[0]) == payloads_for("nine")["model.pt"]
    # ...and never used: every part comes from step 8.
    fresh = open_store(backend)
    _assert_resumes_from(fresh, 8, eight, killed=9)
    assert fresh.manifest(8).attempt_id in fresh.manifest(8).payloads[0].path
