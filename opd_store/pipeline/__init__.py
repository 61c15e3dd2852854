"""The save pipeline above the commit: one save (:mod:`._save`), its multi-rank form
(:mod:`._collective`) and the one owner of background saves (:mod:`._background`) over the one
worker (:mod:`._worker`, tasks :mod:`._task`). The stages and where each mode runs them:
ARCHITECTURE.md, "The save path".
"""

from ._background import WHEN_BUSY, BackgroundSaves
from ._collective import (
    Failure,
    FinishCommit,
    agree,
    describe_failure,
    failure_text,
    run_save_collective,
    save_failure,
)
from ._save import AfterCommit, SaveRequest, run_save, write_and_commit
from ._task import BackgroundTask
from ._worker import EXIT_STAGE_SAVES, EXIT_STAGE_UPLOADS, BackgroundWorker

__all__ = ["EXIT_STAGE_SAVES", "EXIT_STAGE_UPLOADS", "WHEN_BUSY", "AfterCommit", "BackgroundSaves", "BackgroundTask",
           "BackgroundWorker", "Failure", "FinishCommit", "SaveRequest", "agree", "describe_failure", "failure_text",
           "run_save", "run_save_collective", "save_failure", "write_and_commit"]
