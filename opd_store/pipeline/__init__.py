"""The save pipeline: one save sequence (:mod:`.save`, :mod:`.collective`) and the one background
worker (:mod:`.worker`, its tasks :mod:`.task`) that asynchronous saves and tier uploads run on.
See ARCHITECTURE.md."""

from .save import SaveRequest, after_commit, run_save, write_and_commit
from .task import BackgroundTask
from .worker import BackgroundWorker

__all__ = ["BackgroundTask", "BackgroundWorker", "SaveRequest", "after_commit", "run_save", "write_and_commit"]
