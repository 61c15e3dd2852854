"""The collectives of a framework save or fetch on several ranks, and their one-process forms.

A framework save runs on every rank of a ``torch.distributed`` process group (the Hugging Face
``Trainer`` writes ``checkpoint-N`` on every rank). The committing rank (0) chooses the attempt,
every rank writes its own part, rank 0 collects the parts' entries and commits (docs/protocol.md,
"Several ranks, one commit"); the OPD layer's :func:`opd_store.opd.distributed.save_collective` is
the same protocol for payloads held in memory. Every step that can fail locally (listing a
directory, checking it, uploading a part, committing) runs *before* the collective that follows it
and its outcome travels through that collective, so a rank that fails never leaves the others
waiting in a collective it will not join (they would wait for the process group's timeout, 30
minutes by default under the ``Trainer``): :meth:`Ranks.agree` gathers every rank's value or error,
and raises the same :class:`~opd_store.errors.DistributedSaveError` on every rank when any failed.

With no initialised process group (or one process) the collectives are the identity and
:meth:`Ranks.agree` re-raises the local error itself, so a single process sees the precise error
(``IncompleteCheckpointError`` naming the file, ``CommitConflictError``...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import CommitConflictError, DistributedCommitConflictError, DistributedSaveError
from ..opd.distributed import RankGroup, current_group


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's rank in the run and the collectives over the run's process group.

    Attributes:
        rank (int): this process's rank (0 without a process group).
        world_size (int): processes in the group (1 without one).
        group (RankGroup | None): the group, ``None`` for one process.
    """

    rank: int
    world_size: int
    group: RankGroup | None

    @classmethod
    def current(cls) -> "Ranks":
        """The default ``torch.distributed`` process group as :class:`Ranks` (one rank without one)."""
        group = current_group()
        return cls(0, 1, None) if group is None else cls(group.rank, group.world_size, group)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a collective: every rank calls it)."""
        return value if self.group is None else self.group.broadcast(value)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, index = rank (a collective: every rank calls it)."""
        return [value] if self.group is None else self.group.all_gather(value)

    def agree(self, value: Any, error: BaseException | None, *, url: str, step: int) -> list[Any]:
        """Gather every rank's ``value`` or ``error``; return the values when no rank failed.

        A collective: every rank calls it, whatever happened locally.

        Args:
            value (Any): this rank's result (picklable).
            error (BaseException | None): this rank's failure, if any.
            url (str): the store, named in the error.
            step (int): the step being saved, named in the error.

        Returns:
            list[Any]: every rank's value, index = rank.

        Raises:
            BaseException: ``error`` itself, with one process.
            DistributedCommitConflictError: every failing rank found the step already committed
                (also a ``FileExistsError``); on every rank.
            DistributedSaveError: some rank failed (an ``OSError``); on every rank, naming each
                failing rank and its error (``rank 1 failed: IncompleteCheckpointError: ...``).
        """
        if self.group is None:
            if error is not None:
                raise error
            return [value]
        described = None if error is None else (type(error).__name__, str(error), isinstance(error, CommitConflictError))
        reports = self.group.all_gather((value, described))
        failures = {rank: report[1] for rank, report in enumerate(reports) if report[1] is not None}
        if not failures:
            return [report[0] for report in reports]
        cls = DistributedCommitConflictError if all(c for _n, _m, c in failures.values()) else DistributedSaveError
        text = "; ".join(f"rank {rank} failed: {name}: {message}" for rank, (name, message, _c) in sorted(failures.items()))
        raise cls.from_failures(
            f"{url}: step {step} was not committed: {text}",
            {rank: f"{name}: {message}" for rank, (name, message, _c) in failures.items()},
        ) from error


__all__ = ["Ranks"]
