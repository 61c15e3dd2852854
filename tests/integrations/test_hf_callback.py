"""StoreCallback with a real (tiny) TRL GKDTrainer in this process: what is committed, async uploads
racing save_total_limit, retention, preemption and transformers' JIT checkpoint (and their run
journal), a resume over a lost journal, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import types
from pathlib import Path

import pytest
from opd_testkit.proxies import Rule, S3FaultProxy
from transformers import TrainerCallback

from opd_store import (
    CheckpointStore,
    IncompleteCheckpointError,
    IntegrityError,
    ResumeMismatchError,
    StoreUnreachableError,
    TieredStore,
)
from opd_store.integrations.transformers import StoreCallback, resume_from_store, store_checkpoint
from opd_store.job._machines import torch_threads
from opd_store.format import JOURNAL_PREFIX
from opd_store.job._trl_demo import GKDSpec, build_trainer, final_state
from opd_store.ledger import read_journal
from opd_store.retention import RetentionPolicy
from opd_store.runtime import PreemptionWatcher

TRAINER_FILES = {"README.md", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja", "optimizer.pt",
                 "rng_state.pth", "scheduler.pt", "tokenizer.json", "tokenizer_config.json", "trainer_state.json",
                 "training_args.bin"}


class OnSave(TrainerCallback):
    """Runs ``action(args, state)`` in ``on_save`` (placed before or after the StoreCallback)."""

    def __init__(self, action):
        self.action = action

    def on_save(self, args, state, control, **kwargs):
        self.action(args, state)


class OnStepEnd(TrainerCallback):
    def __init__(self, action):
        self.action = action

    def on_step_end(self, args, state, control, **kwargs):
        self.action(args, state)


RUN_A = pytest.mark.xdist_group("hf-run-a")
"""The tests that read run A: on one worker, so that the run happens once."""


@pytest.fixture(scope="session")
def run_a(tmp_path_factory):
    """Run A, uninterrupted: 4 steps, saves at 2 and 4, save_total_limit 1, learning rate 1e-3, with
    a StoreCallback on a local store; shared by the tests that only read it (one trainer run: they
    are one xdist group, and the fixture lives for the worker's session, so tests of other modules
    run between them do not end it)."""
    base = tmp_path_factory.mktemp("run-a")
    callback = StoreCallback(str(base / "store"))
    with torch_threads(1):
        trainer = build_trainer(str(base / "out"), GKDSpec(max_steps=4), callbacks=[callback])
        trainer.train()
    return types.SimpleNamespace(store=str(base / "store"), out=base / "out", callback=callback,
                                 final=final_state(trainer))


@pytest.fixture(scope="session")
def run_a_store(run_a):
    return run_a.store


@RUN_A
def test_every_save_is_committed_with_each_file_and_its_crc(run_a):
    store = CheckpointStore(run_a.store)
    assert store.steps() == [2, 4] and run_a.callback.committed_steps == [2, 4]
    manifest = store.manifest(4)
    assert {entry.name for entry in manifest.payloads} == TRAINER_FILES
    local = run_a.out / "checkpoint-4"
    for entry in manifest.payloads:
        assert store.read(4, entry.name) == (local / entry.name).read_bytes(), entry.name
    assert manifest.metadata["framework"] == "transformers" and manifest.metadata["parent_step"] is None
    assert manifest.metadata["run_config"]["config"]["training_args"]["max_steps"] == 4
    assert json.loads(store.read(4, "trainer_state.json"))["global_step"] == 4
    assert store.verify(2, deep=True).ok and not (run_a.out / "checkpoint-2").exists()


def test_async_upload_survives_save_total_limit_deleting_the_directory(s3_backend, moto_s3, tmp_path):
    """The upload of step 1 is held at the S3 proxy until the Trainer has saved step 2 and deleted
    checkpoint-1 (save_total_limit=1): step 1 is still committed with the bytes it had."""
    proxy = S3FaultProxy(moto_s3.endpoint_url)
    gate, deleted = threading.Event(), []

    def hold_step1(request):
        if "/step-000001/" in request.path and request.method == "PUT":
            gate.wait(120)
        return False

    def at_save(args, state):
        if state.global_step == 2:
            deleted.append(not (Path(args.output_dir) / "checkpoint-1").exists())
            gate.set()

    proxy.add(Rule(match=hold_step1, times=None))
    # hard links a killed process left behind in the same output directory are cleared at the start
    stale = tmp_path / "out" / ".opd-store-staging" / "checkpoint-9-0123abcd" / "optimizer.pt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 100)
    try:
        options = dict(s3_backend.storage_options, endpoint_url=proxy.endpoint_url)
        callback = StoreCallback(s3_backend.url, storage_options=options, async_upload=True)
        trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=3, save_steps=1, save_total_limit=1),
                                callbacks=[OnSave(at_save), callback])
        trainer.train()
    finally:
        gate.set()
        proxy.stop()
    assert deleted == [True]
    store = CheckpointStore(s3_backend.url, storage_options=s3_backend.storage_options)
    assert store.steps() == [1, 2, 3] and all(store.verify(step, deep=True).ok for step in (1, 2, 3))
    assert json.loads(store.read(1, "trainer_state.json"))["global_step"] == 1
    assert not (tmp_path / "out" / ".opd-store-staging").exists()


def test_a_tiered_store_commits_each_checkpoint_locally_and_is_durable_when_training_ends(tmp_path):
    """Any store: with a TieredStore each checkpoint commits on local disk (here on the callback's
    background owner too), its upload queues behind it, and the end of training waits for the
    uploads: every step was durable in the bucket, the save's retention applied there after each."""
    bucket_url = f"memory://hf-tiered-{tmp_path.name}/run"
    store = TieredStore(tmp_path / "local", bucket_url)
    callback = StoreCallback(store, async_upload=True, retention=RetentionPolicy(keep_last=1))
    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=3, save_steps=1), callbacks=[callback])
    trainer.train()
    assert callback.committed_steps == [1, 2, 3] and store.pending_uploads() == []
    bucket = CheckpointStore(bucket_url)
    assert bucket.steps() == [3] and bucket.verify(3, deep=True).ok
    assert {entry.name for entry in bucket.manifest(3).payloads} == TRAINER_FILES
    assert bucket.read(3, "trainer_state.json") == (tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_bytes()
    assert store.local_steps() == [2, 3]  # the local tier's own retention (keep_last=2), once durable
    store.close()


@RUN_A
def test_a_restart_on_a_tiered_store_queues_the_local_steps_the_bucket_lacks(run_a, tmp_path):
    """A process killed after its local commits, before their uploads: the same machine restarts (same
    local tier, same bucket) and resumes the local step 4; training begins by queuing the uploads of
    local steps 2 and 4 (``upload_pending``, as the main job does), so the bucket holds them, intact,
    when training ends (it used to keep lacking them for good: a new machine redid every step)."""
    shutil.copytree(run_a.store, tmp_path / "local")  # run A's commits, none uploaded
    bucket_url = f"memory://hf-tier-restart-{tmp_path.name}/run"
    store = TieredStore(tmp_path / "local", bucket_url)
    callback = StoreCallback(store)
    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=4), callbacks=[callback])
    checkpoint = store_checkpoint(store, trainer=trainer)
    assert checkpoint.endswith("checkpoint-4")
    trainer.train(resume_from_checkpoint=checkpoint)
    bucket = CheckpointStore(bucket_url)
    # run A's steps 2 and 4, then what this start committed (the Trainer's own step after the resume)
    assert bucket.steps() == [2, 4, *callback.committed_steps] and callback.committed_steps[0] > 4
    assert all(bucket.verify(step, deep=True).ok for step in bucket.steps())
    local = CheckpointStore(run_a.store)
    assert bucket.read(4, "adapter_model.safetensors") == local.read(4, "adapter_model.safetensors")
    assert store.pending_uploads() == []
    store.close()


def test_store_retention_is_independent_of_save_total_limit(tmp_path):
    store_url = str(tmp_path / "store")
    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=4, save_steps=1, save_total_limit=1),
                            callbacks=[StoreCallback(store_url, retention=RetentionPolicy(keep_last=2))])
    trainer.train()
    assert CheckpointStore(store_url).steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-4"]


def test_incomplete_directory_is_not_committed_and_the_error_names_the_file(tmp_path):
    store_url = str(tmp_path / "store")

    def lose_optimizer(args, state):
        (Path(args.output_dir) / f"checkpoint-{state.global_step}" / "optimizer.pt").unlink()

    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=2),
                            callbacks=[OnSave(lose_optimizer), StoreCallback(store_url)])
    with pytest.raises(IncompleteCheckpointError, match=r"checkpoint-2: .*optimizer\.pt is missing"):
        trainer.train()
    store = CheckpointStore(store_url)
    assert store.steps() == [] and store.checkpoints() == []


def test_unreachable_store_fails_at_construction_naming_url_and_cause(monkeypatch, moto_s3):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StoreUnreachableError) as raised:
        StoreCallback("s3://bucket/run", storage_options={"endpoint_url": "http://127.0.0.1:9",
                                                          "config_kwargs": {"retries": {"max_attempts": 1}}})
    assert str(raised.value) == "s3://bucket/run: cannot list the store: endpoint http://127.0.0.1:9 refused the connection"
    with pytest.raises(StoreUnreachableError, match=r"^s3://no-such-bucket/run: bucket 'no-such-bucket' does not exist$"):
        StoreCallback("s3://no-such-bucket/run", storage_options=moto_s3.storage_options())


@RUN_A
def test_store_of_another_run_is_refused_naming_the_differing_fields(run_a_store, tmp_path):
    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=4, learning_rate=5e-4))
    with pytest.raises(ResumeMismatchError) as raised:
        store_checkpoint(run_a_store, trainer=trainer)
    message = str(raised.value)
    assert "step-000004" in message and "resume_mode 'exact'" in message
    assert "training_args.learning_rate: saved 0.001, current 0.0005" in message
    assert not (tmp_path / "out" / "checkpoint-4").exists()  # refused before fetching
    # the callback refuses the same mismatch at on_train_begin when the directory came from elsewhere
    trainer.add_callback(StoreCallback(run_a_store))
    with pytest.raises(ResumeMismatchError, match="training_args.learning_rate"):
        trainer.train(resume_from_checkpoint=store_checkpoint(run_a_store, tmp_path / "elsewhere"))


@RUN_A
def test_execution_only_changes_resume_and_a_fresh_start_into_a_used_store_is_refused(run_a_store, tmp_path):
    from opd_store import CommitConflictError

    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=4), callbacks=[StoreCallback(run_a_store)],
                            logging_steps=2, dataloader_num_workers=0)
    with pytest.raises(CommitConflictError, match=r"newer than this run's start \(steps 2, 4\) but this run starts"):
        trainer.train()
    # resuming an older step than the newest is refused too, before anything is trained
    older = store_checkpoint(run_a_store, trainer=trainer, step=2)
    with pytest.raises(CommitConflictError, match=r"newer than this run's start \(steps 4\) but this run resumes step 2"):
        trainer.train(resume_from_checkpoint=older)
    assert trainer.state.global_step == 2
    path = store_checkpoint(run_a_store, trainer=trainer)
    assert path == str(tmp_path / "out" / "checkpoint-4")
    assert sorted(os.listdir(path)) == sorted(TRAINER_FILES)


@RUN_A
@pytest.mark.parametrize("kind", ["truncate", "flip"])
def test_damaged_newest_step_is_skipped_and_the_run_stops_before_training(run_a_store, tmp_path, kind, caplog):
    # A copy of run A whose step 4 optimizer.pt lost its last 10 bytes or had one byte flipped
    # after the commit: both are skipped alike (warning naming step and file), step 2 is fetched,
    # and train() stops at on_train_begin (its save of checkpoint-4 would collide with the damaged
    # step) with the line naming the command that removes it. Nothing committed changes.
    store_dir = tmp_path / "store"
    shutil.copytree(run_a_store, store_dir)
    (damaged,) = store_dir.glob("step-000004/attempt-*/optimizer.pt")
    data = bytearray(damaged.read_bytes())
    if kind == "truncate":
        del data[-10:]
    else:
        data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in store_dir.rglob("*") if p.is_file()}
    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=4), callbacks=[StoreCallback(str(store_dir))])
    path = store_checkpoint(store_dir, trainer=trainer)
    assert path == str(tmp_path / "out" / "checkpoint-2")
    (warning,) = [r.getMessage() for r in caplog.records if "skipped step 4" in r.getMessage()]
    assert f"{damaged.parent.name}/optimizer.pt" in warning
    assert ("corrupt: " if kind == "flip" else "incomplete: ") in warning
    with pytest.raises(IntegrityError) as raised:
        trainer.train(resume_from_checkpoint=path)
    assert str(raised.value).startswith(f"{store_dir}/step-000004: step 4 is damaged (")
    assert str(raised.value).endswith(f"this run (resuming step 2) would save step 4 again, which a committed step "
                                      f"never allows; training did not start: keep what you need of it, remove it "
                                      f"with `opd-store delete {store_dir} 4`, then rerun the same command")
    assert trainer.state.global_step == 2  # nothing trained
    assert {p: p.read_bytes() for p in store_dir.rglob("*") if p.is_file()} == before


@RUN_A
def test_model_config_change_is_refused(run_a_store, tmp_path):
    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=4))
    trainer.model.peft_config["default"].lora_dropout = 0.1
    with pytest.raises(ResumeMismatchError, match=r"model\.peft\.default\.lora_dropout: saved 0\.0, current 0\.1"):
        store_checkpoint(run_a_store, trainer=trainer)


def test_preemption_notice_saves_commits_and_stops(tmp_path):
    store_url = str(tmp_path / "store")
    watcher = PreemptionWatcher(signals=("SIGUSR1",))
    callback = StoreCallback(store_url, preemption=watcher, async_upload=True)

    def notice(args, state):
        if state.global_step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=6, save_steps=100),
                            callbacks=[OnStepEnd(notice), callback])
    trainer.train()
    assert trainer.state.global_step == 3 and callback.preempted_at == 3
    store = CheckpointStore(store_url)
    assert store.steps() == [3] and store.verify(3, deep=True).ok  # committed before train() returned
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the watcher was stopped
    # journaled: the notice, its save (committed on the worker, waited for), the preempted end
    events = read_journal(store).events
    assert [e.kind for e in events] == ["start", "resume", "first_update", "notice", "save", "exit"]
    notice, save, exit_ = events[3:]
    assert (notice.source, notice.step, notice.decision, notice.last_committed_step) == ("SIGUSR1", 3, "save", None)
    assert (save.step, save.reason, save.size_bytes) == (3, "notice", store.manifest(3).total_size_bytes)
    assert save.commit_secs > 0 and save.blocking_secs >= save.commit_secs  # the notice's save is waited for
    # the start's PUTs: the save's (a payload each, the manifest) and the journal's six events
    assert (exit_.outcome, exit_.step, exit_.requests["put"]) == ("preempted", 3, save.requests["put"] + 6)
    assert save.requests["put"] == len(store.manifest(3).payloads) + 1


def test_transformers_jit_checkpoint_is_committed(tmp_path):
    store_url = str(tmp_path / "store")

    def request_jit(args, state):
        if state.global_step == 3:
            (jit,) = [cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "JITCheckpointCallback"]
            jit.jit_manager.is_checkpoint_requested = True  # what its SIGTERM timer sets

    trainer = build_trainer(str(tmp_path / "out"), GKDSpec(max_steps=6, save_steps=100),
                            callbacks=[OnStepEnd(request_jit), StoreCallback(store_url)], enable_jit_checkpoint=True)
    trainer.train()
    store = CheckpointStore(store_url)
    # The JIT callback saves at the next on_step_begin (global_step 3, before step 4's update) and
    # stops the loop after that step: transformers' own behaviour; the committed step is the saved one.
    assert store.steps() == [3] and json.loads(store.read(3, "trainer_state.json"))["global_step"] == 3
    assert "checkpoint-is-incomplete.txt" not in store.names(3) and "optimizer.pt" in store.names(3)
    assert trainer.state.global_step == 4


@RUN_A
def test_resume_from_store_in_one_call_continues_exactly(run_a, tmp_path):
    store_url = str(tmp_path / "store")

    class Crash(Exception):
        pass

    def crash(args, state):
        if state.global_step == 3:
            raise Crash

    first = build_trainer(str(tmp_path / "a"), GKDSpec(max_steps=4), callbacks=[StoreCallback(store_url), OnStepEnd(crash)])
    with pytest.raises(Crash):
        first.train()
    store = CheckpointStore(store_url)
    assert [e.kind for e in read_journal(store).events] == ["start", "resume", "first_update", "save"]
    store.storage.delete_tree(JOURNAL_PREFIX)  # the run journal lost: nothing resumes from it
    second = build_trainer(str(tmp_path / "b"), GKDSpec(max_steps=4), callbacks=[StoreCallback(store_url)])
    resume_from_store(second, store_url)
    assert store.manifest(4).metadata["parent_step"] == 2
    a, b = run_a.final, final_state(second)  # run A is the same run, uninterrupted
    assert a["losses"] == b["losses"] and all((a["adapter"][k] == b["adapter"][k]).all() for k in a["adapter"])
    events = read_journal(store).events  # the second start's alone, its updates redone unknown
    assert [(e.kind, getattr(e, "step", None)) for e in events] == [
        ("start", None), ("resume", None), ("first_update", 3), ("save", 4), ("exit", 4)]
    assert (events[1].resumed_step, events[1].updates_redone) == (2, None)
