"""StoreCheckpointIO and StoreModelCheckpoint with a real Lightning Trainer: top-k and last in the
store (with and without AsyncCheckpointIO), ``fit(ckpt_path="last")`` on S3, a name saved again
below or at its step, and a run SIGKILLed after a checkpoint and resumed with
``fit(ckpt_path="last")`` in a new process on GCS, continuing exactly over a damaged run journal
(and in the same process over a lost one), ``opd-store report`` saying where it was killed; the
journal of a SIGTERM."""

from __future__ import annotations

import os
import signal
import threading

import lightning_child
import pytest
import torch
from opd_testkit.stores import raw_put

from opd_store import CheckpointStore, StoreUnreachableError, TieredStore
from opd_store.format import JOURNAL_PREFIX
from opd_store.integrations.lightning import StoreCheckpointIO
from opd_store.job._machines import torch_threads
from opd_store.ledger import event_rel, read_journal, report_store

pytestmark = pytest.mark.timeout(600)


REFERENCE = pytest.mark.xdist_group("lightning-reference")
"""The tests that compare with the uninterrupted run: on one worker, so that it runs once."""


@pytest.fixture(scope="session")
def reference():
    """The uninterrupted run's final weights (a local store, this process; for the worker's session,
    so that tests of other modules run between the group's tests do not end it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as root, torch_threads(1):
        trainer, model, train, val, _plugin, _ckpt = lightning_child.build(root + "/ckpts", {})
        trainer.fit(model, train, val)
        return lightning_child.weights(model)


def _layout(url, options):
    """{name: [versions]} of a plugin root, from stores opened independently of the plugin."""
    plugin = StoreCheckpointIO(url, storage_options=options)
    return {name: CheckpointStore(plugin.path_of(name), storage_options=options).steps() for name in plugin.names()}


def _last(url, options):
    """(versions held, global_step of the newest) of last.ckpt, from a store opened independently."""
    infos = CheckpointStore(f"{url}/last.ckpt", storage_options=options).checkpoints()
    return len(infos), infos[-1].metadata["global_step"]


class _HeldUntil:
    """Pickles (inside ``torch.save``, on AsyncCheckpointIO's thread) only once ``event`` is set,
    as an empty dict: the save that carries it is held there, every later one queues behind it."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __reduce__(self):
        assert self.event.wait(120), "training never ended"
        return (dict, ())


@REFERENCE
@pytest.mark.parametrize("async_io", [False, True], ids=["sync", "async-checkpoint-io"])
def test_top_k_and_last_live_in_the_store(async_io, tmp_path, reference):
    """With AsyncCheckpointIO the first save of last.ckpt (the second save of the run) is held on
    the saving thread until training has ended, so every later save is still queued when
    ModelCheckpoint evicts a top-k checkpoint: the eviction must take its turn behind the save of
    the checkpoint it evicts instead of running before it (and leaving it in the store)."""
    import lightning.pytorch as pl

    train_ended, dumps = threading.Event(), []

    class HoldSecondSave(pl.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            dumps.append(trainer.global_step)
            if async_io and len(dumps) == 2:  # epoch 0: top-k save, then last.ckpt
                checkpoint["held"] = _HeldUntil(train_ended)

        def on_train_end(self, trainer, pl_module):
            train_ended.set()

    url, options = str(tmp_path / "ckpts"), {}
    try:
        trainer, model, train, val, plugin, checkpoint = lightning_child.build(url, options, async_io=async_io,
                                                                               callbacks=[HoldSecondSave()])
        trainer.fit(model, train, val)
    finally:
        train_ended.set()
    assert dumps == [4, 4, 8, 8, 12, 12, 16, 16]
    layout = _layout(url, options)
    # 4 epochs of 4 steps: last.ckpt holds only its newest version; two top-k names are left
    assert len(layout.pop("last.ckpt")) == 1
    assert len(layout) == 2 and all(len(steps) == 1 for steps in layout.values())
    assert {f"{plugin.path_of(name)}" for name in layout} == set(checkpoint.best_k_models)
    loaded = plugin.load_checkpoint(plugin.path_of("last.ckpt"))
    assert loaded["global_step"] == 16 and loaded["epoch"] == 3
    for name, tensor in lightning_child.weights(model).items():
        assert torch.equal(loaded["state_dict"][name], tensor)
        assert torch.equal(reference[name], tensor), name  # the plugin changes nothing in the run
    # a new Trainer's fit(ckpt_path="last") finds that checkpoint and restores it: nothing is left to train
    again, model, train, val, _p, _c = lightning_child.build(url, options, async_io=async_io)
    again.fit(model, train, val, ckpt_path="last")
    assert again.global_step == 16
    for name, tensor in lightning_child.weights(model).items():
        assert torch.equal(loaded["state_dict"][name], tensor), name


def test_last_on_s3_through_async_checkpoint_io(s3_backend):
    """s3:// with AsyncCheckpointIO: one epoch saved, then a new Trainer's fit(ckpt_path="last") finds
    it in the bucket (Lightning alone drops the protocol and starts from scratch, Lightning #18261),
    resumes from step 4 and saves on."""
    url, options = s3_backend.url + "/ckpts", s3_backend.storage_options
    first, model, train, val, plugin, _c = lightning_child.build(url, options, async_io=True, max_epochs=1)
    first.fit(model, train, val)
    saved = lightning_child.weights(model)
    assert _last(url, options) == (1, 4)

    second, model, train, val, plugin, checkpoint = lightning_child.build(url, options, async_io=True, max_epochs=2)
    restored = []

    class Restored(lightning_child.pl_callback()):
        def on_train_start(self, trainer, pl_module):
            restored.append((trainer.global_step, lightning_child.weights(pl_module)))

    second.callbacks.append(Restored())
    second.fit(model, train, val, ckpt_path="last")
    (step, weights), = restored
    assert step == 4 and all(torch.equal(weights[name], tensor) for name, tensor in saved.items())
    assert second.global_step == 8 and _last(url, options) == (1, 8)
    loaded = plugin.load_checkpoint(plugin.path_of("last.ckpt"))
    for name, tensor in lightning_child.weights(model).items():
        assert torch.equal(loaded["state_dict"][name], tensor), name
    # Lightning's normalised form of the same path (protocol dropped) reaches the same checkpoint
    assert plugin.load_checkpoint(plugin.path_of("last.ckpt").split("://", 1)[1])["global_step"] == 8
    layout = _layout(url, options)
    assert {plugin.path_of(name) for name in layout if name != "last.ckpt"} == set(checkpoint.best_k_models)


def test_a_tiered_root_commits_each_name_locally_and_a_new_machine_resumes_from_the_bucket(tmp_path):
    """Any store as the root: with a TieredStore each name is a tiered store of its own
    (``TieredStore.under``); the evicted top-k name is removed from both tiers, ``teardown`` waits
    for the uploads, and a new machine (an empty local tier) resumes ``"last"`` from the bucket."""
    bucket_url = f"memory://lightning-tiered-{tmp_path.name}/ckpts"
    root = TieredStore(tmp_path / "local", bucket_url)
    first, model, train, val, plugin, checkpoint = lightning_child.build(root, {}, max_epochs=2, save_top_k=1)
    first.fit(model, train, val)
    saved = lightning_child.weights(model)
    layout = _layout(bucket_url, {})
    assert layout.pop("last.ckpt") == [2] and list(layout.values()) == [[1]]  # the newest version only
    assert {plugin.path_of(name) for name in layout} == set(checkpoint.best_k_models)
    local = {path.name: CheckpointStore(path).steps() for path in (tmp_path / "local").iterdir()}
    # the local tier keeps its own two newest versions; the evicted top-k name is gone from both tiers
    assert {name: steps for name, steps in local.items() if steps} == {"last.ckpt": [1, 2], **layout}
    assert plugin.names() == sorted(["last.ckpt", *layout])

    fresh = TieredStore(tmp_path / "new-machine", bucket_url)
    again, model, train, val, _p, _c = lightning_child.build(fresh, {}, max_epochs=2, save_top_k=1)
    again.fit(model, train, val, ckpt_path="last")
    assert again.global_step == 8
    for name, tensor in lightning_child.weights(model).items():
        assert torch.equal(saved[name], tensor), name
    root.close()
    fresh.close()


def test_a_restart_on_a_tiered_root_queues_the_local_versions_the_bucket_lacks(tmp_path):
    """A process that committed on the local tier and died before any upload: the same machine
    restarts with the same local tier and bucket, and ``fit`` begins by queuing the upload of every
    name's local version (``upload_pending``, as the main job does); ``teardown`` waits for them, so
    the bucket then holds each name's version, byte for byte (it used to stay empty for good)."""
    local = tmp_path / "local"
    first, model, train, val, _p, _c = lightning_child.build(CheckpointStore(local), {}, max_epochs=1)
    first.fit(model, train, val)  # the local commits alone: their uploads never happened
    committed = _layout(str(local), {})
    assert committed == {"epoch=0-step=4.ckpt": [1], "last.ckpt": [1]}
    bucket_url = f"memory://lightning-tier-restart-{tmp_path.name}/ckpts"
    root = TieredStore(local, bucket_url)
    again, model, train, val, _p, _c = lightning_child.build(root, {}, max_epochs=1)
    again.fit(model, train, val, ckpt_path="last")
    assert again.global_step == 4
    assert _layout(bucket_url, {}) == committed
    for name in committed:
        bucket, tier = CheckpointStore(f"{bucket_url}/{name}"), CheckpointStore(local / name)
        assert bucket.verify(1, deep=True).ok
        assert bucket.read(1, "checkpoint.ckpt") == tier.read(1, "checkpoint.ckpt")
    root.close()


def test_unreachable_store_fails_at_construction(monkeypatch):
    from opd_store.integrations.lightning import StoreCheckpointIO

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StoreUnreachableError, match=r"^s3://bucket/ckpts: cannot list the store: endpoint http://127\.0\.0\.1:9 refused the connection$"):
        StoreCheckpointIO("s3://bucket/ckpts", storage_options={"endpoint_url": "http://127.0.0.1:9",
                                                               "config_kwargs": {"retries": {"max_attempts": 1}}})


def test_model_checkpoint_builds_no_filesystem_without_the_plugins_options(gcs_backend, monkeypatch):
    """ModelCheckpoint builds a filesystem for its dirpath with no storage options; for gs:// off GCE
    that spends about 15 s probing the metadata server for credentials, once per callback."""
    from lightning.pytorch.callbacks import model_checkpoint

    from opd_store.integrations.lightning import StoreModelCheckpoint

    built = []
    original = model_checkpoint.get_filesystem
    monkeypatch.setattr(model_checkpoint, "get_filesystem", lambda path, **kw: built.append(str(path)) or original(path, **kw))
    plugin = StoreCheckpointIO(gcs_backend.url + "/ckpts", storage_options=gcs_backend.storage_options)
    checkpoint = StoreModelCheckpoint(plugin, monitor="val_loss", save_last=True)
    assert [path for path in built if "://" in path] == []
    assert checkpoint.dirpath == plugin.url


@REFERENCE
def test_killed_and_resumed_from_last_in_a_new_process_continues_exactly(gcs_backend, tmp_path, reference):
    """On gs:// (fake-gcs-server); fit(ckpt_path="last") on s3:// is in the top-k test above."""
    url, options = gcs_backend.url + "/ckpts", gcs_backend.storage_options
    stream, _machine = lightning_child.start(tmp_path, url, options)
    # epochs 0 and 1 are checkpointed; killed at the end of epoch 2, before its checkpoint
    first = stream.until(lambda e: e["event"] == "epoch_end" and e["epoch"] == 2, reply_to="epoch_end")
    stream.process.kill()
    assert stream.process.wait(60) == -signal.SIGKILL
    assert _last(url, options) == (1, 8)
    # the run journal damaged (an event that is not JSON, an object that is no event's): nothing
    # resumes from it
    junk = event_rel(946684800.0, "00000000deadbeef", 0, "save", 99)
    raw_put(gcs_backend, f"ckpts/{junk}", b"not json")
    raw_put(gcs_backend, f"ckpts/{JOURNAL_PREFIX}/notes.txt", b"kept by hand")

    stream, machine = lightning_child.start(tmp_path, url, options)
    events = stream.until(lambda e: e["event"] == "done", reply_to="epoch_end")
    assert stream.process.wait(60) == 0
    assert [e["epoch"] for e in events if e["event"] == "epoch_end"] == [2, 3]
    assert events[-1]["resumed_from"].endswith("/last.ckpt")
    state = torch.load(machine / "result.pt", weights_only=True)
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    assert _last(url, options) == (1, 16)

    # opd-store report: killed at step 12 (the end of epoch 2), resumed from 8, each checkpoint
    # Lightning saved is one save; the damaged objects skipped, named
    report = report_store(CheckpointStore(url, storage_options=options))
    killed_at = first[-1]["step"]
    assert [(r.outcome, r.resumed_step, r.last_step) for r in report.starts] == [
        ("killed", None, killed_at), ("finished", 8, 16)]
    assert [(p.last_step, p.resumed_step, p.updates_lost, p.exact) for p in report.preemptions] == [
        (killed_at, 8, killed_at - 8, True)]
    saved = [e["step"] for e in first + events if e["event"] == "checkpoint"]
    assert report.saves == len(saved) and saved[:4] == [4, 4, 8, 8]
    plugin = StoreCheckpointIO(url, storage_options=options)
    assert report.bytes_stored == sum(CheckpointStore(plugin.path_of(name), storage_options=options).manifest(version)
                                      .total_size_bytes for name, (version,) in _layout(url, options).items())
    assert sorted(line.split(": ")[0] for line in report.skipped) == [f"{url}/{junk}", f"{url}/{JOURNAL_PREFIX}/notes.txt"]
    resumes = [e for e in read_journal(plugin.root).events if e.kind == "resume"]
    assert [(e.resumed_step, e.updates_redone) for e in resumes] == [(None, None), (8, killed_at - 8)]


def test_lightning_does_not_restore_rng_without_the_module_hooks(tmp_path):
    """Evidence for docs/integrations.md: Lightning's checkpoint holds no RNG state, so a run with
    dropout resumed from "last" draws other masks unless the module saves the generator itself."""
    url = str(tmp_path / "ckpts")
    results = {}
    for hooks in (False, True):
        ref_trainer, ref_model, train, val, _p, _c = lightning_child.build(str(tmp_path / f"ref-{hooks}"), {},
                                                                           rng_hooks=hooks)
        ref_trainer.fit(ref_model, train, val)
        first, model, train, val, _p, _c = lightning_child.build(f"{url}-{hooks}", {}, rng_hooks=hooks, max_epochs=2)
        first.fit(model, train, val)
        # build() seeds as the script of a new process would (seed_everything(0)), then resumes
        second, model, train, val, _p, _c = lightning_child.build(f"{url}-{hooks}", {}, rng_hooks=hooks)
        second.fit(model, train, val, ckpt_path="last")
        reference, resumed = lightning_child.weights(ref_model), lightning_child.weights(model)
        results[hooks] = all(torch.equal(reference[name], resumed[name]) for name in reference)
    assert results == {False: False, True: True}


def test_a_name_saved_again_at_the_same_or_an_earlier_step_holds_the_newest_save(tmp_path):
    """Lightning overwrites a checkpoint file it saves again. A run resumed from an older top-k
    checkpoint saves ``last.ckpt`` again below the step it holds, and once more at that very step:
    each save must replace the name's content, and ``"last"`` must resolve to the newest save."""
    url = str(tmp_path / "ckpts")
    first, model, train, val, plugin, checkpoint = lightning_child.build(url, {}, save_top_k=3)
    first.fit(model, train, val)
    assert plugin.load_checkpoint(plugin.path_of("last.ckpt"))["global_step"] == 16
    oldest = min(checkpoint.best_k_models, key=lambda path: plugin.load_checkpoint(path)["global_step"])
    assert plugin.load_checkpoint(oldest)["global_step"] == 8
    with pytest.raises(ValueError, match="is not under the store root"):
        plugin.name_of(f"{url}/../elsewhere/last.ckpt")

    # a second run (another learning rate) resumes from step 8 and saves last.ckpt at step 12 < 16
    second, model, train, val, plugin, _c = lightning_child.build(url, {}, max_epochs=3, lr=5e-3, save_top_k=3)
    second.fit(model, train, val, ckpt_path=oldest)
    last = plugin.load_checkpoint(plugin.path_of("last.ckpt"))
    assert last["global_step"] == 12
    for name, tensor in lightning_child.weights(model).items():
        assert torch.equal(last["state_dict"][name], tensor), name

    # a third start resumes from "last" (that save, fetched into a cache it then empties) and saves
    # last.ckpt at step 16 again, through AsyncCheckpointIO
    cache = tmp_path / "cache"
    third, model, train, val, plugin, _c = lightning_child.build(url, {}, lr=5e-3, async_io=True, save_top_k=3,
                                                                 local_cache_dir=cache)
    third.fit(model, train, val, ckpt_path="last")
    assert third.global_step == 16 and [p for p in cache.rglob("*") if p.is_file()] == []
    last = plugin.load_checkpoint(plugin.path_of("last.ckpt"))
    assert last["global_step"] == 16
    for name, tensor in lightning_child.weights(model).items():
        assert torch.equal(last["state_dict"][name], tensor), name
    assert len(CheckpointStore(plugin.path_of("last.ckpt")).steps()) == 1


@REFERENCE
def test_a_new_trainer_in_the_same_process_after_a_crash_resumes_and_continues_exactly(tmp_path, reference):
    """An in-process retry: a fit that raised at the end of epoch 2 (before that epoch's checkpoint),
    then a new Trainer in the same process, with the same plugin object, ``fit(ckpt_path="last")``:
    it resumes at step 8 and ends on the uninterrupted run's weights, as without a store."""
    class Preempted(lightning_child.pl_callback()):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 2:
                raise RuntimeError("preempted")

    url = f"memory://lightning-retry-{tmp_path.name}/ckpts"
    first, model, train, val, plugin, _c = lightning_child.build(url, {}, callbacks=[Preempted()])
    with pytest.raises(RuntimeError, match="^preempted$"):
        first.fit(model, train, val, ckpt_path="last")  # a first start: nothing to resume yet
    assert first.global_step == 12 and _last(url, {}) == (1, 8)
    (exit_,) = [e for e in read_journal(plugin.root).events if e.kind == "exit"]
    assert (exit_.outcome, exit_.step, exit_.error) == ("failed", 12, "RuntimeError: preempted")
    plugin.root.storage.delete_tree(JOURNAL_PREFIX)  # the run journal lost: nothing resumes from it
    second, model, train, val, _p, _c = lightning_child.build(url, {}, plugin=plugin)
    second.fit(model, train, val, ckpt_path="last")
    assert second.global_step == 16 and _last(url, {}) == (1, 16)
    for name, tensor in lightning_child.weights(model).items():
        assert torch.equal(reference[name], tensor), name
    assert [(e.kind, getattr(e, "resumed_step", None)) for e in read_journal(plugin.root).events
            if e.kind in ("start", "resume", "exit")] == [("start", None), ("resume", 8), ("exit", None)]


@pytest.mark.parametrize("save_on_exception", [False, True], ids=["skipped", "saved"])
def test_a_sigterm_is_journaled_as_a_notice_with_what_came_of_it(save_on_exception, tmp_path):
    """Lightning stops after the batch in which SIGTERM arrived (``SIGTERMException``); the journal
    says so: a notice at that step with its decision (``save_on_exception``: ModelCheckpoint saves
    the step, else the updates since the last checkpoint are lost) and ``exit`` ``preempted``."""
    assert threading.current_thread() is threading.main_thread()  # where Lightning installs its handler

    class Term(lightning_child.pl_callback()):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 6:
                os.kill(os.getpid(), signal.SIGTERM)

    url = f"memory://lightning-sigterm-{tmp_path.name}/ckpts"
    trainer, model, train, val, plugin, _c = lightning_child.build(
        url, {}, max_epochs=2, callbacks=[Term()], checkpoint_kwargs={"save_on_exception": save_on_exception})
    with pytest.raises(SystemExit):  # Lightning's SIGTERMException
        trainer.fit(model, train, val)
    assert trainer.global_step == 6
    events = read_journal(plugin.root).events
    (notice,) = [e for e in events if e.kind == "notice"]
    assert (notice.source, notice.step, notice.last_committed_step, notice.decision, notice.updates_lost) == (
        "SIGTERM", 6, 4, "save" if save_on_exception else "skip", 0 if save_on_exception else 2)
    # epoch 0's checkpoint (its top-k name and last.ckpt), then with save_on_exception step 6's
    assert [(e.step, e.reason) for e in events if e.kind == "save"] == (
        [(4, "periodic")] * 2 + ([(6, "notice")] * 2 if save_on_exception else []))
    assert [(e.kind, e.outcome, e.step) for e in events if e.kind == "exit"] == [("exit", "preempted", 6)]
    (row,) = report_store(plugin.root).starts
    assert (row.outcome, row.last_step) == ("preempted", 6)
