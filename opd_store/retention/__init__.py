"""Which checkpoints to keep: the policy as a pure function (:mod:`._policy`), the one executor
that deletes what a plan does not keep (:mod:`._executor`) and garbage collection of orphan attempts
and stale uploads (:mod:`._gc`, ``opd-store gc``)."""

from ._executor import GcReport, apply_retention, retention_after_commit
from ._gc import collect_garbage, collect_garbage_tiers, survey
from ._policy import RetentionPolicy, RunLineage

__all__ = ["GcReport", "RetentionPolicy", "RunLineage", "apply_retention", "collect_garbage", "collect_garbage_tiers",
           "retention_after_commit", "survey"]
