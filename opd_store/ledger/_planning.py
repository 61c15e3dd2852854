"""Planning saves from measurements (pure, no I/O); docs/ledger.md, "Saves planned against the
notice" and "--checkpoint-every auto".

The final save: a save that cannot commit before the notice's deadline is lost whole, so
:func:`plan_final_save` saves only when ``estimate x SAFETY_FACTOR + SAFETY_SECS`` fits.
Young/Daly: ``sqrt(2 C M)`` (Young 1974; Daly 2006), assuming Poisson failures, ``C`` much smaller
than ``M`` and a save cost independent of when it is taken (field notes, section 6). ``auto``:
:class:`AutoInterval` moves toward it, at most halving or doubling per save, within
``[1, MAX_AUTO_EVERY]``, journaled so a resume continues it.
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
    """Seconds to commit a save of a given size: a least-squares ``fixed + bytes / throughput`` over
    saves of sizes spread over 10%, else the slowest of the newest :data:`ESTIMATE_WINDOW` scaled by
    size.
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
    """Save or not on a notice: skip past the deadline; save with an unknown deadline or no
    measurement; else save when ``estimate x SAFETY_FACTOR + SAFETY_SECS <= secs_left``.
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
    """``--checkpoint-every auto``.

    Args:
        every (int): the interval in force (the user's, or the journaled one a resume continues).
        mtbf_secs (float | None): mean seconds between preemptions from the journal, else the
            seconds survived so far (a lower bound).
    """

    def __init__(self, every: int, mtbf_secs: float | None) -> None:
        self.every = max(1, int(every))
        self.mtbf_secs = mtbf_secs

    def after_save(self, *, save_cost_secs: float, update_secs: float, survived_secs: float) -> int:
        """The interval after a committed save: toward ``young_daly_secs / update_secs``, within a factor
        of 2 and ``[1, MAX_AUTO_EVERY]``; unchanged without a positive update time.

        Args:
            save_cost_secs (float): mean seconds a save blocks training.
            update_secs (float): mean seconds of one update.
            survived_secs (float): seconds since the run's first start (the MTBF's lower bound).
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
