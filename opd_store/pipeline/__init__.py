"""The save pipeline: one save sequence (:mod:`.save`, :mod:`.collective`) and the one background
worker (:mod:`.worker`) that asynchronous saves and tier uploads run on. See ARCHITECTURE.md."""

from .save import SaveRequest, after_commit, run_save, write_and_commit
from .worker import BackgroundTask, BackgroundWorker

__all__ = ["BackgroundTask", "BackgroundWorker", "SaveRequest", "after_commit", "run_save", "write_and_commit"]
