"""A checkpoint that lacks one rank's RNG part: a load that misses it fails naming the step, the rank
and the part."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from rank_worker import Adapter, Config  # noqa: E402

from opd_store import CheckpointStore  # noqa: E402
from opd_store.errors import CheckpointNotFoundError  # noqa: E402
from opd_store.opd import load_opd_checkpoint, save_opd_checkpoint  # noqa: E402
from opd_store.opd._rng import capture_rng_state  # noqa: E402


def _training():
    model = Adapter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
    return model, optimizer, scheduler


def test_a_load_missing_rank_1s_rng_part_names_step_rank_and_part(tmp_path):
    model, optimizer, scheduler = _training()
    source = CheckpointStore(tmp_path / "source")
    save_opd_checkpoint(
        checkpoints_dir=source, model=model, processor=None, optimizer=optimizer, scheduler=scheduler,
        trainer_state={"attempted_updates": 4, "successful_updates": 4, "query_update": 4}, config=Config(),
        provenance_fingerprints={"corpus": "c0ffee"}, teacher_state={"update_count": 4}, world_size=2,
        rank_rng_states=[capture_rng_state(), capture_rng_state()],
    )
    # A store whose step 4 was committed without rank 1's part (as no save of ours would commit).
    damaged = CheckpointStore(tmp_path / "damaged")
    manifest = source.manifest(4)
    with damaged.begin(4, world_size=2, metadata=dict(manifest.metadata)) as txn:
        for name in source.names(4):
            if name != "rng-rank-01.pt":
                txn.write_bytes(name, source.read(4, name))
    kwargs = dict(optimizer=optimizer, scheduler=scheduler, config=Config(),
                  provenance_fingerprints={"corpus": "c0ffee"}, teacher_state_loader=lambda state: None,
                  world_size=2)
    assert load_opd_checkpoint(damaged.step_url(4), rank=0, **kwargs)["successful_updates"] == 4
    with pytest.raises(CheckpointNotFoundError) as caught:
        load_opd_checkpoint(damaged.step_url(4), rank=1, **kwargs)
    assert str(caught.value) == (f"{damaged.step_url(4)}: step 4 has no RNG state of rank 1 (rng-rank-01.pt); "
                                 "it cannot resume that rank")
