"""Write OPD checkpoints exactly as the seed implementation did (the legacy layout).

The seed (``shared/seeds``) saved into a local ``step-NNNNNN`` directory through a staging
directory: ``adapter/`` via ``shared.artifacts.save_adapter``, ``rng.pt`` or ``rng-rank-XX.pt`` via
plain ``torch.save`` of ``shared.artifacts.rng_state()``, ``training_state.pt`` via plain
``torch.save`` (pickle, no sanitising), ``config.yaml``, then the ``COMPLETE`` marker and a rename.

``shared.artifacts`` is not available to us, so its two helpers are reconstructed here the way the
seed used them:

* ``rng_state()``: ``{"python": random.getstate(), "numpy": np.random.get_state(),
  "torch": torch.get_rng_state()}`` plus ``"cuda": torch.cuda.get_rng_state_all()`` when CUDA is
  available; numpy's state is its own tuple holding a ``uint32`` ndarray, so the file needs numpy's
  reconstructor to load (the allow-list of :mod:`opd_store.opd._safe_load`).
* ``save_adapter(model, processor, directory)``: ``model.save_pretrained(directory)`` and, when a
  processor is given, ``processor.save_pretrained(directory)`` into the same directory.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import numpy as np
import torch
import yaml


class PickledNote:
    """A plain Python object, as a seed trainer might have kept in its state: seed files pickled
    it, weights-only loading refuses it."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PickledNote) and other.text == self.text


def seed_rng_state() -> dict:
    """The seed's ``shared.artifacts.rng_state()`` (reconstructed, see the module docstring)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_save_adapter(model, processor, directory: Path) -> None:
    """The seed's ``shared.artifacts.save_adapter`` (reconstructed)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    if processor is not None:
        processor.save_pretrained(str(directory))


def write_seed_checkpoint(
    *,
    checkpoints_dir: Path,
    model,
    processor,
    optimizer,
    scheduler,
    trainer_state: dict,
    config,
    provenance_fingerprints: dict,
    teacher_state: dict,
    world_size: int = 1,
    rank_rng_states: list | None = None,
    mark_complete: bool = True,
    schema: str | None = None,
) -> Path:
    """Save like the seed's ``save_opd_checkpoint`` (same validations skipped: tests feed it valid
    state). ``mark_complete=False`` leaves a ``step-NNNNNN`` directory without ``COMPLETE`` (a
    partial copy); ``schema`` overrides the schema string (to write an unknown one)."""
    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    step = int(trainer_state["successful_updates"])
    final = checkpoints_dir / f"step-{step:06d}"
    if final.exists():
        raise FileExistsError(f"checkpoint already exists: {final}")
    temporary = checkpoints_dir / f".tmp-step-{step:06d}-{uuid.uuid4().hex}"
    temporary.mkdir(parents=False, exist_ok=False)
    seed_save_adapter(model, processor, temporary / "adapter")
    if rank_rng_states is None:
        rank_rng_states = [seed_rng_state()]
    if len(rank_rng_states) != world_size:
        raise ValueError("rank RNG states must match OPD world size")
    if world_size == 1:
        torch.save(rank_rng_states[0], temporary / "rng.pt")
    else:
        for rank, state in enumerate(rank_rng_states):
            torch.save(state, temporary / f"rng-rank-{rank:02d}.pt")
    torch.save(
        {
            "schema": schema or ("opd_checkpoint_v1" if world_size == 1 else "opd_checkpoint_v2"),
            "trainer": trainer_state,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "config_fingerprint": config.fingerprint(),
            "provenance_fingerprints": provenance_fingerprints,
            "world_size": world_size,
            "teacher": teacher_state,
        },
        temporary / "training_state.pt",
    )
    (temporary / "config.yaml").write_text(yaml.safe_dump(config.as_dict(), sort_keys=False), encoding="utf-8")
    if mark_complete:
        (temporary / "COMPLETE").write_text("complete\n", encoding="utf-8")
    temporary.rename(final)
    return final
