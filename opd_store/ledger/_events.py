"""The run journal's events: a versioned pydantic schema, one small JSON object per event.

Every event names its process start (``start_id``), its place in it (``seq``), the writer's
wall clock (``time_secs``), host, pid and world size; ``step`` is the trainer's successful updates
and ``update_secs`` this start's seconds in updates. The kinds and their fields: docs/ledger.md,
"The run journal". A reader refuses a newer :data:`SCHEMA_VERSION` (:func:`parse_event`), so an
older report skips what it cannot read rather than misreading it. Every number is finite and
bounded (:data:`MAX_TIME_SECS`, :data:`MAX_SECS`, :data:`MAX_SIZE_BYTES`, :data:`MAX_COUNT`): a
damaged or hostile event (``Infinity``, ``1e308``) is refused here, so the report skips it with a
warning rather than overflowing its sums.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .._version import __version__
from ..errors import JournalEventError

SCHEMA_VERSION = 1
MAX_EVENT_BYTES = 16 << 10
"""Largest event object read (16 KiB; a real event is under 1 KiB): a bigger one is skipped unread."""

MAX_TIME_SECS = 4_102_444_800.0
"""Latest wall-clock time an event may name (2100-01-01 UTC, seconds since the epoch; the earliest is 0)."""
MAX_SECS = 1e9
"""Largest duration an event may hold (about 32 years), in seconds."""
MAX_SIZE_BYTES = 1 << 60
"""Largest byte count an event may hold (1 EiB)."""
MAX_COUNT = 1 << 53
"""Largest step, update or request count an event may hold (the largest integer a float holds exactly)."""

_HEX16 = r"^[0-9a-f]{16}$"
Time = Annotated[float, Field(ge=0, le=MAX_TIME_SECS)]
Secs = Annotated[float, Field(ge=0, le=MAX_SECS)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Requests = Annotated[dict[str, Count], Field(default_factory=dict, max_length=16)]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    schema_version: Literal[1] = SCHEMA_VERSION
    time_secs: Time
    start_id: str = Field(pattern=_HEX16)
    seq: Count
    host: str = Field(max_length=255)
    pid: Count
    world_size: int = Field(ge=1, le=MAX_COUNT)


class StartEvent(_Event):
    kind: Literal["start"] = "start"
    process_started_secs: Time
    updates: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    checkpoint_every: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    checkpoint_every_auto: bool = False
    progress_every_secs: Secs | None = None  # None: no progress events
    store_url: str = Field(default="", max_length=2048)
    async_save: bool = False
    shard: bool = False
    version: str = Field(default=__version__, max_length=64)


class ResumeEvent(_Event):
    kind: Literal["resume"] = "resume"
    resumed_step: Count | None = None
    previous_start_id: str | None = Field(default=None, pattern=_HEX16)
    updates_redone: Count | None = None
    checkpoint_every: int | None = Field(default=None, ge=1, le=MAX_COUNT)


class FirstUpdateEvent(_Event):
    kind: Literal["first_update"] = "first_update"
    step: Count
    attempted_updates: Count
    secs_from_process_start: Secs
    update_secs: Secs


class ProgressEvent(_Event):
    kind: Literal["progress"] = "progress"
    step: Count
    attempted_updates: Count
    update_secs: Secs


class SaveEvent(_Event):
    kind: Literal["save"] = "save"
    step: Count
    reason: Literal["periodic", "notice"]
    size_bytes: int | None = Field(default=None, ge=0, le=MAX_SIZE_BYTES)
    blocking_secs: Secs
    commit_secs: Secs
    requests: Requests
    attempted_updates: Count | None = None
    update_secs: Secs = 0.0
    next_checkpoint_every: int | None = Field(default=None, ge=1, le=MAX_COUNT)


class NoticeEvent(_Event):
    kind: Literal["notice"] = "notice"
    source: str = Field(max_length=64)
    detail: str = Field(max_length=512)
    deadline_secs: float | None = None  # < 0: passed; finite, unbounded (a platform's notice names it)
    step: Count
    last_committed_step: Count | None = None
    decision: Literal["save", "skip", "already_committed"]
    estimate_secs: Secs | None = None
    updates_lost: Count
    update_secs: Secs


class ExitEvent(_Event):
    kind: Literal["exit"] = "exit"
    outcome: Literal["finished", "preempted", "failed"]
    step: Count
    attempted_updates: Count
    update_secs: Secs
    wall_secs: Secs
    requests: Requests
    error: str | None = Field(default=None, max_length=1024)


JournalEvent = Annotated[
    Union[StartEvent, ResumeEvent, FirstUpdateEvent, ProgressEvent, SaveEvent, NoticeEvent, ExitEvent],
    Field(discriminator="kind"),
]
KINDS = ("start", "resume", "first_update", "progress", "save", "notice", "exit")
_ADAPTER: TypeAdapter = TypeAdapter(JournalEvent)


def event_for(kind: str, **fields) -> BaseModel:
    """A validated event of ``kind`` (a programming error raises ``ValidationError``)."""
    return _ADAPTER.validate_python({"kind": kind, **fields})


def encode_event(event: BaseModel) -> bytes:
    """The event's object body (compact JSON, UTF-8)."""
    return event.model_dump_json().encode("utf-8")


def parse_event(data: bytes, url: str) -> BaseModel:
    """An event from its object body.

    Raises:
        JournalEventError: (a ``ValueError``) naming ``url``: over :data:`MAX_EVENT_BYTES`, not a
            JSON object, written by a newer schema than :data:`SCHEMA_VERSION`, or not an event of
            this schema (the first field in error named).
    """
    if len(data) > MAX_EVENT_BYTES:
        raise JournalEventError(f"{url}: journal event of {len(data)} bytes is over {MAX_EVENT_BYTES} bytes")
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise JournalEventError(f"{url}: journal event is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise JournalEventError(f"{url}: journal event is not a JSON object")
    version = raw.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise JournalEventError(f"{url}: journal event of schema {version}, newer than this opd_store's "
                                f"{SCHEMA_VERSION} (upgrade opd_store to read it)")
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(event)"
        raise JournalEventError(f"{url}: journal event field {where}: {first['msg']}") from None


__all__ = [
    "KINDS", "MAX_COUNT", "MAX_EVENT_BYTES", "MAX_SECS", "MAX_SIZE_BYTES", "MAX_TIME_SECS", "SCHEMA_VERSION",
    "ExitEvent", "FirstUpdateEvent", "JournalEvent", "NoticeEvent", "ProgressEvent", "ResumeEvent", "SaveEvent",
    "StartEvent", "encode_event", "event_for", "parse_event",
]
