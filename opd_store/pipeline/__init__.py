"""The save pipeline above the commit: one save sequence (:mod:`._save`), its multi-rank form
(:mod:`._collective`) and the one background worker (:mod:`._worker`, its tasks :mod:`._task`) that
asynchronous saves and tier uploads run on. ARCHITECTURE.md traces a save through it."""

from ._collective import FinishCommit, describe_failure, failure_text, write_and_commit_collective
from ._save import SaveRequest, after_commit, run_save, write_and_commit
from ._task import BackgroundTask
from ._worker import EXIT_STAGE_SAVES, EXIT_STAGE_UPLOADS, BackgroundWorker

__all__ = ["EXIT_STAGE_SAVES", "EXIT_STAGE_UPLOADS", "BackgroundTask", "BackgroundWorker", "FinishCommit",
           "SaveRequest", "after_commit", "describe_failure", "failure_text", "run_save", "write_and_commit",
           "write_and_commit_collective"]
