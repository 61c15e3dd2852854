"""Run a function when the interpreter starts to exit, while background I/O still works.

Background saves and tier uploads are finished or abandoned at interpreter exit by the background
worker's exit routine (:func:`opd_store.pipeline._worker.finish_all_at_exit`). ``atexit`` hooks run
too late for remote stores: by then ``threading._shutdown()`` has run the hooks registered with
``threading._register_atexit``, among them ``concurrent.futures.thread._python_exit``, after which
every ``ThreadPoolExecutor`` refuses work ("cannot schedule new futures after interpreter
shutdown"). asyncio's default executor is one of them: aiobotocore builds an S3 client's HTTP
connector with ``asyncio.to_thread`` and aiohttp resolves host names with ``loop.getaddrinfo``,
both through it, so a save whose first S3 request came after ``main`` returned failed with
``HTTPClientError`` at exit, and nothing was committed.

:func:`register` uses ``threading._register_atexit`` (CPython >= 3.9; the hook concurrent.futures
itself uses). Those hooks run last-registered first, before non-daemon threads are joined and
before ``atexit`` hooks; ``concurrent.futures.thread`` is imported here first so that its hook is
registered before any of ours and runs after them. Without that hook (other Pythons) it falls back
to :func:`atexit.register`.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook before any of ours
import threading
from typing import Any, Callable


def register(func: Callable[..., Any], *args: Any) -> None:
    """Call ``func(*args)`` when the interpreter starts to exit (see the module docstring).

    Hooks registered later run first. A hook registered while the interpreter is already exiting
    goes to :func:`atexit.register`.
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
