"""Planning saves from measurements: the final save against a notice's deadline, the Young/Daly
interval, and ``--checkpoint-every auto``. Pure functions and small state, no I/O.

**The final save.** A notice with a deadline (AWS ``instance-action`` two minutes ahead, GCE 30 s,
``--notice-deadline-secs`` for a signal) leaves a known time. A save that cannot commit before the
machine goes is lost whole and leaves an orphan attempt for ``gc``; the notice is better spent
exiting at once. :class:`SaveEstimator` predicts a save's seconds to commit from this run's
measured saves to this store, as ``fixed + size_bytes / throughput``; :func:`plan_final_save`
saves only when ``estimate x SAFETY_FACTOR + SAFETY_SECS`` fits in the time left.

**Young/Daly.** For a save costing ``C`` seconds of progress and a mean time between failures
``M``, the first-order optimal interval between saves is ``sqrt(2 C M)`` (Young 1974; Daly 2006
adds a restart term and higher orders). It assumes failures arrive as a Poisson process
(exponential times between them), ``C`` much smaller than ``M``, and a save cost that does not
depend on when it is taken (field notes, section 6).

**auto.** :class:`AutoInterval` starts from the user's interval and, after each committed save,
moves it toward the Young/Daly interval in updates, at most halving or doubling it per save and
never outside ``[1, MAX_AUTO_EVERY]``. Each new interval is journaled with the save
(``next_checkpoint_every``), and a resume continues from the journaled value of the step it
resumed from, so the schedule is a function of the journal (a lost journal restarts from the
user's interval; the training itself is bit-exact either way: a save never moves the run's state).
"""

from __future__ import annotations

import dataclasses
import math

SAFETY_FACTOR = 1.5
"""The final save must fit in the time left with this factor on its estimate (and :data:`SAFETY_SECS`):
a store slower than measured (throttling, a cold connection) must not turn a committed save into a
lost one with an orphan."""
SAFETY_SECS = 1.0
MAX_AUTO_EVERY = 100_000
ESTIMATE_WINDOW = 8
"""Saves the estimate rests on (the newest ones): a store's throughput drifts over a long run."""


@dataclasses.dataclass(frozen=True)
class Measured:
    """One measured save: ``size_bytes`` committed in ``commit_secs`` seconds (begin to commit)."""

    size_bytes: int
    commit_secs: float


class SaveEstimator:
    """Seconds to commit a save of a given size, from measured saves (module docstring).

    With saves of different sizes (spread over 10%), a least-squares line ``fixed + bytes / throughput``
    (both clamped at >= 0); with saves of one size (the usual case: the same model every time), the
    slowest of the newest :data:`ESTIMATE_WINDOW` saves, scaled by size.
    """

    def __init__(self) -> None:
        self.measured: list[Measured] = []

    def observe(self, size_bytes: int | None, commit_secs: float) -> None:
        """Add one committed save (a save of unknown size is not used)."""
        if size_bytes is not None and size_bytes >= 0 and commit_secs >= 0:
            self.measured.append(Measured(int(size_bytes), float(commit_secs)))
            del self.measured[:-ESTIMATE_WINDOW]

    def estimate(self, size_bytes: int | None) -> float | None:
        """Predicted seconds to commit ``size_bytes`` (the last save's size when ``None``), or
        ``None`` without any measured save."""
        if not self.measured:
            return None
        size = self.measured[-1].size_bytes if size_bytes is None else size_bytes
        sizes = [m.size_bytes for m in self.measured]
        if len(set(sizes)) > 1 and (max(sizes) - min(sizes)) > 0.1 * max(sizes):
            n = len(sizes)
            mean_x = sum(sizes) / n
            mean_y = sum(m.commit_secs for m in self.measured) / n
            var = sum((x - mean_x) ** 2 for x in sizes)
            slope = max(0.0, sum((m.size_bytes - mean_x) * (m.commit_secs - mean_y) for m in self.measured) / var)
            fixed = max(0.0, mean_y - slope * mean_x)
            return fixed + slope * size
        slowest = max(self.measured, key=lambda m: m.commit_secs)
        return slowest.commit_secs * (size / slowest.size_bytes if slowest.size_bytes else 1.0)


@dataclasses.dataclass(frozen=True)
class FinalSavePlan:
    """What to do on a notice: ``decision`` is ``save`` or ``skip``; ``estimate_secs`` the
    prediction it rested on (``None`` without a measured save); ``secs_left`` the time to the
    deadline (``None``: unknown); ``reason`` one clause for the exit line."""

    decision: str
    estimate_secs: float | None
    secs_left: float | None
    reason: str


def plan_final_save(estimate_secs: float | None, secs_left: float | None) -> FinalSavePlan:
    """Save or not, on a notice (module docstring).

    * deadline already passed (``secs_left <= 0``): skip, whatever the estimate;
    * unknown deadline, or no measured save yet: save (the best that can be done);
    * otherwise save when ``estimate x SAFETY_FACTOR + SAFETY_SECS <= secs_left``.
    """
    if secs_left is not None and secs_left <= 0:
        return FinalSavePlan("skip", estimate_secs, secs_left, f"the deadline passed {-secs_left:.1f} s ago")
    if secs_left is None:
        return FinalSavePlan("save", estimate_secs, None, "no deadline known")
    if estimate_secs is None:
        return FinalSavePlan("save", None, secs_left, "no save measured yet")
    needed = estimate_secs * SAFETY_FACTOR + SAFETY_SECS
    if needed <= secs_left:
        return FinalSavePlan("save", estimate_secs, secs_left,
                             f"a save takes ~{estimate_secs:.1f} s, {secs_left:.1f} s left")
    return FinalSavePlan("skip", estimate_secs, secs_left,
                         f"a save takes ~{estimate_secs:.1f} s (x{SAFETY_FACTOR:g} + {SAFETY_SECS:g} s margin), "
                         f"only {secs_left:.1f} s left")


def young_daly_secs(save_cost_secs: float, mtbf_secs: float) -> float:
    """The first-order optimal seconds between saves, ``sqrt(2 x save_cost_secs x mtbf_secs)``
    (module docstring for the assumptions).

    Raises:
        ValueError: a negative cost or a non-positive MTBF.
    """
    if save_cost_secs < 0 or mtbf_secs <= 0:
        raise ValueError(f"save cost ({save_cost_secs}) must be >= 0 and MTBF ({mtbf_secs}) > 0 seconds")
    return math.sqrt(2.0 * save_cost_secs * mtbf_secs)


class AutoInterval:
    """``--checkpoint-every auto`` (module docstring).

    Args:
        every (int): the interval in force (the user's, or the journaled one a resume continues).
        mtbf_secs (float | None): mean seconds between preemptions known from the journal at start,
            or the seconds the run has survived so far when none was seen (a lower bound: the
            interval then grows as the run survives).
    """

    def __init__(self, every: int, mtbf_secs: float | None) -> None:
        self.every = max(1, int(every))
        self.mtbf_secs = mtbf_secs

    def after_save(self, *, save_cost_secs: float, update_secs: float, survived_secs: float) -> int:
        """The interval after a committed save: toward ``young_daly_secs / update_secs`` updates,
        within a factor of 2 of the current one and ``[1, MAX_AUTO_EVERY]``; unchanged without a
        positive update time.

        Args:
            save_cost_secs (float): the seconds a save blocks training (mean of this run's).
            update_secs (float): mean seconds of one update.
            survived_secs (float): seconds since the run's first start, the MTBF's lower bound when
                no preemption was measured.
        """
        mtbf = self.mtbf_secs if self.mtbf_secs is not None else survived_secs
        if update_secs <= 0 or mtbf <= 0:
            return self.every
        target = round(young_daly_secs(save_cost_secs, mtbf) / update_secs)
        self.every = max(1, min(MAX_AUTO_EVERY, self.every * 2, max(target, self.every // 2)))
        return self.every


__all__ = [
    "ESTIMATE_WINDOW", "MAX_AUTO_EVERY", "SAFETY_FACTOR", "SAFETY_SECS", "AutoInterval", "FinalSavePlan", "Measured",
    "SaveEstimator", "plan_final_save", "young_daly_secs",
]
