"""TRL on-policy distillation on spot capacity, end to end, on an S3 server (moto over HTTP).

A tiny real ``GKDTrainer`` run (Llama student with a LoRA adapter, frozen teacher, local tokenizer
with a chat template, no network) with :class:`StoreCallback` committing every save. The spot run is
SIGKILLed once during training and once during a save (payloads written, manifest create refused by
the S3 proxy so the commit cannot land first), and every start is a new process with a new empty
working directory, HOME and temp dir. The final adapter, optimizer state and logged losses equal an
uninterrupted run's bit for bit, though the last start finds the run journal damaged; and
``opd-store report`` says where each start was killed and what it lost.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch
import trl_child
from opd_testkit.proxies import Rule, S3FaultProxy
from opd_testkit.stores import raw_put

from opd_store import CheckpointStore
from opd_store.cli import main
from opd_store.format import JOURNAL_PREFIX
from opd_store.job._machines import torch_threads
from opd_store.ledger import event_rel, read_journal

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_helpers import cli_store_args  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run (no store, no callback), in this process."""
    import tempfile

    from opd_store.job._trl_demo import run_start

    with tempfile.TemporaryDirectory() as out, torch_threads(1):  # run_start sets 1 thread: restored after
        return run_start(None, out, spec=trl_child.SPEC)


def _kill(stream) -> None:
    stream.process.kill()
    assert stream.process.wait(60) == -signal.SIGKILL


def test_gkd_killed_in_training_and_in_a_save_resumes_bit_for_bit(s3_backend, moto_s3, tmp_path, reference, capsys):
    proxy = S3FaultProxy(moto_s3.endpoint_url)
    try:
        options = dict(s3_backend.storage_options, endpoint_url=proxy.endpoint_url)
        store = CheckpointStore(s3_backend.url, storage_options=s3_backend.storage_options)
        homes = []

        # Start 1: SIGKILLed during training, at step 3 (step 2 committed).
        stream, machine = trl_child.start(tmp_path, s3_backend.url, options)
        homes.append(machine / "home")
        seen = stream.until(lambda e: e["event"] == "step" and e["step"] == 3, reply_to="step")
        _kill(stream)
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
        stream, machine = trl_child.start(tmp_path, s3_backend.url, options, step_ack=False)
        homes.append(machine / "home")
        assert manifest_put.wait(300), "the save of step 4 never reached its manifest create:\n" + "\n".join(stream.output)
        _kill(stream)
        proxy.clear()
        assert {"event": "resumed", "step": 2} in stream.rest()
        info = {i.step: i for i in store.checkpoints()}
        assert info[4].status == "uncommitted" and len(info[4].attempts) == 1
        assert info[4].total_size_bytes > 0  # the payloads of step 4 had landed
        assert store.steps() == [2]

        # The run journal damaged: an event that is not JSON, an object that is no event's. Nothing
        # resumes from the journal: start 3 resumes as without it.
        junk = event_rel(946684800.0, "00000000deadbeef", 0, "save", 99)
        raw_put(s3_backend, junk, b"not json")
        raw_put(s3_backend, f"{JOURNAL_PREFIX}/notes.txt", b"kept by hand")

        # Start 3: skips the uncommitted step 4, resumes from 2 and runs to the end.
        stream, machine = trl_child.start(tmp_path, s3_backend.url, options)
        homes.append(machine / "home")
        seen = stream.until(lambda e: e["event"] == "done", reply_to="step")
        assert stream.process.wait(60) == 0
        assert {"event": "resumed", "step": 2} in seen
        assert seen[-1]["event"] == "done" and seen[-1]["cwd_entries"] == ["out"]
        assert store.steps() == [2, 4] and all(store.verify(s, deep=True).ok for s in (2, 4))
        assert len(store.checkpoints()[-1].attempts) == 2  # the killed attempt of step 4 is left to gc
        state = torch.load(machine / "result.pt", weights_only=True)
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
        for home in homes:
            assert sorted(p.name for p in home.iterdir()) == []

        # opd-store report: start 1 killed at step 3 and start 2 at step 4 (in its save), both
        # redone from step 2; two saves committed; the damaged objects skipped, named
        assert main(["report", s3_backend.url, "--json", *cli_store_args(s3_backend)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert [(r["outcome"], r["resumed_step"], r["last_step"]) for r in report["starts"]] == [
            ("killed", None, 3), ("killed", 2, 4), ("finished", 2, 4)]
        assert [(p["last_step"], p["resumed_step"], p["updates_lost"], p["exact"]) for p in report["preemptions"]] == [
            (3, 2, 1, True), (4, 2, 2, True)]
        assert report["saves"] == 2 and report["restart_secs_worst"] > 0
        assert report["bytes_stored"] == store.manifest(2).total_size_bytes + store.manifest(4).total_size_bytes
        assert sorted(line.split(": ")[0] for line in report["skipped"]) == [
            f"{s3_backend.url}/{junk}", f"{s3_backend.url}/{JOURNAL_PREFIX}/notes.txt"]
        events = read_journal(store).events
        assert [(e.resumed_step, e.updates_redone) for e in events if e.kind == "resume"] == [(None, None), (2, 1), (2, 2)]
        saves = [e for e in events if e.kind == "save"]
        assert [(e.step, e.reason, e.size_bytes) for e in saves] == [
            (2, "periodic", store.manifest(2).total_size_bytes), (4, "periodic", store.manifest(4).total_size_bytes)]
        files = [len(store.manifest(step).payloads) for step in (2, 4)]
        assert [e.requests["put"] for e in saves] == [n + 1 for n in files]  # every payload and the manifest
    finally:
        proxy.stop()
