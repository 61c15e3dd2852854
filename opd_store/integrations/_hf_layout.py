"""What a Hugging Face ``Trainer`` checkpoint directory holds, and which rank owns which file.

Pure functions over file names (no I/O, no transformers import). The rules come from
``transformers.Trainer._save_checkpoint`` (transformers 4.46 - 5.x; TRL's ``GKDTrainer``,
``GOLDTrainer`` and ``DistillationTrainer`` save only through it):

* the process with ``args.should_save`` (rank 0) writes the model or adapter
  (``model.safetensors``, ``pytorch_model.bin``, ``adapter_model.safetensors``, ...; sharded
  weights as ``*.index.json`` plus the shards it names), ``training_args.bin``, the tokenizer or
  processor files, ``trainer_state.json``, and unless ``save_only_model`` ``optimizer.pt``,
  ``scheduler.pt`` and (with a gradient scaler) ``scaler.pt``;
* every process writes its own RNG state: ``rng_state.pth`` when ``world_size == 1``, else
  ``rng_state_{process_index}.pth``; sharded FSDP state (``torch.distributed.checkpoint``) is one
  ``__{rank}_{n}.distcp`` file per rank inside its directory;
* transformers' just-in-time checkpoint (``enable_jit_checkpoint``) writes
  ``checkpoint-is-incomplete.txt`` before it saves and removes it after.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.bin"
JIT_SENTINEL_NAME = "checkpoint-is-incomplete.txt"
WEIGHT_NAMES = (
    "model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin",
    "model.safetensors.index.json", "pytorch_model.bin.index.json",
)
_RANK_FILE = re.compile(r"(?:^|/)rng_state_(\d+)\.pth$|(?:^|/)__(\d+)_\d+\.distcp$")


def checkpoint_dirname(step: int) -> str:
    """``checkpoint-{step}``, the Trainer's directory name for ``global_step == step``."""
    return f"{CHECKPOINT_PREFIX}{step}"


def step_of_dirname(path: str | None) -> int | None:
    """``N`` of a path whose last part is ``checkpoint-N``; ``None`` for anything else."""
    name = Path(path).name if path else ""
    digits = name[len(CHECKPOINT_PREFIX):]
    return int(digits) if name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else None


def best_step_of(state) -> int | None:
    """The step of the Trainer's best checkpoint, or ``None`` (no ``metric_for_best_model``, or no
    evaluation yet).

    ``state.best_model_checkpoint`` (a ``TrainerState``; the directory ``load_best_model_at_end``
    loads at the end of training and ``save_total_limit`` never deletes) is set by
    ``Trainer._save_checkpoint`` only once that directory exists, so it is the one read;
    ``best_global_step`` (transformers >= 4.51) names a step before its checkpoint is saved.
    """
    return step_of_dirname(getattr(state, "best_model_checkpoint", None))


def owner_rank(name: str, world_size: int) -> int:
    """The rank whose part a file belongs to: its own RNG state or ``.distcp`` shard, else rank 0.

    Raises:
        ValueError: a rank-named file of a rank outside ``[0, world_size)`` (a directory left by a
            run with more processes).
    """
    match = _RANK_FILE.search(name)
    if match is None:
        return 0
    rank = int(match.group(1) or match.group(2))
    if world_size > 1 and rank >= world_size:
        raise ValueError(f"file {name!r} belongs to rank {rank}, but this run has world_size {world_size}")
    return rank if world_size > 1 else 0


def files_of_rank(files: Mapping[str, Path], rank: int, world_size: int) -> dict[str, Path]:
    """The entries of ``files`` this rank uploads (see :func:`owner_rank`)."""
    return {name: path for name, path in files.items() if owner_rank(name, world_size) == rank}


def missing_files(
    files: Mapping[str, Path],
    *,
    rank: int,
    world_size: int,
    save_only_model: bool = False,
    optimizer_in_files: bool = True,
) -> list[str]:
    """What makes this rank's share of a checkpoint directory incomplete; empty when complete.

    Args:
        files (Mapping[str, Path]): this rank's files (payload name -> path).
        rank (int): the process index.
        world_size (int): processes in the run.
        save_only_model (bool): ``TrainingArguments.save_only_model`` (no optimizer, scheduler, RNG).
        optimizer_in_files (bool): whether ``optimizer.pt``/``scheduler.pt`` are expected
            (``False`` under DeepSpeed or FSDP, which write their own layouts).

    Returns:
        list[str]: one line per problem, each naming the file.
    """
    problems = []
    names = set(files)
    if JIT_SENTINEL_NAME in names:
        problems.append(f"{JIT_SENTINEL_NAME} is present: the Trainer's just-in-time save did not finish")
    expected: list[str] = []
    if not save_only_model:
        expected.append("rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth")
    if rank == 0:
        expected += [TRAINER_STATE_NAME, TRAINING_ARGS_NAME]
        if not save_only_model and optimizer_in_files:
            expected += ["optimizer.pt", "scheduler.pt"]
        if not names.intersection(WEIGHT_NAMES) and not any(n.startswith("pytorch_model_fsdp") for n in names):
            problems.append("no model weights: none of " + ", ".join(WEIGHT_NAMES))
        for index_name in names.intersection({"model.safetensors.index.json", "pytorch_model.bin.index.json"}):
            expected += sorted(set(_shards_of(files[index_name])))
    for name in expected:
        if name not in names:
            problems.append(f"{name} is missing")
        elif name.endswith((".pt", ".pth", ".bin", ".safetensors", ".json")) and files[name].stat().st_size == 0:
            problems.append(f"{name} is empty (0 bytes)")
    return problems


def _shards_of(index_path: Path) -> Iterable[str]:
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map", {})
    except (OSError, ValueError):
        return ["<a readable " + index_path.name + ">"]
    return weight_map.values() if isinstance(weight_map, dict) else []


__all__ = [
    "CHECKPOINT_PREFIX",
    "best_step_of",
    "step_of_dirname",
    "JIT_SENTINEL_NAME",
    "TRAINER_STATE_NAME",
    "TRAINING_ARGS_NAME",
    "WEIGHT_NAMES",
    "checkpoint_dirname",
    "files_of_rank",
    "missing_files",
    "owner_rank",
]
