"""A recording, fault-injecting wrapper of any :class:`~opd_store.storage.Storage`.

``FaultyStorage(inner)`` records reads (``list``, ``size``, ``read``) and mutating ops, numbered
from 1 (``write``: one writer call; ``close``: publishing a writer; ``sync``: ``sync_prefix``;
``create``: the manifest create, the commit point; ``delete``; ``delete_tree``), and fails those a
:class:`Fault` selects (``landed=True``: after the op ran, an ambiguous outcome). Every other verb
is ``inner``'s, unrecorded (override it with :meth:`FaultyStorage.recorded_read` or
:meth:`FaultyStorage.recorded_mutation` to record it). Example (docs/testing.md runs it)::

    spy = FaultyStorage(store.storage, Fault(when=lambda op: op.kind == "create"))
    with CheckpointStore.from_storage(spy).begin(1) as txn:  # raises CommitError (cause: InjectedFault)
        txn.write_bytes("model.bin", b"weights")
    [op.kind for op in spy.mutating_ops]  # ["write", "close", "sync", "create"]; store.steps() == []

It wraps rather than subclasses ``Storage``: inheriting would give it the base class's defaults
in place of the wrapped backend's; ``Storage.register`` makes ``isinstance`` checks true.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

from ..storage import Storage

MUTATING = ("write", "close", "sync", "create", "delete", "delete_tree")


class InjectedFault(OSError):
    """The OSError raised by an injected fault (so tests can tell it from real failures)."""


@dataclasses.dataclass
class Op:
    """One recorded call: ``kind`` (see the module table, or ``read``/``list``/``size``/``open``/
    ``abort``), ``rel`` (the path relative to the store root), ``index`` (1-based among mutating
    ops, 0 otherwise), ``nbytes`` (for ``write``), ``failed`` (an injected fault was raised)."""

    kind: str
    rel: str
    index: int = 0
    nbytes: int = 0
    failed: bool = False


@dataclasses.dataclass
class Fault:
    """Which operation fails and how.

    Attributes:
        at: fail the op with this 1-based index (ignored when ``when`` is given).
        when: predicate on the :class:`Op` about to run; fail it when it returns True.
        exc: the exception to raise (an instance, or a callable taking the op); :class:`InjectedFault`
            naming the op when ``None``.
        landed: perform the operation first, then raise.
        once: fail only the first matching op.
        fired: how many times it failed an op.
    """

    at: int | None = None
    when: Callable[[Op], bool] | None = None
    exc: BaseException | Callable[[Op], BaseException] | None = None
    landed: bool = False
    once: bool = True
    fired: int = 0

    def matches(self, op: Op, number: int) -> bool:
        """Whether ``op``, the ``number``-th of the ops it counts, fails."""
        if self.once and self.fired:
            return False
        if self.when is not None:
            return bool(self.when(op))
        return self.at is not None and number == self.at

    def make_exc(self, op: Op) -> BaseException:
        if self.exc is None:
            return InjectedFault(f"injected fault in {op.kind} #{op.index} of {op.rel}")
        if isinstance(self.exc, BaseException):
            return self.exc
        return self.exc(op)


class FaultyWriter:
    """A payload writer of :meth:`FaultyStorage.open_write`: each ``write`` is a recorded (and
    perhaps failed) mutating op; everything else is the wrapped writer ``inner``'s."""

    def __init__(self, storage: "FaultyStorage", inner, rel: str) -> None:
        self.storage = storage
        self.inner = inner
        self.rel = rel

    def write(self, data) -> int:
        nbytes = memoryview(data).nbytes
        return self.storage.recorded_mutation("write", self.rel, lambda: self.inner.write(data), nbytes=nbytes)

    def flush(self) -> None:
        self.inner.flush()

    def tell(self) -> int:
        return self.inner.tell()

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _unwrapped(handle):
    return handle.inner if isinstance(handle, FaultyWriter) else handle


class FaultyStorage:
    """Forward every verb to ``inner``; record calls; fail the operations ``faults`` select.

    Args:
        inner (Storage): the real storage (``CheckpointStore(url).storage``).
        faults (Fault | list[Fault] | None): faults on mutating ops.
        read_fault (Fault | None): fault on reads (``read``, ``size``, ``list``); ``at`` counts reads.
        before_create (callable | None): called with ``(inner, rel, data)`` just before the real
            manifest create (a test can make another attempt win the race there).

    Attributes:
        ops (list[Op]): every recorded call, in order.
        inner (Storage): the wrapped storage.
    """

    def __init__(self, inner: Storage, faults=None, *, read_fault: Fault | None = None, before_create=None) -> None:
        self.inner = inner
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

    def __getattr__(self, name: str) -> Any:
        """Every verb and attribute not recorded here is the wrapped storage's."""
        inner = self.__dict__.get("inner")
        if inner is None:  # during construction or unpickling
            raise AttributeError(name)
        return getattr(inner, name)

    # -- the record --------------------------------------------------------------------------
    @property
    def mutating_ops(self) -> list[Op]:
        return [op for op in self.ops if op.index]

    def kinds(self) -> list[str]:
        return [op.kind for op in self.ops]

    def recorded_mutation(self, kind: str, rel: str, action: Callable[[], Any], *, nbytes: int = 0) -> Any:
        """Record the next mutating op and run ``action`` unless a fault fails it.

        Raises:
            BaseException: the matching fault's exception (after ``action`` when it ``landed``).
        """
        with self._lock:
            self._count += 1
            op = Op(kind, rel, self._count, nbytes)
            self.ops.append(op)
            fault = next((f for f in self.faults if f.matches(op, op.index)), None)
            if fault is not None:
                fault.fired += 1
                op.failed = True
        if fault is None:
            return action()
        if fault.landed:
            action()
        raise fault.make_exc(op)

    def recorded_read(self, kind: str, rel: str, action: Callable[[], Any]) -> Any:
        """Record a read and run ``action`` unless :attr:`read_fault` fails it.

        Raises:
            BaseException: the read fault's exception.
        """
        with self._lock:
            self._reads += 1
            op = Op(kind, rel, 0)
            self.ops.append(op)
            fault = self.read_fault
            hit = fault is not None and fault.matches(op, self._reads)
            if hit:
                fault.fired += 1
                op.failed = True
        if hit:
            raise fault.make_exc(op)
        return action()

    def _note(self, kind: str, rel: str) -> None:
        with self._lock:
            self.ops.append(Op(kind, rel, 0))

    def describe(self) -> str:
        return f"FaultyStorage({self.inner.describe()})"

    __repr__ = describe

    # -- reads (extra keyword arguments, ``read_bytes(rel, small=True)``..., pass through) -----
    def list_children(self, rel: str = "", **kwargs):
        return self.recorded_read("list", rel, lambda: self.inner.list_children(rel, **kwargs))

    def list_tree(self, rel: str = "", **kwargs):
        return self.recorded_read("list", rel, lambda: self.inner.list_tree(rel, **kwargs))

    def size(self, rel: str, **kwargs):
        return self.recorded_read("size", rel, lambda: self.inner.size(rel, **kwargs))

    def read_bytes(self, rel: str, **kwargs) -> bytes:
        return self.recorded_read("read", rel, lambda: self.inner.read_bytes(rel, **kwargs))

    # -- writes ------------------------------------------------------------------------------
    def open_write(self, rel: str, **kwargs) -> FaultyWriter:
        self._note("open", rel)
        return FaultyWriter(self, self.inner.open_write(rel, **kwargs), rel)

    def abort_write(self, handle, rel: str) -> None:
        self._note("abort", rel)
        self.inner.abort_write(_unwrapped(handle), rel)

    def finish_write(self, handle, rel: str) -> None:
        # A close failed without landing leaves the real handle open, as a failed upload would:
        # discarding it (so that it never publishes at garbage collection) is the caller's job.
        self.recorded_mutation("close", rel, lambda: self.inner.finish_write(_unwrapped(handle), rel))

    def start_finish(self, handle, rel: str):
        """Publish now, as one recorded ``close`` (a background publish would make the order of
        the recorded operations depend on timing)."""
        from ..storage.transfers import Completion

        return Completion.now(lambda: self.finish_write(handle, rel))

    def sync_prefix(self, rel: str) -> None:
        self.recorded_mutation("sync", rel, lambda: self.inner.sync_prefix(rel))

    def create_exclusive(self, rel: str, data: bytes, **kwargs) -> None:
        def create():
            if self.before_create is not None:
                self.before_create(self.inner, rel, data)
            self.inner.create_exclusive(rel, data, **kwargs)

        self.recorded_mutation("create", rel, create)

    def delete(self, rel: str) -> None:
        self.recorded_mutation("delete", rel, lambda: self.inner.delete(rel))

    def delete_tree(self, rel: str) -> None:
        self.recorded_mutation("delete_tree", rel, lambda: self.inner.delete_tree(rel))


Storage.register(FaultyStorage)  # it answers every verb of the seam (module docstring)


__all__ = ["Fault", "FaultyStorage", "FaultyWriter", "InjectedFault", "MUTATING", "Op"]
