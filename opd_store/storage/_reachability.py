"""Fail fast: prove in bounded time that a store can be used the way a read or a save will use it.

:func:`check_reachable` is what ``CheckpointStore.check_reachable`` runs before any work (the CLI's
commands, the main job before its first update), with the :class:`Probe` the backend gives
(:meth:`Storage.reachability_probe <opd_store.storage._base.Storage.reachability_probe>`):

1. **Read half** (:meth:`Probe.read`): a local root must be a directory that can be listed
   (:class:`LocalProbe`; a missing one is :class:`StoreNotFoundError` for a read: a typo must not
   look like an empty store); a bucket store authenticates and lists its prefix once, with
   opd_store's own timeouts and at most one retry (:mod:`opd_store.storage.s3._probes`,
   :mod:`opd_store.storage.gcs._probes`).
2. **Write half** (``write=True``, :meth:`Probe.write`): a local root is created if missing and a
   probe file is written, fsynced and deleted in it; a bucket store creates a probe object with the
   create-only write every commit uses and deletes it. Asking ``os.access`` is no proof: a root
   process passes it on a read-only mount or an NFS export with root squash and then cannot write.

The whole check runs on a helper thread that the caller waits for at most ``timeout_secs``
(``connect_timeout_secs``, 15 s by default): whatever a client library does (botocore and gcsfs
retry connection errors for minutes; gcsfs's search for credentials asks the metadata server with
its own retries), the caller gets its answer in time. A check that runs out of time is abandoned
(the thread is a daemon and holds nothing the caller needs) and reported as an endpoint that did
not answer, naming the operation it was in.

Every failure is one :class:`StoreUnreachableError` whose message is ``<url>: cannot <operation>:
<cause>``, the cause in words from the one table of backend failures
(:func:`opd_store.storage._backend_errors.explain`).
"""

from __future__ import annotations

import os
import stat
import threading
from typing import TYPE_CHECKING, Any, Callable

from ..errors import OpdStoreError, StoreNotFoundError, StoreUnreachableError
from ..format import probe_name
from ._backend_errors import Meaning, classify, explain

if TYPE_CHECKING:
    from ._base import Storage

PROBE_BYTES = b"opd-store write probe\n"


class _NoAnswer(Exception):
    """The check did not finish within its bound."""


def call_within(timeout_secs: float, fn: Callable[[], Any], *, name: str = "opd-store-check") -> Any:
    """``fn()`` on a daemon thread, waited for at most ``timeout_secs``.

    Returns:
        Any: what ``fn`` returned.

    Raises:
        _NoAnswer: ``fn`` did not return in time (it keeps running, abandoned).
        BaseException: whatever ``fn`` raised.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome["error"] = exc

    # A plain daemon thread, not an executor: concurrent.futures joins its workers at interpreter
    # exit, which would make an abandoned check hold the process.
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_secs)
    if thread.is_alive():
        raise _NoAnswer()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


class Probe:
    """How :func:`check_reachable` proves one backend usable; this one suits any backend whose
    client answers within the check's bound (memory, other fsspec protocols).

    Args:
        storage (Storage): the backend probed (its errors and URLs are the ones named).
    """

    def __init__(self, storage: "Storage") -> None:
        self.storage = storage

    def read(self, timeout_secs: float, stage: dict[str, str]) -> None:
        """The read half: authenticate and list the root once.

        Args:
            timeout_secs (float): the check's bound (for the requests' own timeouts).
            stage (dict[str, str]): ``stage["operation"]`` is set to the operation under way
                (``list the store``), which the check names if it fails or runs out of time.

        Raises:
            Exception: whatever the backend raised (the check names the cause).
        """
        stage["operation"] = "list the store"
        self.storage.list_children("")

    def write(self, stage: dict[str, str]) -> None:
        """The write half: create a probe object under a reserved name with the create-only write
        every commit uses, then delete it (a save's cleanup and retention delete too). The name
        (:func:`opd_store.format._names.probe_name`) is no step and no attempt: no listing, ``ls``
        or ``gc`` sees it, and one left behind by a killed check is harmless.

        Raises:
            Exception: whatever the backend raised (the check names the cause).
        """
        name = probe_name()
        stage["operation"] = "write a probe object"
        self.storage.create_exclusive(name, PROBE_BYTES)
        stage["operation"] = "delete the probe object"
        self.storage.delete(name)


def check_reachable(storage: "Storage", *, write: bool = True, timeout_secs: float | None = None) -> None:
    """Prove ``storage`` usable (see the module docstring) within ``timeout_secs``.

    Args:
        storage (Storage): the backend (a wrapper's probe is its inner backend's).
        write (bool): also prove a save can write (and create a missing local root); ``False``
            for read-only use.
        timeout_secs (float | None): the bound, in seconds (> 0); the storage's
            ``connect_timeout_secs`` when not given.

    Raises:
        StoreUnreachableError: naming the URL, the operation and the cause.
        StoreNotFoundError: a read-only check of a local root that does not exist.
        ValueError: ``timeout_secs`` is not positive.
    """
    probe = storage.reachability_probe()
    storage = probe.storage
    if timeout_secs is None:
        timeout_secs = storage.timeouts.connect_timeout_secs
    if not timeout_secs > 0:
        raise ValueError(f"timeout_secs must be > 0, got {timeout_secs!r}")
    stage: dict[str, str] = {"operation": "connect"}

    def run() -> None:
        try:
            probe.read(timeout_secs, stage)
        except StoreNotFoundError:
            if not write:
                raise
            probe.write(stage)  # a save creates a missing root: so does its check
            probe.read(timeout_secs, stage)
            return
        if write:
            probe.write(stage)

    try:
        call_within(timeout_secs, run)
    except _NoAnswer:
        raise StoreUnreachableError(
            f"{storage.url_root}: cannot {stage['operation']}: {no_answer(storage, stage['operation'], timeout_secs)}"
        ) from None
    except OpdStoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - every backend failure is reported the same way
        raise StoreUnreachableError(
            f"{storage.url_root}: cannot {stage['operation']}: {check_cause(storage, exc, timeout_secs)}"
        ) from exc


def no_answer(storage: "Storage", operation: str, timeout_secs: float) -> str:
    """The cause of a check that ran out of time during ``operation``."""
    if operation == "find credentials" and storage.credential_sources:
        return f"no credentials found within {timeout_secs:g} s ({storage.credential_sources})"
    where = f"endpoint {storage.endpoint}" if storage.endpoint else "the store"
    return f"{where} did not answer within {timeout_secs:g} s"


def check_cause(storage: "Storage", exc: BaseException, timeout_secs: float) -> str:
    """The cause of a failed check in words (the check's timeout is the one named)."""
    return explain(exc, endpoint=storage.endpoint, connect_timeout_secs=timeout_secs,
                   read_timeout_secs=timeout_secs, credential_sources=storage.credential_sources)


def missing_bucket(storage: "Storage", exc: BaseException) -> StoreUnreachableError | None:
    """The error for a bucket that does not exist, when ``exc`` says so (else ``None``)."""
    if classify(exc) is not Meaning.NOT_FOUND:
        return None
    bucket = storage.root.split("/", 1)[0]
    error = StoreUnreachableError(f"{storage.url_root}: bucket {bucket!r} does not exist")
    error.__cause__ = exc
    return error


class LocalProbe(Probe):
    """A local root: read a directory listing, write a file fsynced in it (module docstring)."""

    def read(self, timeout_secs: float, stage: dict[str, str]) -> None:
        """The root is a directory this process can list.

        Raises:
            StoreNotFoundError: the root does not exist.
            StoreUnreachableError: it is not a directory, or it cannot be listed.
        """
        root = self.storage.root
        stage["operation"] = "list the store root"
        try:
            mode = os.stat(root).st_mode
        except FileNotFoundError:
            raise StoreNotFoundError(f"{root}: no such directory (a save creates it; check the path)") from None
        except NotADirectoryError:
            raise StoreUnreachableError(f"{root}: not a directory (a component of the path is a file)") from None
        if not stat.S_ISDIR(mode):
            raise StoreUnreachableError(f"{root}: exists and is not a directory")
        os.listdir(root)

    def write(self, stage: dict[str, str]) -> None:
        """Create the root if missing, then write, fsync and delete a probe file in it.

        Raises:
            StoreUnreachableError: the root cannot be created, or a file cannot be written in it
                (a read-only mount, root squash, a full disk), naming the OS's reason.
        """
        root = self.storage.root
        stage["operation"] = "create the store root"
        try:
            os.makedirs(root, exist_ok=True)
        except FileExistsError:
            raise StoreUnreachableError(f"{root}: exists and is not a directory") from None
        except OSError as exc:
            raise StoreUnreachableError(f"{root}: cannot create the store root ({exc.strerror or exc})") from exc
        stage["operation"] = "write a probe file in the store root"
        path = os.path.join(root, probe_name())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, PROBE_BYTES)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(path)
        except OSError as exc:
            raise StoreUnreachableError(
                f"{root}: cannot write in the store root ({exc.strerror or exc})"
            ) from exc


def local_clock_secs(storage: "Storage") -> float | None:
    """The modification time the filesystem gives a file created now under the root (a network
    filesystem stamps files with its server's clock), or ``None`` when no file can be created."""
    path = os.path.join(storage.root, probe_name())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


__all__ = [
    "PROBE_BYTES",
    "LocalProbe",
    "Probe",
    "call_within",
    "check_cause",
    "check_reachable",
    "local_clock_secs",
    "missing_bucket",
    "no_answer",
]
