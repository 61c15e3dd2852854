"""Every core entry point x every kind of damage: the rule of docs/resume.md ("A damaged checkpoint",
opd_store/store/_resume_guard.py), as a table.

A store holds two committed steps; the newest is damaged after its commit, as another program or bit
rot would (:mod:`opd_testkit.damage`: a payload deleted, truncated to half, one byte flipped; and a
rank's own file deleted). Each entry point must either resume from the newest intact step with a
warning naming the skipped one, where the run cannot later collide with it, or stop before
training with one line naming the step, the file and the remedy (``opd-store delete URL STEP``);
never a silent fresh start, never a load of damaged bytes. Every OPD entry point saves step
``successful_updates`` again on its way, so each row here is a stop, and what a stop leaves is
checked: nothing trained, nothing restored, nothing committed changed.

Entry points here: the Python API (``latest_complete_checkpoint`` then ``load_adapter`` and
``load_opd_checkpoint``; ``load_opd_checkpoint`` of the damaged step's URL),
``load_sharded_opd_checkpoint`` and ``opd_store.dcp.load``; the main job's rows are in
test_core_job.py. Local stores (the request counts of the same resumes on S3 are in
test_core_one_download.py).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from opd_testkit import opd as objects
from opd_testkit.damage import DAMAGE_KINDS, damage_payload
from opd_testkit.resume_rule import assert_stop_line, files_under
from opd_testkit.stores import Backend

from opd_store import CheckpointStore, dcp
from opd_store.errors import IncompleteCheckpointError, IntegrityError
from opd_store.opd import (
    latest_complete_checkpoint,
    load_adapter,
    load_opd_checkpoint,
    load_sharded_opd_checkpoint,
    save_opd_checkpoint,
    save_sharded_opd_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

KINDS = (*DAMAGE_KINDS, "missing rank file")


def _damage(backend: Backend, step: int, kind: str, name: str, rank_file: str) -> str:
    """Damage ``name`` (``rank_file`` for a missing rank file) of ``step``; the path under the step prefix."""
    if kind == "missing rank file":
        return damage_payload(backend, step, rank_file, "delete").split("/", 1)[1]
    return damage_payload(backend, step, name, kind).split("/", 1)[1]


def _assert_stop(message: str, *, store: CheckpointStore, step: int, path: str) -> None:
    assert_stop_line(message, store_url=store.url, step=step, file=path)


# -- the Python API, replicated (two ranks' RNG parts) -----------------------------------------------


def _replicated_store(root) -> CheckpointStore:
    """Steps 2 and 4 of a two-rank run, saved in single-writer mode (one process)."""
    from opd_store.opd._rng import capture_rng_state

    store = CheckpointStore(root)
    for successful in (2, 4):
        save_opd_checkpoint(**objects.save_kwargs(store, successful=successful, world_size=2,
                                                  rank_rng_states=[capture_rng_state(), capture_rng_state()]))
    return store


@pytest.mark.parametrize("kind", KINDS)
def test_latest_complete_checkpoint_then_load(kind, tmp_path, caplog):
    store = _replicated_store(tmp_path / "store")
    backend = Backend("local", store.url, {})
    path = _damage(backend, 4, kind, "training_state.pt", "rng-rank-01.pt")
    before = files_under(tmp_path / "store")
    kwargs = objects.load_kwargs(world_size=2)
    optimizer_before = kwargs["optimizer"].state_dict()
    if kind == "flip":  # found only by reading the bytes: by the load, which reads each payload once
        url = latest_complete_checkpoint(store.url)
        assert url == store.step_url(4)
        with pytest.raises(IntegrityError) as caught:
            load_opd_checkpoint(url, **kwargs)
    else:
        with pytest.raises(IntegrityError) as caught:
            latest_complete_checkpoint(store.url)
        assert "this run (resuming from step 2) would save step 4 again" in str(caught.value)
    _assert_stop(str(caught.value), store=store, step=4, path=path)
    objects.assert_same(kwargs["optimizer"].state_dict(), optimizer_before, "optimizer")  # nothing restored
    assert files_under(tmp_path / "store") == before


@pytest.mark.parametrize("kind", KINDS)
def test_load_opd_checkpoint_of_the_damaged_step(kind, tmp_path):
    store = _replicated_store(tmp_path / "store")
    path = _damage(Backend("local", store.url, {}), 4, kind, "training_state.pt", "rng-rank-01.pt")
    kwargs = objects.load_kwargs(world_size=2)
    optimizer_before = kwargs["optimizer"].state_dict()
    expected = IntegrityError if kind == "flip" else IncompleteCheckpointError
    with pytest.raises(expected) as caught:
        load_opd_checkpoint(store.step_url(4), **kwargs)
    _assert_stop(str(caught.value), store=store, step=4, path=path)
    objects.assert_same(kwargs["optimizer"].state_dict(), optimizer_before, "optimizer")


def test_latest_complete_checkpoint_never_starts_fresh_beside_a_damaged_step(tmp_path):
    """No intact step left, one damaged: ``FileNotFoundError`` (a caller's cue to start from scratch)
    would lead the run into the damaged step; it is the stop instead."""
    store = CheckpointStore(tmp_path / "store")
    save_opd_checkpoint(**objects.save_kwargs(store, successful=2))
    path = _damage(Backend("local", store.url, {}), 2, "truncate", "training_state.pt", "rng.pt")
    with pytest.raises(IntegrityError) as caught:
        latest_complete_checkpoint(store)
    assert not isinstance(caught.value, FileNotFoundError)
    assert "this run (starting from scratch) would save step 2 again" in str(caught.value)
    _assert_stop(str(caught.value), store=store, step=2, path=path)


def test_load_adapter_of_a_flipped_adapter_changes_no_weight(tmp_path, peft_factory):
    store = CheckpointStore(tmp_path / "store")
    model = peft_factory.model()
    _layer, optimizer, scheduler = objects.make_training()
    save_opd_checkpoint(**objects.save_kwargs(store, successful=2, model=model, optimizer=optimizer,
                                              scheduler=scheduler))
    path = _damage(Backend("local", store.url, {}), 2, "flip", "adapter/adapter_model.safetensors", "rng.pt")
    fresh = peft_factory.model(lora_seed=7)
    before = {name: p.detach().clone() for name, p in fresh.named_parameters()}
    with pytest.raises(IntegrityError) as caught:
        load_adapter(store.step_url(2), fresh)
    _assert_stop(str(caught.value), store=store, step=2, path=path)
    assert all(torch.equal(p, before[name]) for name, p in fresh.named_parameters())


# -- sharded checkpoints: load_sharded_opd_checkpoint and opd_store.dcp.load ---------------------------


def _student(seed: int):
    from opd_store.job import build_student

    model = build_student(vocab_size=32, seed=seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
    return model, optimizer, scheduler


@pytest.fixture(scope="module")
def sharded_store(tmp_path_factory):
    """Steps 2 and 4 of a one-rank sharded OPD run (DCP: ``.metadata`` and rank 0's file), made once."""
    root = tmp_path_factory.mktemp("sharded") / "store"
    model, optimizer, scheduler = _student(0)
    for successful in (2, 4):
        save_sharded_opd_checkpoint(checkpoints_dir=str(root), model=model, optimizer=optimizer, scheduler=scheduler,
                                    trainer_state=objects.trainer_state(successful), config=objects.TinyConfig(),
                                    provenance_fingerprints=dict(objects.PROVENANCE),
                                    teacher_state={"update_count": successful})
    return root


def _rank_file(store: CheckpointStore, step: int) -> str:
    (name,) = [name for name in store.names(step) if name.endswith(".distcp")]
    return name


@pytest.mark.parametrize("kind", KINDS)
def test_a_sharded_resume(kind, sharded_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(sharded_store, root)
    store = CheckpointStore(root)
    rank_file = _rank_file(store, 4)
    path = _damage(Backend("local", str(root), {}), 4, kind, rank_file, rank_file)
    model, optimizer, scheduler = _student(1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    load = dict(model=model, optimizer=optimizer, scheduler=scheduler, config=objects.TinyConfig(),
                provenance_fingerprints=dict(objects.PROVENANCE), teacher_state_loader=lambda state: None)
    if kind == "flip":
        url = latest_complete_checkpoint(str(root))
        with pytest.raises(IntegrityError) as caught:
            load_sharded_opd_checkpoint(url, **load)
    else:
        with pytest.raises(IntegrityError) as caught:
            latest_complete_checkpoint(str(root))
    _assert_stop(str(caught.value), store=store, step=4, path=path)
    with pytest.raises((IntegrityError, IncompleteCheckpointError)) as direct:  # the step named directly
        load_sharded_opd_checkpoint(store.step_url(4), **load)
    _assert_stop(str(direct.value), store=store, step=4, path=path)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # no tensor changed


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_load(kind, sharded_store, tmp_path):
    from opd_store.opd._sharded import MODEL_KEY, student_state_dicts

    root = tmp_path / "store"
    shutil.copytree(sharded_store, root)
    store = CheckpointStore(root)
    rank_file = _rank_file(store, 4)
    path = _damage(Backend("local", str(root), {}), 4, kind, rank_file, rank_file)
    model, optimizer, _scheduler = _student(1)
    state, _optim = student_state_dicts(model, optimizer)
    before = {key: value.detach().clone() for key, value in state.items()}
    expected = IntegrityError if kind == "flip" else IncompleteCheckpointError
    with pytest.raises(expected) as caught:
        dcp.load({MODEL_KEY: state}, store, 4)
    _assert_stop(str(caught.value), store=store, step=4, path=path)
    assert all(torch.equal(value, before[key]) for key, value in state.items())
    dcp.load({MODEL_KEY: state}, store, 2)  # the intact step loads
    assert any(not torch.equal(value, before[key]) for key, value in state.items())


# -- several ranks: a missing or altered rank file under a process group --------------------------


def test_a_multi_rank_resume_stops_on_every_rank(tmp_path):
    """Two gloo ranks resume as a multi-rank job does (``latest_complete_checkpoint``, a collective,
    then ``load_opd_checkpoint`` on every rank): rank 1's file of step 4 missing stops both ranks
    with rank 0's decision; the same file altered is found by rank 1's load, and both ranks raise
    ``DistributedLoadError`` naming rank 1, the file and the remedy."""
    from core_rank_child import run_ranks

    stores = {}
    for kind in ("missing rank file", "flip"):
        store = _replicated_store(tmp_path / kind.replace(" ", "-"))
        kind_of = "delete" if kind == "missing rank file" else "flip"
        stores[kind] = (store, damage_payload(Backend("local", store.url, {}), 4, "rng-rank-01.pt", kind_of))
    reports = run_ranks(tmp_path / "ranks", resumes=[store.url for store, _path in stores.values()])

    store, path = stores["missing rank file"]
    seen = [report[f"resume {store.url}"] for report in reports]
    assert {r["type"] for r in seen} == {"IntegrityError"} and len({r["message"] for r in seen}) == 1, seen
    _assert_stop(seen[0]["message"], store=store, step=4, path=path)

    store, path = stores["flip"]
    seen = [report[f"resume {store.url}"] for report in reports]
    assert {r["type"] for r in seen} == {"DistributedLoadError"} and len({r["message"] for r in seen}) == 1, seen
    assert "rank 1 failed: IntegrityError: " in seen[0]["message"] and set(seen[0]["failures"]) == {"1"}
    _assert_stop(seen[0]["message"], store=store, step=4, path=path)
