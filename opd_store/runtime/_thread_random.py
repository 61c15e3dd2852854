"""Keep background I/O threads from drawing on the training thread's Python ``random`` stream.

A synchronous save undoes its draws (:func:`~opd_store.opd._rng.preserve_global_rng`); a
background write runs beside training, so its draws must never reach the caller's generator.
The drawers are retry back-offs calling ``random.random()`` at call time (botocore's legacy retry
handler, gcsfs's ``retry_request``) on the writer thread and fsspec's I/O thread. While a routed
write is in flight, the module-level functions of :mod:`random` bound to the shared instance are
replaced by dispatchers: routed threads draw from a private ``random.Random``, every other thread
from the shared instance unchanged. Not covered (docs/spot.md): functions bound before the write
(botocore's standard/adaptive retry modes) and numpy's or torch's global generators.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from typing import Any, Callable

_lock = threading.Lock()
_depth = 0
_originals: dict[str, Callable[..., Any]] = {}
_routed_threads: dict[int, int] = {}  # thread ident -> how many writes route it
_private = random.Random()


def _bound_names() -> list[str]:
    """Module-level names of :mod:`random` that are bound methods of the shared instance."""
    shared = random._inst  # noqa: SLF001 - the instance behind random.random & co.
    return sorted(name for name in dir(random) if getattr(getattr(random, name), "__self__", None) is shared)


def _dispatcher(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    private_method = getattr(_private, name)

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() in _routed_threads:
            return private_method(*args, **kwargs)
        return original(*args, **kwargs)

    dispatch.__name__ = name
    dispatch.__doc__ = original.__doc__
    dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    return dispatch


_io_thread_finders: list[Callable[[], "threading.Thread | None"]] = []


def register_io_thread(find: Callable[[], "threading.Thread | None"]) -> None:
    """Route the thread ``find()`` returns too whenever a writer is routed (the storage layer
    registers fsspec's event loop); ``find`` may start it, and returns ``None`` when there is none.
    """
    if find not in _io_thread_finders:
        _io_thread_finders.append(find)


def _route(ident: int | None, delta: int) -> None:
    if ident is None:
        return
    count = _routed_threads.get(ident, 0) + delta
    if count > 0:
        _routed_threads[ident] = count
    else:
        _routed_threads.pop(ident, None)


@contextlib.contextmanager
def route_background_random() -> Iterator[None]:
    """Route the calling thread's and the registered I/O threads' ``random`` draws to a private
    generator for the block; re-entrant, reference counted across concurrent writers.

    Rule source: the seed's exact-resume contract (a save never moves the training's random streams),
    which must hold while a save runs in the background too.
    """
    global _depth
    io_threads = [find() for find in _io_thread_finders]
    idents = [threading.get_ident(), *(thread.ident for thread in io_threads if thread is not None)]
    with _lock:
        if _depth == 0:
            for name in _bound_names():
                original = getattr(random, name)
                _originals[name] = original
                setattr(random, name, _dispatcher(name, original))
        _depth += 1
        for ident in idents:
            _route(ident, +1)
    try:
        yield
    finally:
        with _lock:
            for ident in idents:
                _route(ident, -1)
            _depth -= 1
            if _depth == 0:
                for name, original in _originals.items():
                    setattr(random, name, original)
                _originals.clear()


__all__ = ["register_io_thread", "route_background_random"]
