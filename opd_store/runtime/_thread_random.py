"""Keep background I/O threads from drawing on the training thread's Python ``random`` stream.

A synchronous save protects the global generators with
:func:`~opd_store.opd._rng.preserve_global_rng`: the caller is blocked, so whatever the save draws
is undone before the caller draws again. An asynchronous save (or a tier upload) writes while training runs,
so undoing is impossible; instead the draws must not reach the caller's generator at all.

The known drawers during a write are retry back-offs that call ``random.random()`` through the
module attribute at call time: botocore's legacy retry handler (``retryhandler.delay_exponential``,
s3fs's default) and gcsfs's ``retry_request``. They run on fsspec's event-loop thread (``fsspecIO``, which the
storage layer registers with :func:`register_io_thread`), and the store's own code runs on the
writer thread. While at least one background write is in
flight, :func:`route_background_random` replaces each module-level function of :mod:`random` that
is bound to the shared instance (``random.random``, ``random.uniform``, ``random.getstate``, ...)
with a dispatcher: on a routed thread it calls a private ``random.Random`` (seeded from
``os.urandom``), on every other thread the original bound method of the shared instance, so the
caller's values are exactly those it would have drawn without the save. The originals are put back
when the last write ends.

Not covered (documented in docs/spot.md): code that bound ``random.random`` before the write
started (botocore's *standard* and *adaptive* retry modes bind it at import as a default argument)
and draws from numpy's or torch's global generators, which are process-wide; no part of the write
draws from those.
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
    """Route the thread ``find()`` returns too whenever a writer is routed: a shared I/O thread that
    backend clients run their requests and retries on (the storage layer registers fsspec's event
    loop). ``find`` may start the thread; it returns ``None`` when there is none."""
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
    """Route the calling (writer) thread's and the registered I/O threads' ``random`` draws to a
    private generator for the duration of the block (:func:`register_io_thread`).

    Re-entrant and safe with several concurrent writers (reference counted). Other threads, the
    training thread included, keep drawing from the shared instance unchanged.

    Rule source: the seed's exact-resume contract (a save never moves the training's random
    streams, or a resumed run diverges from an uninterrupted one), which must hold for the
    caller's thread while a save runs in the background too.
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
