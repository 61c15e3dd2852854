"""``torch.distributed`` for the OPD layer: the process group, collective loads, rank-0 decisions.

With a process group initialised (NCCL in production, gloo in tests), every rank calls
:func:`~opd_store.opd._save.save_opd_checkpoint`; its write and commit stages run on every rank as
the collectives of :mod:`opd_store.pipeline._collective`, over :class:`RankGroup` (the group's
object collectives ``all_gather_object`` and ``broadcast_object_list``).

Loads (:func:`load_collective`) run locally on each rank, then gather the outcome: when some rank
failed, every rank raises. Decisions that must be the same everywhere (which checkpoint is the
latest) are made on rank 0 and broadcast (:func:`decide_on_rank0`).
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
    """The initialised process group as a :class:`RankGroup`, or ``None`` without one (or with one rank).

    Args:
        rank (int | None): the caller's rank; must equal the group's when given.
        world_size (int | None): the caller's world size; must equal the group's when given.

    Raises:
        ValueError: ``rank`` or ``world_size`` differ from the process group's (a misconfigured
            rank would otherwise write another rank's part), or ``rank`` is not 0 without a group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if rank not in (None, 0):
            raise ValueError(f"rank {rank} was given but no torch.distributed process group is initialised")
        return None
    group = RankGroup(dist.get_rank(), dist.get_world_size())
    check_group_args(group, rank=rank, world_size=world_size)
    return None if group.world_size == 1 else group


def check_group_args(group: RankGroup, *, rank: int | None, world_size: int | None) -> None:
    """Check a caller's ``rank``/``world_size`` arguments against the process group.

    Multi-rank saves and loads call this inside their first collective, so a rank with a wrong
    argument fails every rank at once instead of leaving the others waiting on the collective until
    the process group's timeout (no rank may hang when one rank fails).

    Raises:
        ValueError: ``rank`` or ``world_size`` differ from the group's (a misconfigured rank would
            otherwise write another rank's part).
    """
    if rank is not None and rank != group.rank:
        raise ValueError(f"rank {rank} differs from the process group's rank {group.rank}")
    if world_size is not None and world_size != group.world_size:
        raise ValueError(f"world_size {world_size} differs from the process group's world size {group.world_size}")


def load_collective(group: RankGroup, load: Callable[[], T]) -> T:
    """Run ``load`` on every rank, then agree on the outcome.

    Rank obligations: every rank calls this (a collective).

    Returns:
        the local result, when every rank's ``load`` succeeded.

    Raises:
        Exception: the local error itself when every rank failed with the same error type and
            message (a world-size change: a ``ResumeMismatchError`` naming both sizes).
        opd_store.errors.DistributedLoadError: (an ``OSError``) some ranks failed, or they failed
            differently; every rank raises it, naming each failing rank and its error.
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
    """Run ``decide`` on rank 0 only and return its result on every rank (or raise its error).

    Used so that every rank resumes from the same checkpoint even while another writer is
    committing: each rank listing the store itself could see different latest steps.

    Rank obligations: every rank calls this (a collective); ``decide`` must not run collectives
    itself (it runs on rank 0 only), e.g. not :func:`latest_complete_checkpoint`, which is one.

    Raises:
        Exception: the error ``decide`` raised on rank 0, re-raised on every rank (same type and
            message; a ``RuntimeError`` with its text when it cannot be pickled).
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
    """A gloo group of every rank with a timeout of its own, for :func:`agree_on_notice`: a rank
    that stops answering makes the others fail there within ``timeout_secs``, whatever the default
    group's timeout. Rank obligations: every rank calls it (creating a group is a collective)."""
    import datetime

    return RankGroup.of(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_secs)))


def agree_on_notice(watcher: PreemptionWatcher | None, group: RankGroup | None) -> PreemptionNotice | None:
    """At an update boundary: the preemption notice any rank has seen, agreed by every rank.

    One small collective per call (an ``all_reduce`` of one flag; a gather of the notices only
    when a rank has one), so every rank checkpoints the same step: a notice seen by one rank
    (its SIGTERM, the AWS or GCE metadata notice) stops every rank at the same boundary. The
    agreed notice is the one with the earliest deadline (the first rank's when none has one); its
    ``detail`` names the rank that saw it, its deadline is on this rank's monotonic clock.

    Rank obligations: every rank of ``group`` calls it at the same boundaries (a collective). Run
    it on a group with a short timeout (``dist.new_group(backend="gloo", timeout=...)``): a rank
    that died makes it fail within that time (gloo: at once, the peer's connection is closed),
    never after the default group's long timeout.

    Returns:
        PreemptionNotice | None: the agreed notice, or ``None`` when no rank has one.

    Raises:
        RuntimeError: the collective failed (a rank died or did not answer within the group's timeout).
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
