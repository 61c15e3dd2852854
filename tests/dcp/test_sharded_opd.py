"""The OPD layer on sharded students, elastic resume and the preemption agreement, with 4 gloo ranks.

One launch (tests/dcp/harness.py, tests/dcp/scenarios_opd.py); then ``load_adapter`` in this very
process (no process group) gathers the LoRA adapter from the 4 ranks' shards.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from harness import run_launch
from opd_testkit.stores import Backend

pytestmark = pytest.mark.timeout(900)


def _draws_from(state: dict) -> list[float]:
    from opd_store.opd import preserve_global_rng
    from opd_store.opd._rng import restore_rng_state

    with preserve_global_rng():
        restore_rng_state(state)
        return [random.random(), float(np.random.rand()), *torch.rand(2, dtype=torch.float64).tolist()]


def test_sharded_opd_checkpoints_elastic_resume_and_preemption(tmp_path):
    backend = Backend("local", str(tmp_path / "store"), {})
    ranks = run_launch({"world_size": 4, "module": "scenarios_opd",
                        "scenarios": ["lora", "full_parameter", "preemption", "rank_dies"],
                        "backend": backend.to_json()}, tmp_path / "run")
    launch = ranks[0]["_launch"]
    assert launch["exit_codes"] == [0, 0, 0, 9], launch["stderr"]
    for rank in ranks[:3]:
        assert all("error" not in scenario for scenario in rank.values() if isinstance(scenario, dict)), rank
    lora = [rank["lora"] for rank in ranks]

    # the seed's rules on every rank, agreed before anything is written
    assert {r["rule"]["type"] for r in lora} == {"DistributedSaveError"}
    assert len({r["rule"]["message"] for r in lora}) == 1
    assert "rank 2 failed: ValueError: sampled rollouts" in lora[0]["rule"]["message"]
    assert lora[0]["steps_after_rule"] == [2]

    # exact, 4 -> 4: state, trainer, scheduler, teacher, own rank state and RNG (last) back
    for rank, result in enumerate(lora):
        exact = result["exact"]
        assert exact["draws"] == result["draws_after_save"], rank
        assert exact["marker"] == [rank] and exact["rng"] == "restored"
        assert exact["trainer"] == {"attempted_updates": 3, "successful_updates": 2, "query_update": 3,
                                    "loss_history": [0.5, 0.25]}
        assert exact["scheduler_epoch"] == 1 and exact["teacher"] == {"update_count": 2}
    assert lora[0]["exact"]["state"]["differing"] == [] and lora[0]["exact"]["state"]["tensors"] == 32

    # exact on 2 ranks: the ResumeMismatchError naming both sizes, on both ranks; nothing changed
    for result in lora[:2]:
        refused = result["exact_on_2"]
        assert refused["type"] == "ResumeMismatchError" and refused["unchanged"]
        assert "saved with world_size 4 and this run has world_size 2" in refused["message"]

    # elastic on 2: the same tensors, ranks 0 and 1 their own RNG, ranks 2 and 3's states reported
    for rank, result in enumerate(lora[:2]):
        elastic = result["elastic_on_2"]
        assert elastic["draws"] == result["draws_after_save"] and elastic["rng"] == "restored"
        assert elastic["unclaimed"] == [2, 3] and elastic["marker"] == [rank]
    assert lora[0]["elastic_on_2"]["state"]["differing"] == []
    # the data position is a global sample index: 2 steps on 4 ranks, the rest on 2, each sample once
    samples = [i for r in lora for batch in r["consumed"] for i in batch]
    samples += [i for r in lora[:2] for batch in r["elastic_on_2"]["rest_of_epoch"] for i in batch]
    assert sorted(samples) == list(range(40))

    # saved on 2, loaded on 4: ranks 2 and 3 derive their RNG from the checkpoint, as anyone would
    from opd_store import CheckpointStore
    from opd_store.opd._elastic import elastic_seed
    from opd_store.opd._rng import derived_rng_state

    fingerprint = CheckpointStore(backend.url).manifest(5).metadata["config_fingerprint"]
    for rank, result in enumerate(lora):
        grown = result["elastic_2_to_4"]
        assert grown["world_sizes"] == [2, 4]
        if rank < 2:
            assert grown["rng"] == "restored" and grown["rank_state"] == [rank]
        else:
            assert grown["rng"] == "derived" and grown["rank_state"] is None
            seed = elastic_seed(step=5, config_fingerprint=fingerprint, rank=rank)
            assert grown["draws"] == _draws_from(derived_rng_state(seed))
    assert lora[2]["elastic_2_to_4"]["draws"] != lora[3]["elastic_2_to_4"]["draws"]
    assert lora[0]["elastic_2_to_4"]["state"]["differing"] == []
    manifest = CheckpointStore(backend.url).manifest(2)
    assert manifest.world_size == 4 and manifest.metadata["mesh_shape"] == [4]
    assert manifest.metadata["opd_schema"] == "opd_sharded_v1" and "config.yaml" in {e.name for e in manifest.payloads}

    # a full-parameter student, 4 -> 2 under elastic
    assert ranks[0]["full_parameter"]["state"]["differing"] == []
    assert ranks[0]["full_parameter"]["state"]["elements"] == 418

    # a SIGTERM seen by rank 2 alone: every rank stops at the same boundary
    for rank in ranks:
        assert rank["preemption"]["seen"] == [None, None, None, ["SIGTERM", "received SIGTERM (seen by rank 2)"]]
    # rank 3 died: the others gave up within the agreement group's 5 s, not the default timeout
    for rank in ranks[:3]:
        dies = rank["rank_dies"]
        assert dies["gave_up"] and dies["raised"] == "RuntimeError" and dies["secs"] < 5.0 + 2.0, dies

    # load_adapter on one process, no process group: the adapter gathered from the 4 ranks' shards
    from opd_store.job import build_student
    from opd_store.opd import load_adapter

    student = build_student(32, seed=42)
    assert load_adapter(lora[0]["url"], student) is None
    saved = torch.load(tmp_path / "run" / "lora-step-2.pt", weights_only=True)["model"]
    params = dict(student.named_parameters())
    assert saved and all(torch.equal(params[name].detach(), tensor) for name, tensor in saved.items())
