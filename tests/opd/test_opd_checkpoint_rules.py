"""The seed's rules and errors for OPD checkpoints, on local, memory and S3 (moto server)."""

from __future__ import annotations

import io

import pytest
import torch
import yaml

from opd_store.errors import CommitConflictError, IncompleteCheckpointError, ResumeMismatchError
from opd_store.opd import latest_complete_checkpoint, load_opd_checkpoint, save_opd_checkpoint
from opd_store.opd._names import resolve_checkpoint
from opd_store.store import CheckpointStore


@pytest.fixture
def store(opd_backend) -> CheckpointStore:
    """One store per test: every new S3 store builds its own client (about a second here)."""
    return CheckpointStore(opd_backend.url, storage_options=opd_backend.storage_options)


def _raw_objects(backend) -> list[str]:
    fs = backend.raw_fs()
    root = backend.raw_root()
    try:
        return sorted(path[len(root) + 1 :] for path in fs.find(root))
    except FileNotFoundError:
        return []


def test_save_commits_seed_payloads_at_step_successful_updates(opd_backend, store, opd):
    config = opd.TinyConfig()
    kwargs = opd.save_kwargs(opd_backend.url, storage_options=opd_backend.storage_options, config=config)
    kwargs["trainer_state"] = opd.trainer_state(7, attempted=9)
    kwargs["teacher_state"] = {"update_count": 7}
    url = save_opd_checkpoint(**kwargs)

    assert url == store.step_url(7)
    assert url.endswith("/step-000007")
    if opd_backend.name == "local":
        assert url.startswith("/") and "://" not in url
    assert store.status(7) == "complete"
    assert sorted(store.names(7)) == [
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "config.yaml",
        "rng.pt",
        "training_state.pt",
    ]
    assert store.read(7, "config.yaml") == yaml.safe_dump(config.as_dict(), sort_keys=False).encode()
    payload = torch.load(io.BytesIO(store.read(7, "training_state.pt")), weights_only=True)
    assert payload["schema"] == "opd_checkpoint_v1"
    assert payload["trainer"]["successful_updates"] == 7 and payload["trainer"]["attempted_updates"] == 9
    assert payload["config_fingerprint"] == config.fingerprint()
    assert payload["provenance_fingerprints"] == opd.PROVENANCE
    assert payload["world_size"] == 1
    assert payload["teacher"] == {"update_count": 7}
    metadata = store.manifest(7).metadata
    assert metadata["attempted_updates"] == 9 and metadata["successful_updates"] == 7
    assert metadata["query_update"] == 7
    assert metadata["config_fingerprint"] == config.fingerprint()
    assert metadata["provenance_fingerprints"] == opd.PROVENANCE
    assert metadata["opd_schema"] == "opd_checkpoint_v1" and metadata["world_size"] == 1

    loaded: list = []
    state = load_opd_checkpoint(
        url, **opd.load_kwargs(config=config, storage_options=opd_backend.storage_options, loaded=loaded)
    )
    assert state == opd.trainer_state(7, attempted=9)
    assert loaded == [{"update_count": 7}]


def test_missing_trainer_keys_are_refused(opd_backend, store, opd):
    for missing in ("attempted_updates", "successful_updates", "query_update"):
        kwargs = opd.save_kwargs(store)
        del kwargs["trainer_state"][missing]
        with pytest.raises(ValueError, match=rf"missing \['{missing}'\]"):
            save_opd_checkpoint(**kwargs)
    assert _raw_objects(opd_backend) == []


def test_rollouts_and_failure_queue_are_not_checkpoint_state(opd_backend, store, opd):
    for forbidden in ("rollouts", "failure_queue"):
        kwargs = opd.save_kwargs(store)
        kwargs["trainer_state"][forbidden] = [1, 2]
        with pytest.raises(ValueError, match="not checkpoint state"):
            save_opd_checkpoint(**kwargs)
    assert _raw_objects(opd_backend) == []


def test_teacher_update_count_must_equal_successful_updates(opd_backend, store, opd):
    kwargs = opd.save_kwargs(store, successful=4)
    kwargs["teacher_state"] = {"update_count": 3}
    with pytest.raises(ValueError, match="teacher update count differs"):
        save_opd_checkpoint(**kwargs)
    assert _raw_objects(opd_backend) == []
    kwargs["teacher_state"] = {"update_count": None, "w": torch.ones(2)}  # None: no count kept
    url = save_opd_checkpoint(**kwargs)
    assert url == store.step_url(4)


def test_existing_step_raises_file_exists_and_keeps_the_first(opd_backend, store, opd):
    first = opd.save_kwargs(store)
    url = save_opd_checkpoint(**first)
    before = store.read(2, "training_state.pt")
    second = opd.save_kwargs(store)
    second["trainer_state"]["attempted_updates"] = 50
    with pytest.raises(FileExistsError, match="already exists") as info:
        save_opd_checkpoint(**second)
    assert isinstance(info.value, CommitConflictError)
    assert url in str(info.value)
    assert store.read(2, "training_state.pt") == before
    assert store.steps() == [2]


def test_rank_rng_states_must_match_world_size(opd_backend, store, opd):
    kwargs = opd.save_kwargs(store, world_size=2)
    with pytest.raises(ValueError, match="rank RNG states must match OPD world size"):
        save_opd_checkpoint(**kwargs)  # None: only this process's state, for 2 ranks
    from opd_store.opd._rng import capture_rng_state

    kwargs["rank_rng_states"] = [capture_rng_state()] * 3
    with pytest.raises(ValueError, match="3 state"):
        save_opd_checkpoint(**kwargs)
    assert _raw_objects(opd_backend) == []


def test_multi_rank_save_writes_schema_v2_and_one_rng_file_per_rank(opd_backend, store, opd):
    from opd_store.opd._rng import capture_rng_state

    kwargs = opd.save_kwargs(store, world_size=4)
    kwargs["rank_rng_states"] = [capture_rng_state() for _ in range(4)]
    save_opd_checkpoint(**kwargs)
    names = store.names(2)
    assert [n for n in sorted(names) if n.startswith("rng")] == [f"rng-rank-{r:02d}.pt" for r in range(4)]
    payload = torch.load(io.BytesIO(store.read(2, "training_state.pt")), weights_only=True)
    assert payload["schema"] == "opd_checkpoint_v2" and payload["world_size"] == 4
    assert store.manifest(2).world_size == 4


def test_incomplete_checkpoint_raises_value_error_naming_it(opd_backend, store, opd):
    url = save_opd_checkpoint(**opd.save_kwargs(store))
    entry = store.manifest(2).entry("rng.pt")
    fs = opd_backend.raw_fs()
    fs.rm_file(f"{opd_backend.raw_root()}/step-000002/{entry.path}")
    with pytest.raises(ValueError, match="incomplete") as info:
        load_opd_checkpoint((store, 2), **opd.load_kwargs())
    assert isinstance(info.value, IncompleteCheckpointError)
    assert url in str(info.value)


def test_uncommitted_step_raises_value_error(opd_backend, store, opd):
    txn = store.begin(5)
    txn.write_bytes("training_state.pt", b"partial")  # a save killed before its commit
    txn.settle()  # stored (a bucket store publishes in the background after write_bytes returns)
    with pytest.raises(IncompleteCheckpointError, match="incomplete"):
        load_opd_checkpoint((store, 5), **opd.load_kwargs())
    with pytest.raises(IncompleteCheckpointError):
        load_opd_checkpoint((store, 6), **opd.load_kwargs())  # nothing there at all


def test_unknown_schema_raises(opd_backend, store, opd):
    with store.begin(3) as txn:
        with txn.open("training_state.pt") as writer:
            torch.save({"schema": "opd_checkpoint_v9", "trainer": {}}, writer)
    with pytest.raises(ValueError, match="unsupported OPD checkpoint schema 'opd_checkpoint_v9'"):
        load_opd_checkpoint((store, 3), **opd.load_kwargs())


def test_config_fingerprint_mismatch_is_refused(opd_backend, store, opd):
    url = save_opd_checkpoint(**opd.save_kwargs(store))
    other = opd.TinyConfig({"lr": 0.002, "rollout_limit": 8})
    kwargs = opd.load_kwargs(config=other)
    before = kwargs["optimizer"].state_dict()
    with pytest.raises(ResumeMismatchError, match="lr") as info:
        load_opd_checkpoint((store, 2), **kwargs)
    assert isinstance(info.value, ValueError)
    assert kwargs["optimizer"].state_dict() == before  # nothing restored


def test_provenance_mismatch_is_refused(opd_backend, store, opd):
    url = save_opd_checkpoint(**opd.save_kwargs(store))
    kwargs = opd.load_kwargs()
    kwargs["provenance_fingerprints"] = dict(opd.PROVENANCE, teacher_weights="sha256:other")
    with pytest.raises(ResumeMismatchError, match="teacher_weights"):
        load_opd_checkpoint((store, 2), **kwargs)


def test_world_size_mismatch_is_refused_naming_both_sizes(opd_backend, store, opd):
    url = save_opd_checkpoint(**opd.save_kwargs(store))
    with pytest.raises(ResumeMismatchError) as info:
        load_opd_checkpoint((store, 2), **opd.load_kwargs(world_size=2))
    assert "world_size 1" in str(info.value) and "world_size 2" in str(info.value)
    with pytest.raises(ValueError, match="rank must be"):
        load_opd_checkpoint((store, 2), **opd.load_kwargs(rank=1, world_size=1))


@pytest.mark.parametrize("load_world_size", [2, 8])
def test_saved_with_four_ranks_loaded_with_two_or_eight_is_refused(opd_backend, store, opd, load_world_size):
    """The documented policy (docs/resume.md: a world-size change is refused
    under every resume mode) applies with a message naming both sizes; nothing is restored."""
    from opd_store.opd._rng import capture_rng_state

    save_opd_checkpoint(**opd.save_kwargs(store, world_size=4, rank_rng_states=[capture_rng_state()] * 4))
    loaded = []
    kwargs = opd.load_kwargs(world_size=load_world_size, loaded=loaded)
    optimizer_before = kwargs["optimizer"].state_dict()
    with pytest.raises(ResumeMismatchError) as info:
        load_opd_checkpoint((store, 2), **kwargs)
    assert "world_size 4" in str(info.value) and f"world_size {load_world_size}" in str(info.value)
    assert loaded == [] and kwargs["optimizer"].state_dict() == optimizer_before


def test_restored_teacher_update_count_is_checked(opd_backend, store, opd):
    """The seed's post-check: a checkpoint whose teacher count differs is refused (and nothing is
    restored first)."""
    _layer, optimizer, scheduler = opd.make_training()
    from opd_store.opd._rng import capture_rng_state

    with store.begin(2) as txn:
        with txn.open("rng.pt") as writer:
            torch.save(capture_rng_state(), writer)
        with txn.open("training_state.pt") as writer:
            torch.save(
                {
                    "schema": "opd_checkpoint_v1",
                    "trainer": opd.trainer_state(2),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "config_fingerprint": opd.TinyConfig().fingerprint(),
                    "provenance_fingerprints": opd.PROVENANCE,
                    "world_size": 1,
                    "teacher": {"update_count": 1},
                },
                writer,
            )
    loaded: list = []
    kwargs = opd.load_kwargs(loaded=loaded)
    with pytest.raises(ValueError, match="restored teacher update count differs"):
        load_opd_checkpoint((store, 2), **kwargs)
    assert loaded == []


def test_latest_complete_checkpoint(opd_backend, store, opd):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        latest_complete_checkpoint(store)
    for successful in (3, 12):
        save_opd_checkpoint(**opd.save_kwargs(store, successful=successful))
    store.begin(20).write_bytes("training_state.pt", b"x")  # newer, never committed
    latest = latest_complete_checkpoint(opd_backend.url, storage_options=opd_backend.storage_options)
    assert latest == store.step_url(12)
    assert latest_complete_checkpoint(store) == latest
    assert resolve_checkpoint(latest, opd_backend.storage_options)[1] == 12


def test_checkpoints_dir_accepts_a_store_and_checkpoint_a_store_step_pair(opd_backend, store, opd):
    url = save_opd_checkpoint(**opd.save_kwargs(store))
    loaded: list = []
    state = load_opd_checkpoint((store, 2), **opd.load_kwargs(loaded=loaded))
    assert url == store.step_url(2)
    assert state["successful_updates"] == 2
    assert torch.equal(loaded[0]["ema"], torch.arange(3.0))


def test_local_checkpoint_path_forms(tmp_path, monkeypatch, opd):
    """A local checkpoint is named by an absolute or relative path (str or Path), as the seed's
    Path arguments were, or by a file:// URL."""
    root = tmp_path / "ckpts"
    url = save_opd_checkpoint(**opd.save_kwargs(root))
    assert url == str(root / "step-000002")
    monkeypatch.chdir(root)
    for form in (url, root / "step-000002", "step-000002", "./step-000002", f"file://{url}"):
        store, step = resolve_checkpoint(form)
        assert (store.url, step) == (str(root), 2), form
    state = load_opd_checkpoint("step-000002", **opd.load_kwargs())
    assert state["successful_updates"] == 2
    with pytest.raises(ValueError, match="not a checkpoint"):
        resolve_checkpoint(root)
