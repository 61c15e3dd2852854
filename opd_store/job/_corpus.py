"""The main job's built-in prompt corpus (no downloads), read at a global sample index."""

from __future__ import annotations

CORPUS: tuple[str, ...] = (
    "the spot instance was preempted while the student was learning",
    "a checkpoint is complete when its manifest exists",
    "the teacher scores every rollout of the student",
    "write the payloads first and commit the manifest last",
    "the bucket keeps the checkpoint when the machine is gone",
    "a new machine resumes from the latest complete step",
    "the optimizer state and the scheduler resume exactly",
    "every rank restores its own random state",
    "the adapter weights are small but the run is long",
    "sampling makes the random number generator matter",
    "the learning rate warms up and then decays",
    "a rejected rollout does not update the student",
    "the failure queue belongs to one update only",
    "distillation moves the student toward the teacher",
    "the cluster scheduler moves the job to another node",
    "object stores have no atomic rename",
    "a zombie writer must never change committed bytes",
    "the checksum is computed while the bytes stream",
    "the run survives the loss of its machine",
    "a small model learns from a larger teacher",
    "the prompt cursor advances with every attempt",
    "the same update happens again after resume",
    "a stale listing must never decide the latest step",
    "the manifest names every payload with its size",
)


def prompts_at(start: int, count: int) -> list[str]:
    """``count`` prompts from global sample index ``start`` (wrapping around the corpus)."""
    return [CORPUS[(start + i) % len(CORPUS)] for i in range(count)]


__all__ = ["CORPUS", "prompts_at"]
