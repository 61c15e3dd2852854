"""Retention policies: which checkpoints to keep, as pure functions over a list of steps.

Nothing here does I/O. :func:`plan_retention` takes one :class:`StepRecord` per step prefix and the
steps that must be protected, and returns a :class:`RetentionPlan`; the one executor,
:func:`opd_store.retention._executor.apply_retention`, gathers that input from a store and deletes exactly the
plan's ``delete`` steps, manifest first.

Rules (docs/cli.md, "Retention rules"):

* ``keep_last=N`` keeps the N newest **complete** steps. Incomplete, corrupt, legacy or
  uncommitted steps never count, so damaged newer steps never push a good one out (the bug this
  prevents: two half-written newest checkpoints making retention delete the last good one).
* ``keep_every=K`` keeps every complete step whose number is a multiple of K.
* Both together keep the union. A policy with neither keeps everything.
* Never deleted, whatever the policy (the *protected* steps): the step just committed; the newest
  complete step; pinned steps; steps that are not durable yet (a tiered store's local steps whose
  upload has not landed: deleting one would lose its only copy); the step a run resumed from (its
  *parent*, recorded in the manifests of the run) until that run has committed a second complete
  step newer than it (a resumed run that dies before its second save must still find its start);
  the best step a kept step names (manifest metadata ``best_step``: the Hugging Face Trainer's
  ``state.best_model_checkpoint``, which ``load_best_model_at_end`` loads when training ends), as
  long as a kept step names it (a run resumed from the store must still find its best model).
* Only complete, manifest-committed steps are ever deleted. Damaged steps (``incomplete``,
  ``corrupt``) are kept for inspection and reported; ``legacy`` steps and anything without our
  manifest (a checkpoint copied in by another tool) are never touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..store import COMPLETE as _COMPLETE

# Reasons a step is kept (values of RetentionPlan.keep).
KEEP_LAST = "keep-last"
KEEP_EVERY = "keep-every"
KEEP_NEWEST = "newest-complete"
KEEP_JUST_COMMITTED = "just-committed"
KEEP_PINNED = "pinned"
KEEP_PARENT = "resume-parent"
KEEP_NOT_DURABLE = "not-durable"
KEEP_BEST = "best-of-kept"
KEEP_ALL = "no-policy"


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """How many checkpoints to keep.

    Attributes:
        keep_last (int | None): keep this many newest complete steps (``None``: no limit from
            this rule).
        keep_every (int | None): also keep every complete step that is a multiple of this.

    With both ``None`` the policy keeps every step.

    Raises:
        ValueError: a value below 1 or not an int.
    """

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"retention {name} must be an int >= 1 or None, got {value!r}")

    @property
    def keeps_all(self) -> bool:
        """True when the policy deletes nothing."""
        return self.keep_last is None and self.keep_every is None


def check_retention(value: Any, name: str = "retention") -> RetentionPolicy | None:
    """``value`` when it is a :class:`RetentionPolicy` or ``None``: every public entry point taking a
    retention checks it up front (before, ``retention=3`` was accepted and the first save, after
    training and after its commit, died with ``AttributeError: 'int' object has no attribute 'keeps_all'``).

    Raises:
        TypeError: anything else, naming the argument, the value and the policy to write.
    """
    if value is None or isinstance(value, RetentionPolicy):
        return value
    hint = f" (for the newest {value} steps: {name}=RetentionPolicy(keep_last={value}))" if (
        isinstance(value, int) and not isinstance(value, bool) and value >= 1) else ""
    raise TypeError(f"{name} takes a RetentionPolicy or None, got {value!r} ({type(value).__name__}){hint}")


@dataclasses.dataclass(frozen=True)
class RunLineage:
    """Which run is saving, and the step it resumed from (recorded in every manifest it commits).

    Attributes:
        run_id (str): identifies one training run (one process lifetime from start or resume to
            exit); :meth:`new` makes a random one.
        parent_step (int | None): the step the run resumed from; ``None`` for a fresh start.
    """

    run_id: str
    parent_step: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError(f"run_id must be a non-empty str, got {self.run_id!r}")
        parent = self.parent_step
        if parent is not None and (isinstance(parent, bool) or not isinstance(parent, int) or parent < 0):
            raise ValueError(f"parent_step must be a non-negative int or None, got {parent!r}")

    @classmethod
    def new(cls, parent_step: int | None = None) -> "RunLineage":
        """A lineage with a fresh random run id (32 hex digits)."""
        import uuid

        return cls(uuid.uuid4().hex, parent_step)

    def as_metadata(self) -> dict:
        """Manifest metadata keys ``run_id`` and ``parent_step``."""
        return {"run_id": self.run_id, "parent_step": self.parent_step}


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What retention needs to know about one step prefix.

    Attributes:
        step (int): the step.
        status (str): ``complete``, ``incomplete``, ``corrupt``, ``legacy`` or ``uncommitted``.
        size_bytes (int): bytes under the step prefix (what deleting it frees).
        run_id (str | None): the run that committed it (manifest metadata ``run_id``).
        parent_step (int | None): the step that run resumed from (manifest metadata
            ``parent_step``), ``None`` for a run started from scratch.
        best_step (int | None): the run's best checkpoint when this step was saved (manifest
            metadata ``best_step``), kept while this step is.
    """

    step: int
    status: str
    size_bytes: int = 0
    run_id: str | None = None
    parent_step: int | None = None
    best_step: int | None = None

    @classmethod
    def from_metadata(cls, step: int, status: str, size_bytes: int, metadata: dict | None) -> "StepRecord":
        """The record of a step whose manifest has ``metadata`` (``None``: no readable manifest);
        a value of the wrong type reads as absent (a hand-edited manifest protects nothing)."""
        metadata = metadata or {}

        def step_or_none(value):
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        run_id = metadata.get("run_id")
        return cls(step, status, size_bytes, run_id if isinstance(run_id, str) else None,
                   step_or_none(metadata.get("parent_step")), step_or_none(metadata.get("best_step")))


@dataclasses.dataclass(frozen=True)
class RetentionPlan:
    """The result of :func:`plan_retention`.

    Attributes:
        keep (Mapping[int, tuple[str, ...]]): complete steps kept, with every reason.
        delete (tuple[int, ...]): complete steps to delete, ascending.
        untouched (Mapping[int, str]): steps retention never deletes, with their status
            (damaged, legacy, uncommitted).
        freed_bytes (int): bytes the deletions free.
    """

    keep: Mapping[int, tuple[str, ...]]
    delete: tuple[int, ...]
    untouched: Mapping[int, str]
    freed_bytes: int


def protected_parents(records: Iterable[StepRecord], *, current_run: tuple[str, int | None] | None = None) -> set[int]:
    """Steps protected as a run's resume parent.

    A run ``R`` that resumed from step ``P`` records ``run_id=R`` and ``parent_step=P`` in each of
    its manifests. ``P`` stays protected until ``R`` has committed two complete steps newer than
    ``P`` (its first checkpoint after the resume, then a newer one), so a resumed run can always
    go back to where it started until it has a checkpoint to spare.

    Args:
        records (Iterable[StepRecord]): the store's steps.
        current_run (tuple[str, int | None] | None): ``(run_id, parent_step)`` of the calling run,
            known even before its first commit.

    Returns:
        set[int]: the protected parent steps.
    """
    records = list(records)
    parents: dict[str, set[int]] = {}
    for record in records:
        if record.run_id is not None and record.parent_step is not None:
            parents.setdefault(record.run_id, set()).add(record.parent_step)
    if current_run is not None and current_run[1] is not None:
        parents.setdefault(current_run[0], set()).add(current_run[1])
    protected: set[int] = set()
    for run_id, steps in parents.items():
        for parent in steps:
            newer = [r for r in records if r.run_id == run_id and r.status == _COMPLETE and r.step > parent]
            if len(newer) < 2:
                protected.add(parent)
    return protected


def plan_retention(
    records: Sequence[StepRecord],
    policy: RetentionPolicy,
    *,
    pinned: Iterable[int] = (),
    just_committed: int | None = None,
    current_run: tuple[str, int | None] | None = None,
    not_durable: Iterable[int] = (),
) -> RetentionPlan:
    """Decide which steps a policy keeps and deletes. Pure: no I/O, same input, same plan.

    Args:
        records (Sequence[StepRecord]): every step prefix of the store (any order).
        policy (RetentionPolicy): keep-last / keep-every.
        pinned (Iterable[int]): pinned steps (never deleted).
        just_committed (int | None): the step the caller has just committed (never deleted).
        not_durable (Iterable[int]): steps whose only durable copy is not made yet (never
            deleted; a tiered store's local steps that are not in the bucket).
        current_run (tuple[str, int | None] | None): ``(run_id, parent_step)`` of the calling run;
            see :func:`protected_parents`.

    Returns:
        RetentionPlan: what to keep and delete, and the bytes freed.
    """
    by_step = {record.step: record for record in records}
    complete = sorted(step for step, record in by_step.items() if record.status == _COMPLETE)
    untouched = {step: record.status for step, record in sorted(by_step.items()) if record.status != _COMPLETE}
    reasons: dict[int, list[str]] = {step: [] for step in complete}

    def add(step: int, reason: str) -> None:
        if step in reasons:
            reasons[step].append(reason)

    if policy.keeps_all:
        for step in complete:
            add(step, KEEP_ALL)
    if policy.keep_last is not None:
        for step in complete[-policy.keep_last:]:
            add(step, KEEP_LAST)
    if policy.keep_every is not None:
        for step in complete:
            if step % policy.keep_every == 0:
                add(step, KEEP_EVERY)
    if complete:
        add(complete[-1], KEEP_NEWEST)
    if just_committed is not None:
        add(just_committed, KEEP_JUST_COMMITTED)
    for step in sorted(set(pinned)):
        add(step, KEEP_PINNED)
    for step in sorted(set(not_durable)):
        add(step, KEEP_NOT_DURABLE)
    for step in sorted(protected_parents(by_step.values(), current_run=current_run)):
        add(step, KEEP_PARENT)
    for step in [step for step, why in reasons.items() if why]:  # what a kept step still refers to
        best = by_step[step].best_step
        if best is not None and best != step:
            add(best, KEEP_BEST)

    keep = {step: tuple(why) for step, why in reasons.items() if why}
    delete = tuple(step for step in complete if step not in keep)
    return RetentionPlan(
        keep=keep,
        delete=delete,
        untouched=untouched,
        freed_bytes=sum(by_step[step].size_bytes for step in delete),
    )


__all__ = [
    "KEEP_ALL",
    "KEEP_BEST",
    "KEEP_EVERY",
    "KEEP_JUST_COMMITTED",
    "KEEP_LAST",
    "KEEP_NEWEST",
    "KEEP_NOT_DURABLE",
    "KEEP_PARENT",
    "KEEP_PINNED",
    "RetentionPlan",
    "RetentionPolicy",
    "RunLineage",
    "StepRecord",
    "check_retention",
    "plan_retention",
    "protected_parents",
]
