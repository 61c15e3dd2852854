"""Which checkpoints to keep: the policy as a pure function (:mod:`._policy`), the one executor
that deletes what a plan does not keep (:mod:`._executor`), the bounded pass after each save
(:mod:`._after_save`) and garbage collection of orphan attempts
and stale uploads (:mod:`._gc`, ``opd-store gc``)."""

from ._after_save import READS_PER_PASS, apply_retention_after_save, retention_after_commit
from ._executor import GcReport, apply_retention
from ._gc import collect_garbage, collect_garbage_tiers, survey
from ._policy import RetentionPolicy, RunLineage, check_retention

__all__ = ["READS_PER_PASS", "GcReport", "RetentionPolicy", "RunLineage", "apply_retention", "apply_retention_after_save", "check_retention",
           "collect_garbage", "collect_garbage_tiers", "retention_after_commit", "survey"]
