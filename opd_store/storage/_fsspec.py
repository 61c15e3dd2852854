"""The storage verbs over one fsspec filesystem (every backend of :mod:`opd_store.storage._backends` and
:mod:`opd_store.storage._bucket`).

Every verb that can decide a checkpoint's state (list, size, read) sees the backend as it is now:
s3fs and gcsfs cache listings and object sizes per instance (field notes: a stale cached size made
s3fs return a truncated body without error), so each such verb drops the instance's caches first.
Stores get a private filesystem instance (``skip_instance_cache=True``), so dropping its caches
costs other code nothing. A missing object or prefix is recognised through the one table of
backend failures (:mod:`opd_store.storage._backend_errors`).

A verb that fails because the store cannot be reached at all (no credentials, a refused
connection, a host name that does not resolve, a connect or read timeout) raises
:class:`~opd_store.errors.StoreUnreachableError` naming the object's URL, the operation and the
cause (``s3://b/run/step-000002/manifest.json: cannot read: endpoint http://HOST:PORT did not
answer within 60 s``) with the client's error as ``__cause__``: botocore raises those failures
as its own exception types, which are neither the builtins callers catch nor anything a person
can act on. Every backend below gets this by subclassing (:meth:`FsspecStorage.__init_subclass__`),
and, on a backend whose client does not count its own requests, each outermost verb call counts
one request of its kind in ``storage.requests`` (:mod:`opd_store.storage._request_tally`).
"""

from __future__ import annotations

import datetime
import functools
import threading
from typing import BinaryIO, Callable, TypeVar

from ..errors import OpdStoreError, StoragePermissionError, StoreRequestError, StoreUnreachableError
from ..runtime import register_io_thread
from ._backend_errors import (
    Meaning,
    backend_operation,
    classify,
    is_backend_failure,
    is_missing,
    is_unreachable,
    s3_error_code,
)
from ._base import Storage

T = TypeVar("T")

# The kind of request each verb is on a backend that sends none (local, memory:
# opd_store.storage._request_tally); open_write and sync_prefix count nothing (the write is
# counted when published, a sync is no request).
_VERB_KINDS = {
    "list_children": "list", "list_tree": "list", "list_tree_modified": "list", "size": "head",
    "clock_secs": "head", "read_bytes": "get", "open_read": "get",
    "open_read_stream": "get", "open_checked": "get", "finish_write": "put", "create_exclusive": "put",
    "delete": "delete", "delete_tree": "delete",
}

# The verbs whose failures name an object, and what each was doing: ``<URL>: cannot <operation>:
# <cause>``, so each operation is a whole phrase after the URL (never one ending in "of").
_VERB_OPERATIONS = {
    "list_children": "list", "list_tree": "list", "list_tree_modified": "list", "size": "read its size",
    "read_bytes": "read", "open_read": "open", "open_read_stream": "open", "open_checked": "read", "open_write": "start writing",
    "finish_write": "write", "create_exclusive": "create", "delete": "delete", "delete_tree": "delete",
    "sync_prefix": "sync", "clock_secs": "read the store's clock",
}


# The verbs that only read: a failure that is not a missing object is raised typed, naming the URL
# and the operation (a refusal, throttling or a server error after the client's retries); a
# write's failures are typed by its caller, which knows the payload and the step.
_READ_VERBS = frozenset({"list_children", "list_tree", "list_tree_modified", "size", "read_bytes", "open_read",
                         "open_read_stream", "open_checked", "clock_secs"})


def read_failure(storage: "FsspecStorage", rel: str, operation: str, exc: BaseException) -> OpdStoreError | None:
    """``exc``, raised by a read of ``rel`` doing ``operation``, as the typed error it means:
    :class:`~opd_store.errors.StoragePermissionError` for a refusal, :class:`~opd_store.errors.StoreRequestError`
    for throttling or a server error after the client's retries; ``None`` for anything else (a
    missing object stays a ``FileNotFoundError``; a bug is not a backend failure)."""
    meaning = classify(exc)
    request = ": ".join(part for part in (backend_operation(exc), s3_error_code(exc)) if part)  # "GetObject: SlowDown"
    what = f"{storage.url(rel)}: cannot {operation}{f' ({request})' if request else ''}: {storage.explain(exc)}"
    if meaning is Meaning.DENIED:
        return StoragePermissionError(what)
    if meaning is Meaning.THROTTLED or (meaning is Meaning.OTHER and is_backend_failure(exc)):
        return StoreRequestError(what)
    return None


def translated(storage: "FsspecStorage", rel: str, operation: str, call: Callable[[], T]) -> T:
    """``call()``, with a failure to reach the store raised as the
    :class:`~opd_store.errors.StoreUnreachableError` of ``operation`` on ``rel`` (module docstring);
    any other failure propagates as it is. Every verb, and the multipart uploads of S3, go through it."""
    try:
        return call()
    except OpdStoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - only unreachable-store failures are translated
        error = storage.unreachable_error(rel, operation, exc)
        if error is None:
            raise
        raise error from exc


def _translating(name: str, operation: str, method):
    kind = _VERB_KINDS.get(name)
    reads = name in _READ_VERBS

    @functools.wraps(method)
    def verb(self: "FsspecStorage", *args, **kwargs):
        tally = self.requests
        outermost = tally.enter_verb()
        try:
            if outermost and kind is not None and not self.counts_own_requests:
                tally.add(kind)
            rel = kwargs.get("rel") or next((arg for arg in args if isinstance(arg, str)), "")  # finish_write(handle, rel)
            try:
                return translated(self, rel, operation, lambda: method(self, *args, **kwargs))
            except OpdStoreError:
                raise
            except Exception as exc:  # noqa: BLE001 - a read's backend failure is typed; anything else propagates
                typed = read_failure(self, rel, operation, exc) if reads else None
                if typed is None:
                    raise
                raise typed from exc
        finally:
            tally.exit_verb()

    verb.translates_failures = True
    return verb


def modified_secs(info: dict) -> float | None:
    """Seconds since the epoch at which the backend last modified an object, from an fsspec
    ``info``/``find(detail=True)`` entry: local ``mtime``, S3 ``LastModified``, GCS ``mtime``
    (gcsfs's parsed ``updated``), memory ``created``; ``None`` when the entry has no time."""
    for key in ("mtime", "LastModified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:  # backends report UTC
                value = value.replace(tzinfo=datetime.timezone.utc)
            return value.timestamp()
    return None


def fsspec_loop_thread() -> threading.Thread | None:
    """fsspec's event-loop thread (where s3fs/gcsfs run botocore and retries), started now if it
    was not (a write that is its first user would otherwise start it unrouted)."""
    import fsspec.asyn

    fsspec.asyn.get_loop()
    thread = fsspec.asyn.iothread[0]
    return thread if thread is not None and thread.is_alive() else None


# Retry back-offs on that thread draw from ``random``: background writes route them away from the
# training thread's stream (opd_store.runtime._thread_random).
register_io_thread(fsspec_loop_thread)


class FsspecStorage(Storage):
    """The listing, reading, writing and deleting verbs of :class:`Storage` over ``self.fs``.

    A concrete backend adds the create-only write (:meth:`Storage.create_exclusive`).
    """

    def __init_subclass__(cls, **kwargs) -> None:
        """Every verb a backend defines translates unreachable-store failures (module docstring)."""
        super().__init_subclass__(**kwargs)
        _translate_verbs(cls)

    def _rel(self, full: str, base: str) -> str:
        full = self.fs._strip_protocol(full).rstrip("/")  # noqa: SLF001 - fsspec's documented path normaliser
        base = base.rstrip("/")
        if full == base:
            return ""
        prefix = base + "/" if not base.endswith("/") else base
        if not full.startswith(prefix):
            raise ValueError(f"listing returned {full!r} outside {base!r}")
        return full[len(prefix):]

    def unreachable_error(self, rel: str, operation: str, exc: BaseException) -> StoreUnreachableError | None:
        """``exc`` as the :class:`~opd_store.errors.StoreUnreachableError` that a verb on ``rel``
        doing ``operation`` raises (``<URL>: cannot <operation>: <cause>``), or ``None`` when it
        is not a failure to reach the store (it is then raised as it is). Also used by readers that
        fail after the verb that made them returned (a streaming read's ranges)."""
        if isinstance(exc, OpdStoreError) or not is_unreachable(exc):
            return None
        return StoreUnreachableError(f"{self.url(rel)}: cannot {operation}: {self.explain(exc)}")

    def refresh(self) -> None:
        """Drop every listing and size cached by the filesystem instance."""
        self.fs.invalidate_cache()

    # -- reads ---------------------------------------------------------------------------------
    def list_children(self, rel: str = "") -> tuple[list[str], dict[str, int]]:
        self.refresh()
        base = self.path(rel)
        try:
            entries = self._list_dir(base)
        except Exception as exc:  # noqa: BLE001 - a missing prefix lists as empty
            if is_missing(exc):
                return [], {}
            raise
        dirs: list[str] = []
        files: dict[str, int] = {}
        for entry in entries:
            name = self._rel(entry["name"], base)
            if not name or "/" in name:
                continue
            if entry.get("type") == "directory":
                dirs.append(name)
            else:
                files[name] = int(entry.get("size") or 0)
        return dirs, files

    def _list_dir(self, base: str) -> list[dict]:
        """One fresh delimiter listing of the filesystem path ``base`` (fsspec ``ls`` entries).

        Raises:
            FileNotFoundError: ``base`` (or its bucket) does not exist.
        """
        return self.fs.ls(base, detail=True, refresh=True)

    def list_tree(self, rel: str = "") -> dict[str, int]:
        return {name: size for name, (size, _modified) in self.list_tree_modified(rel).items()}

    def list_tree_modified(self, rel: str = "") -> dict[str, tuple[int, float | None]]:
        self.refresh()
        base = self.path(rel)
        try:
            found = self._find_tree(base)
        except Exception as exc:  # noqa: BLE001 - a missing prefix lists as empty
            if is_missing(exc):
                return {}
            raise
        out: dict[str, tuple[int, float | None]] = {}
        for full, info in found.items():
            if info.get("type") == "directory":
                continue
            name = self._rel(full, base)
            if name:
                out[name] = (int(info.get("size") or 0), modified_secs(info))
        return out

    def _find_tree(self, base: str) -> dict[str, dict]:
        """Every object under the filesystem path ``base``: fsspec ``find`` entries by full path."""
        return self.fs.find(base, detail=True)

    def size(self, rel: str) -> int | None:
        self.refresh()
        try:
            info = self.fs.info(self.path(rel))
        except Exception as exc:  # noqa: BLE001 - a missing object has no size
            if is_missing(exc):
                return None
            raise
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    def read_bytes(self, rel: str, *, small: bool = False, max_bytes: int | None = None) -> bytes:
        self.refresh()
        if max_bytes is not None:
            return self.fs.cat_file(self.path(rel), start=0, end=max_bytes + 1)
        return self.fs.cat_file(self.path(rel))

    def open_read(self, rel: str) -> BinaryIO:
        """A streaming binary reader of the object ``rel`` (nothing is held whole).

        Raises:
            FileNotFoundError: no such object.
        """
        self.refresh()
        return self.fs.open(self.path(rel), "rb")

    # -- writes --------------------------------------------------------------------------------
    def open_write(self, rel: str) -> BinaryIO:
        return self.fs.open(self.path(rel), "wb")

    def delete(self, rel: str) -> None:
        try:
            self.fs.rm_file(self.path(rel))
        except Exception as exc:  # noqa: BLE001 - a missing object is not an error
            if not is_missing(exc):
                raise
        finally:
            self.refresh()

    def delete_tree(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except Exception as exc:  # noqa: BLE001 - a missing prefix is not an error
            if not is_missing(exc):
                raise
        finally:
            self.refresh()


def _translate_verbs(cls: type, *, inherited: bool = False) -> None:
    for name, operation in _VERB_OPERATIONS.items():
        method = cls.__dict__.get(name) or (getattr(cls, name, None) if inherited else None)
        if callable(method) and not getattr(method, "translates_failures", False):
            setattr(cls, name, _translating(name, operation, method))


_translate_verbs(FsspecStorage, inherited=True)  # with the defaults of Storage (finish_write, ...)


__all__ = ["FsspecStorage", "modified_secs", "translated"]
