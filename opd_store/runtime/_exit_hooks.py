"""Run a function when the interpreter starts to exit, while background I/O still works.

``atexit`` hooks run too late for remote stores: ``threading._shutdown()`` has already run
``concurrent.futures``' exit hook, after which every ``ThreadPoolExecutor`` (asyncio's default
executor, which aiobotocore and aiohttp use to connect) refuses work, so a save whose first S3
request came after ``main`` returned failed and nothing committed. :func:`register` uses
``threading._register_atexit`` (CPython >= 3.9; hooks run last-registered first, and
``concurrent.futures.thread`` is imported here first so its hook runs after ours), else
:func:`atexit.register`. docs/spot.md, "Exit deadline".
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook before any of ours
import threading
from typing import Any, Callable


def register(func: Callable[..., Any], *args: Any) -> None:
    """Call ``func(*args)`` when the interpreter starts to exit; later hooks run first; one registered
    while the interpreter is already exiting goes to :func:`atexit.register`.
    """
    hook = getattr(threading, "_register_atexit", None)
    if hook is not None:
        try:
            hook(func, *args)
            return
        except RuntimeError:  # "can't register atexit after shutdown"
            pass
    atexit.register(func, *args)


__all__ = ["register"]
