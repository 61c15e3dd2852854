"""Bit-for-bit comparison of two runs' final training state (adapter weights, optimizer
``state_dict()``, trainer counters), the verdict of the kill-and-resume demos.
"""

from __future__ import annotations

from typing import Any

import torch


def adapter_and_optimizer_differences(reference: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """What differs between two final states' ``adapter`` and ``optimizer`` entries.

    Args:
        reference (dict): the uninterrupted run's state: ``adapter`` ({name: tensor}) and
            ``optimizer`` (a ``torch.optim.Optimizer.state_dict()``).
        candidate (dict): the resumed run's, alike.

    Returns:
        list[str]: one line per difference (a parameter name, an optimizer state field); empty
        when the two are bit-identical.
    """
    problems = []
    if reference["adapter"].keys() != candidate["adapter"].keys():
        problems.append("adapter parameter names differ")
    for name, tensor in reference["adapter"].items():
        other = candidate["adapter"].get(name)
        if other is None or not torch.equal(tensor, other):
            problems.append(f"adapter weight {name} differs")
    ref_opt, cand_opt = reference["optimizer"], candidate["optimizer"]
    if ref_opt["param_groups"] != cand_opt["param_groups"]:
        problems.append("optimizer param_groups differ")
    for key, state in ref_opt["state"].items():
        other = cand_opt["state"].get(key, {})
        for field, value in state.items():
            theirs = other.get(field)
            same = (torch.is_tensor(theirs) and torch.equal(value, theirs)) if torch.is_tensor(value) else value == theirs
            if not same:
                problems.append(f"optimizer state {key}.{field} differs")
    return problems


def job_state_differences(reference: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """What differs between two final states of the main job: adapter and optimizer as
    :func:`adapter_and_optimizer_differences` compares them, plus the ``trainer`` counters (a run that
    skipped or repeated an update differs there even when its weights match).

    Returns:
        list[str]: one line per difference; empty when the two are bit-identical.
    """
    problems = adapter_and_optimizer_differences(reference, candidate)
    if reference["trainer"] != candidate["trainer"]:
        problems.append(f"trainer counters differ: {reference['trainer']} vs {candidate['trainer']}")
    return problems


__all__ = ["adapter_and_optimizer_differences", "job_state_differences"]
