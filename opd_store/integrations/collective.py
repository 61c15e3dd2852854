"""The three collectives a multi-rank framework save needs, and their one-process forms.

A framework save runs on every rank of a ``torch.distributed`` process group. The committing rank
(0) chooses the attempt, every rank writes its own part, rank 0 collects the parts' entries and
commits (docs/protocol.md, "Several ranks, one commit"). Errors travel through the same
collectives, so a rank that fails never leaves the others waiting in a collective it will not
join: rank 0 broadcasts either the attempt id or its error; each rank sends either its entries or
its error; rank 0 broadcasts the outcome.

With no initialised process group (or one process) every function is the identity.
"""

from __future__ import annotations

from typing import Any


def _group_size() -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return 1
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    """``torch.distributed.barrier()`` when a process group of more than one rank is initialised."""
    if _group_size() > 1:
        import torch.distributed as dist

        dist.barrier()


def broadcast_from_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (``broadcast_object_list``)."""
    if _group_size() <= 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_zero(value: Any) -> list[Any] | None:
    """Every rank's ``value`` on rank 0, in rank order (``None`` on the other ranks)."""
    if _group_size() <= 1:
        return [value]
    import torch.distributed as dist

    rank = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


__all__ = ["barrier", "broadcast_from_zero", "gather_to_zero"]
