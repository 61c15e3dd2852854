"""Elastic resume of replicated (multi-rank, single-writer) checkpoints, in one process.

A checkpoint saved by 4 ranks, resumed by 2 (ranks 0 and 1 get their own RNG back, ranks 2 and 3's
states are reported) and by 6 (ranks 4 and 5 derive theirs from the checkpoint) under
``resume_mode: elastic``; under ``exact`` the same change is refused naming both sizes.
"""

from __future__ import annotations

import logging

import pytest

from opd_store import CheckpointStore, load_opd_checkpoint, save_opd_checkpoint
from opd_store.errors import ResumeMismatchError
from opd_store.opd import preserve_global_rng
from opd_store.opd._elastic import ElasticResume, elastic_seed
from opd_store.opd._rng import capture_rng_state, derived_rng_state, restore_rng_state


def _states(opd, count: int) -> list[dict]:
    states = []
    for rank in range(count):
        opd.seed_all(500 + rank)
        states.append(capture_rng_state())
    return states


def _draws_of(opd, state: dict) -> tuple:
    with preserve_global_rng():
        restore_rng_state(state)
        return opd.next_draws()


def test_elastic_resume_of_a_replicated_checkpoint(tmp_path, opd, caplog):
    store = CheckpointStore(tmp_path / "store")
    states = _states(opd, 4)
    save_opd_checkpoint(**opd.save_kwargs(store, world_size=4, rank_rng_states=states))
    elastic = opd.TinyConfig(resume_mode="elastic")

    with pytest.raises(ResumeMismatchError, match="saved with world_size 4 and this run has world_size 2"):
        load_opd_checkpoint((store, 2), **opd.load_kwargs(world_size=2, rank=0))

    caplog.set_level(logging.WARNING, logger="opd_store.opd")
    for rank in (0, 1):  # below the old world size: its own RNG
        loaded = []
        trainer = load_opd_checkpoint((store, 2), **opd.load_kwargs(config=elastic, world_size=2, rank=rank,
                                                                    loaded=loaded))
        assert trainer["successful_updates"] == 2 and loaded[0]["update_count"] == 2
        assert opd.next_draws() == _draws_of(opd, states[rank])
    assert "saved per-rank states of ranks [2, 3] are not restored" in caplog.text

    fingerprint = opd.TinyConfig().fingerprint()
    for rank in (3, 4, 5):  # on 6 ranks: rank 3 restores its own, 4 and 5 derive theirs
        load_opd_checkpoint((store, 2), **opd.load_kwargs(config=elastic, world_size=6, rank=rank))
        expected = states[rank] if rank < 4 else derived_rng_state(elastic_seed(step=2, config_fingerprint=fingerprint,
                                                                                  rank=rank))
        assert opd.next_draws() == _draws_of(opd, expected), rank


def test_elastic_at_the_same_world_size_restores_what_exact_restores(tmp_path, opd):
    """Under ``elastic`` without a world-size change every rank gets exactly what ``exact`` gives
    it: the same trainer state, optimizer and scheduler state, teacher state and its own RNG."""
    store = CheckpointStore(tmp_path / "store")
    states = _states(opd, 4)
    save_opd_checkpoint(**opd.save_kwargs(store, world_size=4, rank_rng_states=states))
    for rank in range(4):
        restored = {}
        for mode in ("exact", "elastic"):
            loaded: list = []
            kwargs = opd.load_kwargs(config=opd.TinyConfig(resume_mode=mode), world_size=4, rank=rank, loaded=loaded)
            trainer = load_opd_checkpoint((store, 2), **kwargs)
            restored[mode] = (trainer, loaded, opd.next_draws(), kwargs["optimizer"].state_dict(),
                              kwargs["scheduler"].state_dict())
        opd.assert_same(restored["elastic"], restored["exact"], f"rank {rank}")
        assert restored["elastic"][2] == _draws_of(opd, states[rank])
        assert restored["exact"][0]["successful_updates"] == 2 and restored["exact"][3]["state"]


def test_derived_rng_is_a_function_of_the_checkpoint_only():
    first = ElasticResume(saved_world_size=2, world_size=4, rank=3, step=10, config_fingerprint="f" * 64)
    again = ElasticResume(saved_world_size=1, world_size=8, rank=3, step=10, config_fingerprint="f" * 64)
    other = ElasticResume(saved_world_size=2, world_size=4, rank=2, step=10, config_fingerprint="f" * 64)
    assert first.rng_source == "derived" and first.unclaimed_ranks == ()
    assert ElasticResume(4, 2, 0, 10, "f").unclaimed_ranks == (2, 3)
    a, b, c = first.derived_rng(), again.derived_rng(), other.derived_rng()
    assert all(torch_equal(a[key], b[key]) for key in ("torch",)) and a["python"] == b["python"]
    assert a["python"] != c["python"] and not torch_equal(a["torch"], c["torch"])
    # pinned: the derivation is part of the format (another machine must derive the same state):
    # the first 63 bits of SHA-256("opd_store elastic rng v1|step=10|config=ff...f|rank=3")
    assert elastic_seed(step=10, config_fingerprint="f" * 64, rank=3) == 0x5C7DA4DC96721D16


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
