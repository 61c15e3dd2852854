"""The run journal in the store: one create-only object per event, under a reserved prefix.

``.opd-store-journal/<UTC time>-<start_id>-<seq>-<kind>-s<step>.json`` at the store root (a
tiered store's bucket): a listing sorts by time and says how far each start got without a read;
create-only writes never lose another writer's event. Nothing needs the journal (the seed's
resume contract): a failed write is a warning, and the prefix lies outside every step prefix, so
no listing, ``verify``, retention or orphan collection takes an event for a step; ``gc`` bounds it
(:func:`prune_journal`). docs/ledger.md, "The run journal".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
import secrets
import queue
import socket
import threading
import time
from typing import Any, Callable, Iterable

from .._version import __version__
from ..errors import JournalEventError
from ..format import JOURNAL_PREFIX
from ..runtime import route_background_random
from ..store import BaseStore, CheckpointStore
from ._events import MAX_COUNT, MAX_EVENT_BYTES, encode_event, event_for, parse_event

logger = logging.getLogger("opd_store.ledger")

DEFAULT_KEEP_EVENTS = 10_000
"""Events ``gc`` keeps (about 5 MB at the ~500 bytes of an event): older starts are deleted whole."""

_NAME = re.compile(r"^(?P<stamp>\d{8}T\d{6}\.\d{6}Z)-(?P<start>[0-9a-f]{16})-(?P<seq>\d{6,})-"
                   r"(?P<kind>[a-z_]+)-s(?P<step>\d+|-)\.json$")
_ENDED = ("exit",)


@dataclasses.dataclass(frozen=True)
class EventName:
    """What an event object's name says (see the module docstring).

    Attributes:
        rel (str): the object's path relative to the store root.
        time_secs (float): the writer's UTC time, seconds since the epoch.
        start_id (str): the process start.
        seq (int): the event's number in its start.
        kind (str): the event kind.
        step (int | None): the step at the event.
        size_bytes (int): the object's size (from the listing).
    """

    rel: str
    time_secs: float
    start_id: str
    seq: int
    kind: str
    step: int | None
    size_bytes: int = 0


def event_rel(time_secs: float, start_id: str, seq: int, kind: str, step: int | None) -> str:
    """The object path of an event (module docstring)."""
    whole = int(time_secs)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(whole)) + f".{int((time_secs - whole) * 1e6):06d}Z"
    return f"{JOURNAL_PREFIX}/{stamp}-{start_id}-{seq:06d}-{kind}-s{'-' if step is None else f'{step:06d}'}.json"


def parse_event_name(name: str, size_bytes: int = 0) -> EventName | None:
    """The :class:`EventName` of an object name under the journal prefix, ``None`` for any other name
    (one whose step or sequence number is over ``MAX_COUNT``, which no event holds, included)."""
    match = _NAME.fullmatch(name)
    if match is None or len(match["seq"]) > 16 or len(match["step"]) > 16:
        return None
    if int(match["seq"]) > MAX_COUNT or (match["step"] != "-" and int(match["step"]) > MAX_COUNT):
        return None
    import calendar

    stamp = match["stamp"]
    secs = calendar.timegm(time.strptime(stamp[:15], "%Y%m%dT%H%M%S")) + int(stamp[16:22]) / 1e6
    step = None if match["step"] == "-" else int(match["step"])
    return EventName(f"{JOURNAL_PREFIX}/{name}", secs, match["start"], int(match["seq"]), match["kind"], step,
                     size_bytes)


def list_journal(store: BaseStore) -> tuple[list[EventName], list[str]]:
    """The journal's event names in time order, and the names under the prefix that are no event's
    (one delimiter listing of the prefix).

    Raises:
        OSError: the listing failed (a caller that needs nothing from the journal catches it).
    """
    _dirs, files = store.durable_store().storage.list_children(JOURNAL_PREFIX)
    names, strangers = [], []
    for name, size in files.items():
        parsed = parse_event_name(name, size)
        (names.append(parsed) if parsed is not None else strangers.append(f"{JOURNAL_PREFIX}/{name}"))
    names.sort(key=lambda n: (n.time_secs, n.start_id, n.seq))
    return names, sorted(strangers)


def process_started_secs(pid: int | None = None) -> float:
    """When this process (or ``pid``'s) started, seconds since the epoch: Linux ``/proc/<pid>/stat``
    field 22 placed on the wall clock through ``/proc/uptime`` (10 ms resolution), else when
    opd_store was imported.
    """
    try:
        with open(f"/proc/{pid or 'self'}/stat", encoding="ascii") as handle:
            fields = handle.read().rpartition(")")[2].split()
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime_secs = float(handle.read().split()[0])
        booted = time.time() - uptime_secs
        return booted + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 is the 20th after "(comm)"
    except (OSError, ValueError, IndexError):
        return _IMPORTED_SECS


_IMPORTED_SECS = time.time()


class Journal:
    """Writes one process start's events to a store's journal.

    Args:
        store (BaseStore | None): events go to its durable store; ``None`` writes nothing (a rank
            other than 0), sinks still see every event.
        world_size (int): ranks of the job.
        sinks (Iterable): ``observe(event)`` targets (the Prometheus exporter); one that raises is
            logged and kept.

    Attributes:
        start_id (str): 16 hex digits naming this start.
        written (int): events written to the store.
        failed (int): events whose write failed (logged as warnings).

    With ``background`` an event is queued for the writer thread; every event written at once, and
    :meth:`flush`, waits for those queued first, so the order is the calls' order.
    """

    def __init__(self, store: BaseStore | None, *, world_size: int = 1, sinks: Iterable[Any] = ()) -> None:
        self.storage = store.durable_store().storage if store is not None else None
        self.url = store.durable_store().url if store is not None else None
        self.world_size = world_size
        self.sinks = list(sinks)
        self.start_id = secrets.token_hex(8)
        self.host = socket.gethostname()[:255] or "unknown"
        self.pid = os.getpid()
        self.version = __version__
        self.written = 0
        self.failed = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()  # the queue's emptiness and the writer's end, together

    def record(self, kind: str, *, clock: Callable[[], float] = time.time, background: bool = False,
               **fields: Any):
        """Write one event of ``kind`` with ``fields``, or queue it (``background``); return it, or
        ``None`` when ``fields`` are out of the event schema's bounds (a clock past 2100, a
        non-finite time): a warning, as a failed write is, never raised (the journal never stops
        training, docs/ledger.md). Its requests leave the caller's random stream untouched.
        """
        try:
            event = event_for(kind, time_secs=clock(), start_id=self.start_id, seq=self._seq, host=self.host,
                              pid=self.pid, world_size=self.world_size, **fields)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            logger.warning("run journal: a %s event out of the schema's bounds was not written: %s", kind,
                           " ".join(str(exc).split())[:300])
            return None
        self._seq += 1
        for sink in self.sinks:
            try:
                sink.observe(event)
            except Exception:  # noqa: BLE001 - metrics never stop training
                logger.warning("run journal: sink %r failed on a %s event", sink, kind, exc_info=True)
        if self.storage is not None and background:
            self._enqueue(event)
        elif self.storage is not None:
            self.flush()
            self._write(event)
        return event

    def flush(self) -> None:
        """Wait until every event queued with ``background`` was written (or failed) and the writer
        thread ended (it lives only while events are queued: no thread outlives a framework's fit,
        which Lightning's own tests check)."""
        self._queue.join()
        with self._writer_lock:
            writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join(timeout=5.0)  # it ends as soon as it finds the queue empty

    def _enqueue(self, event) -> None:
        with self._writer_lock:
            self._queue.put(event)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, name="opd-store-journal", daemon=True)
                self._writer.start()

    def _write_queued(self) -> None:
        """The writer thread: write each queued event in order, and end when none is left (a later
        event starts another)."""
        while True:
            with self._writer_lock:
                try:
                    event = self._queue.get_nowait()
                except queue.Empty:
                    self._writer = None
                    return
            try:
                self._write(event)
            finally:
                self._queue.task_done()

    def _write(self, event) -> None:
        rel = event_rel(event.time_secs, event.start_id, event.seq, event.kind, getattr(event, "step", None))
        body = encode_event(event)
        try:
            with route_background_random():
                self.storage.create_exclusive(rel, body)
            with self._lock:
                self.written += 1
        except Exception as exc:  # noqa: BLE001 - the journal is never needed (module docstring)
            with self._lock:
                self.failed += 1
            logger.warning("run journal: could not write %s (%s: %s); training goes on without it",
                           self.storage.url(rel), type(exc).__name__, exc)


@dataclasses.dataclass
class JournalContents:
    """What :func:`read_journal` found.

    Attributes:
        events (list): the readable events, in order (starts by their first event's time, then
            each start's events by ``seq``).
        skipped (list[str]): one line per object skipped (its URL and why).
        size_bytes (int): bytes of every object under the prefix.
    """

    events: list
    skipped: list[str]
    size_bytes: int


def read_journal(store: BaseStore, *, max_workers: int = 8) -> JournalContents:
    """Every readable event of ``store``'s journal: one listing, then one GET per event in
    ``max_workers`` threads. Oversized, malformed, newer-schema or name-disagreeing objects are
    skipped with a warning naming the URL; so is an object in the journal folder's place (a local
    store then writes no event), found by a listing of the root when the journal lists empty.

    Raises:
        OSError: the listing failed.
    """
    names, strangers = list_journal(store)
    storage = store.durable_store().storage
    skipped = [f"{storage.url(rel)}: not a journal event name" for rel in strangers]
    if not names and not strangers and JOURNAL_PREFIX in storage.list_children("")[1]:
        skipped.append(f"{storage.url(JOURNAL_PREFIX)}: an object where the journal's folder should be "
                       "(no event can be written or read under it)")
    size_bytes = sum(n.size_bytes for n in names)

    def load(name: EventName):
        url = storage.url(name.rel)
        if name.size_bytes > MAX_EVENT_BYTES:
            raise JournalEventError(f"{url}: journal event of {name.size_bytes} bytes is over {MAX_EVENT_BYTES} bytes")
        event = parse_event(storage.read_bytes(name.rel, small=True, max_bytes=MAX_EVENT_BYTES), url)
        if (event.start_id, event.seq, event.kind) != (name.start_id, name.seq, name.kind):
            raise JournalEventError(f"{url}: journal event body ({event.kind} {event.seq} of start {event.start_id}) "
                                    "disagrees with its name")
        return event

    events = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
        for name, future in [(name, pool.submit(load, name)) for name in names]:
            try:
                events.append(future.result())
            except JournalEventError as exc:
                skipped.append(str(exc))
            except FileNotFoundError:
                skipped.append(f"{storage.url(name.rel)}: deleted while being read")
    for line in skipped:
        logger.warning("run journal: skipped %s", line)
    first = {}
    for event in events:
        first[event.start_id] = min(first.get(event.start_id, event.time_secs), event.time_secs)
    events.sort(key=lambda e: (first[e.start_id], e.start_id, e.seq))
    return JournalContents(events, skipped, size_bytes)


@dataclasses.dataclass(frozen=True)
class StartSummary:
    """How far one start got, from the journal's names alone.

    Attributes:
        start_id (str): the start.
        last_step (int | None): the highest step any of its events names.
        ended (bool): it wrote an ``exit`` event.
    """

    start_id: str
    last_step: int | None
    ended: bool


def previous_start(names: list[EventName], own_start_id: str) -> StartSummary | None:
    """The newest start other than ``own_start_id`` (by its newest event's time), or ``None``."""
    newest: dict[str, float] = {}
    for name in names:
        if name.start_id != own_start_id:
            newest[name.start_id] = max(newest.get(name.start_id, name.time_secs), name.time_secs)
    if not newest:
        return None
    start_id = max(newest, key=lambda s: (newest[s], s))
    mine = [n for n in names if n.start_id == start_id]
    steps = [n.step for n in mine if n.step is not None]
    return StartSummary(start_id, max(steps) if steps else None, any(n.kind in _ENDED for n in mine))


def prune_journal(store: CheckpointStore, *, keep_events: int = DEFAULT_KEEP_EVENTS,
                  dry_run: bool = True) -> list[EventName]:
    """Bound ``store``'s journal: delete the oldest starts' events, a whole start at a time, until at
    most ``keep_events`` are left; objects that are no event's are left alone.

    Returns:
        list[EventName]: the events deleted (or that would be with ``dry_run``), with their paths
            and sizes from the listing.

    Raises:
        ValueError: ``keep_events`` < 0.
        OSError: a backend failure (what was deleted stays deleted).
    """
    if keep_events < 0:
        raise ValueError(f"keep_events must be >= 0, got {keep_events}")
    names, _strangers = list_journal(store)
    excess = len(names) - keep_events
    if excess <= 0:
        return []
    by_start: dict[str, list[EventName]] = {}
    for name in names:  # time order: the first start seen is the oldest
        by_start.setdefault(name.start_id, []).append(name)
    doomed: list[EventName] = []
    for events in by_start.values():
        if len(doomed) >= excess:
            break
        doomed += events
    if not dry_run:
        for name in doomed:
            store.storage.delete(name.rel)
    return doomed


__all__ = [
    "DEFAULT_KEEP_EVENTS", "EventName", "Journal", "JournalContents", "StartSummary", "event_rel", "list_journal",
    "parse_event_name", "previous_start", "process_started_secs", "prune_journal", "read_journal",
]
