"""``torch.distributed`` for the OPD layer: the process group, collective loads, rank-0 decisions.

Multi-rank saves run the collectives of :mod:`opd_store.pipeline._collective` over
:class:`RankGroup`; loads run on each rank, then agree (:func:`load_collective`: when one failed,
every rank raises); shared decisions are made on rank 0 and broadcast (:func:`decide_on_rank0`).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import DistributedLoadError
from ..pipeline import describe_failure, failure_text
from ..runtime import PreemptionNotice, PreemptionWatcher

logger = logging.getLogger("opd_store.opd")

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """This process's place in the default ``torch.distributed`` process group.

    Attributes:
        rank (int): this process's rank in ``group``, ``0 <= rank < world_size``.
        world_size (int): ranks in the group (``> 1``).
        group (ProcessGroup | None): the process group; ``None`` is the default group.
    """

    rank: int
    world_size: int
    group: Any = None

    @classmethod
    def of(cls, process_group: Any = None) -> "RankGroup":
        """This process's place in ``process_group`` (default: the default group), initialised."""
        return cls(dist.get_rank(process_group), dist.get_world_size(process_group), process_group)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), index = rank. A collective: every rank must call it."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank. A collective: every rank must call it."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]


def current_group(*, rank: int | None = None, world_size: int | None = None) -> RankGroup | None:
    """The initialised process group as a :class:`RankGroup`; ``None`` without one (or with one rank).

    Args:
        rank (int | None), world_size (int | None): the caller's; must equal the group's when given.

    Raises:
        ValueError: they differ from the group's (a misconfigured rank would write another rank's
            part), or ``rank`` is not 0 without a group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if rank not in (None, 0):
            raise ValueError(f"rank {rank} was given but no torch.distributed process group is initialised")
        return None
    group = RankGroup(dist.get_rank(), dist.get_world_size())
    check_group_args(group, rank=rank, world_size=world_size)
    return None if group.world_size == 1 else group


def check_group_args(group: RankGroup, *, rank: int | None, world_size: int | None) -> None:
    """Check a caller's ``rank``/``world_size`` against the group, inside the first collective, so a
    wrong argument fails every rank at once rather than hanging the others until the timeout.

    Raises:
        ValueError: they differ from the group's.
    """
    if rank is not None and rank != group.rank:
        raise ValueError(f"rank {rank} differs from the process group's rank {group.rank}")
    if world_size is not None and world_size != group.world_size:
        raise ValueError(f"world_size {world_size} differs from the process group's world size {group.world_size}")


def load_collective(group: RankGroup, load: Callable[[], T]) -> T:
    """Run ``load`` on every rank, then agree on the outcome (a collective: every rank calls it).

    Returns:
        the local result, when every rank succeeded.

    Raises:
        Exception: the local error itself when every rank failed with the same type and message.
        DistributedLoadError: (an ``OSError``) some ranks failed, or differently; on every rank,
            naming each failing rank and its error.
    """
    result = None
    local_error: BaseException | None = None
    try:
        result = load()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        local_error = exc
    reports = group.all_gather(describe_failure(local_error))
    failures = {rank: report for rank, report in enumerate(reports) if report is not None}
    if not failures:
        return result
    if local_error is not None and len(failures) == group.world_size and len(set(failures.values())) == 1:
        raise local_error
    raise DistributedLoadError.from_failures(
        f"the checkpoint load failed on {len(failures)} of {group.world_size} ranks: {failure_text(failures)}",
        {rank: f"{name}: {message}" for rank, (name, message, _c) in failures.items()},
    ) from local_error


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - replaced by a plain error with the same text
        return RuntimeError(f"{type(error).__name__}: {error}")


def decide_on_rank0(group: RankGroup, decide: Callable[[], T]) -> T:
    """Run ``decide`` on rank 0 and return its result on every rank, so every rank resumes from the
    same step even while another writer commits.

    Rank obligations: every rank calls this; ``decide`` runs no collective (not
    :func:`latest_complete_checkpoint`, which is one).

    Raises:
        Exception: ``decide``'s error on rank 0, on every rank (a ``RuntimeError`` with its text when
            it cannot be pickled).
    """
    outcome = None
    if group.rank == 0:
        try:
            outcome = (decide(), None)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            outcome = (None, _picklable(exc))
    value, error = group.broadcast(outcome)
    if error is not None:
        raise error
    return value


def agreement_group(timeout_secs: float) -> RankGroup:
    """A gloo group of every rank with its own ``timeout_secs``, for :func:`agree_on_notice`, so a rank
    that stops answering fails the others in that time. Every rank calls it (a collective).
    """
    import datetime

    return RankGroup.of(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_secs)))


def agree_on_notice(watcher: PreemptionWatcher | None, group: RankGroup | None) -> PreemptionNotice | None:
    """At an update boundary: the preemption notice any rank has seen, agreed by every rank, so every
    rank checkpoints the same step (docs/spot.md, "Several ranks").

    One ``all_reduce`` of a flag per call (a gather only when a rank has a notice); the agreed notice
    is the one with the earliest deadline, its ``detail`` naming the rank that saw it.

    Rank obligations: every rank of ``group`` calls it at the same boundaries; use a group with a
    short timeout (:func:`agreement_group`) so a dead rank fails it quickly.

    Returns:
        PreemptionNotice | None: the agreed notice, or ``None`` when no rank has one.

    Raises:
        RuntimeError: the collective failed (a rank died or did not answer within the timeout).
    """
    local = watcher.notice if watcher is not None and watcher.should_checkpoint_now() else None
    if group is None:
        return local
    import torch

    flag = torch.tensor([0 if local is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.group)
    if not int(flag.item()):
        return None
    reports = group.all_gather(None if local is None else (local.source, local.detail, local.secs_left()))
    seen = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    rank, (source, detail, secs_left) = min(seen, key=lambda item: (item[1][2] is None, item[1][2] or 0.0, item[0]))
    now = time.monotonic()
    notice = PreemptionNotice(source, f"{detail} (seen by rank {rank})", now,
                              None if secs_left is None else now + secs_left)
    if watcher is not None:
        watcher.notify(notice.source, notice.detail, notice.deadline_monotonic)
    return notice


__all__ = ["RankGroup", "agree_on_notice", "agreement_group", "check_group_args", "current_group", "decide_on_rank0", "load_collective"]
