"""Fault-injecting and recording wrappers around an opd_store :class:`~opd_store.storage.Storage`.

``FaultyStorage(inner)`` is a :class:`Storage` that forwards every verb to ``inner`` and records
each call in :attr:`FaultyStorage.ops`. Mutating operations are counted (1-based, in the order
they happen) and one of them can be made to fail:

==============  =====================================================================
``write``       one ``write()`` call on a payload writer
``close``       publishing a payload writer (``finish_write``)
``sync``        ``sync_prefix`` (local: fsync of the attempt's directories)
``create``      the manifest create (``create_exclusive``), the commit point
``delete``      deleting one object
``delete_tree`` deleting every object under a prefix
==============  =====================================================================

A fault is a :class:`Fault`: which mutating op to fail (``at``, 1-based) or a predicate, the
exception to raise, and whether the operation takes effect before the exception is raised
(``landed=True``: an ambiguous outcome such as a timeout after the request was sent). Reads can be
failed too (``read_fault``), for ambiguous commits whose read-back fails.

Use it through ``CheckpointStore.from_storage(FaultyStorage(store.storage, ...))``.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from typing import Any, Callable

from ..storage import Storage

MUTATING = ("write", "close", "sync", "create", "delete", "delete_tree")


class InjectedFault(OSError):
    """The OSError raised by an injected fault (so tests can tell it from real failures)."""


@dataclasses.dataclass
class Op:
    """One recorded call: ``kind`` (see the module table, or ``read``/``list``/...), ``rel``
    (the path relative to the store root), ``index`` (1-based among mutating ops, 0 for reads),
    ``nbytes`` (for ``write``), ``failed`` (an injected fault was raised)."""

    kind: str
    rel: str
    index: int = 0
    nbytes: int = 0
    failed: bool = False


@dataclasses.dataclass
class Fault:
    """Which operation fails and how.

    Attributes:
        at: fail the mutating op with this 1-based index (ignored when ``when`` is given).
        when: predicate on the :class:`Op` about to run; fail it when it returns True.
        exc: the exception to raise (an instance, or a callable taking the op).
        landed: perform the operation first, then raise (``create``/``close``/``write``/deletes).
        once: fail only the first matching op.
    """

    at: int | None = None
    when: Callable[[Op], bool] | None = None
    exc: BaseException | Callable[[Op], BaseException] | None = None
    landed: bool = False
    once: bool = True
    fired: int = 0

    def matches(self, op: Op) -> bool:
        if self.once and self.fired:
            return False
        if self.when is not None:
            return bool(self.when(op))
        return self.at is not None and op.index == self.at

    def make_exc(self, op: Op) -> BaseException:
        if self.exc is None:
            return InjectedFault(f"injected fault in {op.kind} #{op.index} of {op.rel}")
        if isinstance(self.exc, BaseException):
            return self.exc
        return self.exc(op)


class _FaultyHandle:
    """A payload writer handle whose ``write`` calls are counted (and may fail)."""

    def __init__(self, storage: "FaultyStorage", inner, rel: str) -> None:
        self._storage = storage
        self.inner = inner
        self.rel = rel

    def write(self, data) -> int:
        nbytes = memoryview(data).nbytes
        return self._storage._mutate("write", self.rel, lambda: self.inner.write(data), nbytes=nbytes)

    def flush(self) -> None:
        self.inner.flush()

    def tell(self) -> int:
        return self.inner.tell()

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FaultyStorage(Storage):
    """Forward every verb to ``inner``; record calls; fail the operations ``faults`` select.

    Args:
        inner (Storage): the real storage (from ``CheckpointStore(...).storage``).
        faults (Fault | list[Fault] | None): faults on mutating ops.
        read_fault (Fault | None): fault on reads (``read``, ``size``, ``list``); ``at`` counts reads.
        before_create (callable | None): called with (inner, rel, data) just before the real
            manifest create (a test can make another attempt win the race there).
    """

    def __init__(self, inner: Storage, faults=None, *, read_fault: Fault | None = None, before_create=None) -> None:
        super().__init__(inner.fs, inner.root, inner.url_root)
        self.inner = inner
        self.requests = inner.requests  # the requests are the inner store's, sent by its verbs
        self.commit_primitive = inner.commit_primitive
        self.atomic_create = inner.atomic_create
        if faults is None:
            faults = []
        elif isinstance(faults, Fault):
            faults = [faults]
        self.faults: list[Fault] = list(faults)
        self.read_fault = read_fault
        self.before_create = before_create
        self.ops: list[Op] = []
        self._count = 0
        self._reads = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # allow_check_then_put and friends
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    # -- bookkeeping -----------------------------------------------------------------------
    @property
    def mutating_ops(self) -> list[Op]:
        return [op for op in self.ops if op.index]

    def kinds(self) -> list[str]:
        return [op.kind for op in self.ops]

    def _mutate(self, kind: str, rel: str, action: Callable[[], Any], nbytes: int = 0) -> Any:
        with self._lock:
            self._count += 1
            op = Op(kind, rel, self._count, nbytes)
            self.ops.append(op)
            fault = next((f for f in self.faults if f.matches(op)), None)
            if fault is not None:
                fault.fired += 1
                op.failed = True
        if fault is None:
            return action()
        if fault.landed:
            action()
        raise fault.make_exc(op)

    def _read(self, kind: str, rel: str, action: Callable[[], Any]) -> Any:
        with self._lock:
            self._reads += 1
            op = Op(kind, rel, 0)
            self.ops.append(op)
            fault = self.read_fault
            hit = fault is not None and (
                (fault.when(op) if fault.when is not None else fault.at == self._reads) and not (fault.once and fault.fired)
            )
            if hit:
                fault.fired += 1
                op.failed = True
        if hit:
            raise fault.make_exc(op)
        return action()

    # -- names -------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        return self.inner.path(rel)

    def url(self, rel: str = "") -> str:
        return self.inner.url(rel)

    def refresh(self) -> None:
        self.inner.refresh()

    def describe(self) -> str:
        return f"FaultyStorage({self.inner.describe()})"

    __repr__ = describe

    # -- reads -------------------------------------------------------------------------------
    # Extra keyword arguments (``read_bytes(rel, small=True)``...) are passed through untouched.
    def list_children(self, rel: str = "", **kwargs):
        return self._read("list", rel, lambda: self.inner.list_children(rel, **kwargs))

    def list_tree(self, rel: str = "", **kwargs):
        return self._read("list", rel, lambda: self.inner.list_tree(rel, **kwargs))

    def size(self, rel: str, **kwargs):
        return self._read("size", rel, lambda: self.inner.size(rel, **kwargs))

    def read_bytes(self, rel: str, **kwargs) -> bytes:
        return self._read("read", rel, lambda: self.inner.read_bytes(rel, **kwargs))

    # -- writes ------------------------------------------------------------------------------
    def open_write(self, rel: str, **kwargs):
        self.ops.append(Op("open", rel, 0))
        return _FaultyHandle(self, self.inner.open_write(rel, **kwargs), rel)

    def abort_write(self, handle, rel: str) -> None:
        self.ops.append(Op("abort", rel, 0))
        self.inner.abort_write(handle.inner if isinstance(handle, _FaultyHandle) else handle, rel)

    def finish_write(self, handle, rel: str) -> None:
        inner_handle = handle.inner if isinstance(handle, _FaultyHandle) else handle

        def publish():
            self.inner.finish_write(inner_handle, rel)

        # A close failed without landing leaves the real handle open, as a failed upload would:
        # discarding it (so that it never publishes at garbage collection) is the caller's job.
        self._mutate("close", rel, publish)

    def start_finish(self, handle, rel: str):
        """Publish now, as one recorded ``close`` (a background publish would make the order of
        the recorded operations depend on timing)."""
        from ..storage.transfers import Completion

        return Completion.now(lambda: self.finish_write(handle, rel))

    def sync_prefix(self, rel: str) -> None:
        self._mutate("sync", rel, lambda: self.inner.sync_prefix(rel))

    def create_exclusive(self, rel: str, data: bytes, **kwargs) -> None:
        def create():
            if self.before_create is not None:
                self.before_create(self.inner, rel, data)
            self.inner.create_exclusive(rel, data, **kwargs)

        self._mutate("create", rel, create)

    def delete(self, rel: str) -> None:
        self._mutate("delete", rel, lambda: self.inner.delete(rel))

    def delete_tree(self, rel: str) -> None:
        self._mutate("delete_tree", rel, lambda: self.inner.delete_tree(rel))


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Forwarded unchanged to the wrapped storage's ``{name}`` (not recorded)."
    return method


# Any other verb of the Storage seam (present or added later) goes to the wrapped storage, so a
# backend's own override is never bypassed by the base implementation running on the wrapper.
for _name, _value in list(vars(Storage).items()):
    if callable(_value) and not _name.startswith("__") and _name not in FaultyStorage.__dict__:
        setattr(FaultyStorage, _name, _delegate(_name))
abc.update_abstractmethods(FaultyStorage)  # the seam's abstract verbs are the delegates set above


__all__ = ["Fault", "FaultyStorage", "InjectedFault", "MUTATING", "Op"]
