"""The run journal's events: a versioned pydantic schema, one small JSON object per event.

Every event names its process start (``start_id``), its place in it (``seq``), the writer's
wall clock (``time_secs``), host, pid and world size; ``step`` is the trainer's successful updates
and ``update_secs`` this start's seconds in updates. The kinds and their fields: docs/ledger.md,
"The run journal". A reader refuses a newer :data:`SCHEMA_VERSION` (:func:`parse_event`), so an
older report skips what it cannot read rather than misreading it.
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

_HEX16 = r"^[0-9a-f]{16}$"


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    time_secs: float = Field(ge=0)
    start_id: str = Field(pattern=_HEX16)
    seq: int = Field(ge=0)
    host: str = Field(max_length=255)
    pid: int = Field(ge=0)
    world_size: int = Field(ge=1)


class StartEvent(_Event):
    kind: Literal["start"] = "start"
    process_started_secs: float = Field(ge=0)
    updates: int | None = Field(default=None, ge=1)
    checkpoint_every: int | None = Field(default=None, ge=1)
    checkpoint_every_auto: bool = False
    progress_every_secs: float | None = Field(default=None, ge=0)  # None: no progress events
    store_url: str = Field(default="", max_length=2048)
    async_save: bool = False
    shard: bool = False
    version: str = Field(default=__version__, max_length=64)


class ResumeEvent(_Event):
    kind: Literal["resume"] = "resume"
    resumed_step: int | None = Field(default=None, ge=0)
    previous_start_id: str | None = Field(default=None, pattern=_HEX16)
    updates_redone: int | None = Field(default=None, ge=0)
    checkpoint_every: int | None = Field(default=None, ge=1)


class FirstUpdateEvent(_Event):
    kind: Literal["first_update"] = "first_update"
    step: int = Field(ge=0)
    attempted_updates: int = Field(ge=0)
    secs_from_process_start: float = Field(ge=0)
    update_secs: float = Field(ge=0)


class ProgressEvent(_Event):
    kind: Literal["progress"] = "progress"
    step: int = Field(ge=0)
    attempted_updates: int = Field(ge=0)
    update_secs: float = Field(ge=0)


class SaveEvent(_Event):
    kind: Literal["save"] = "save"
    step: int = Field(ge=0)
    reason: Literal["periodic", "notice"]
    size_bytes: int | None = Field(default=None, ge=0)
    blocking_secs: float = Field(ge=0)
    commit_secs: float = Field(ge=0)
    requests: dict[str, int] = Field(default_factory=dict, max_length=16)
    attempted_updates: int | None = Field(default=None, ge=0)
    update_secs: float = Field(default=0.0, ge=0)
    next_checkpoint_every: int | None = Field(default=None, ge=1)


class NoticeEvent(_Event):
    kind: Literal["notice"] = "notice"
    source: str = Field(max_length=64)
    detail: str = Field(max_length=512)
    deadline_secs: float | None = None
    step: int = Field(ge=0)
    last_committed_step: int | None = Field(default=None, ge=0)
    decision: Literal["save", "skip", "already_committed"]
    estimate_secs: float | None = Field(default=None, ge=0)
    updates_lost: int = Field(ge=0)
    update_secs: float = Field(ge=0)


class ExitEvent(_Event):
    kind: Literal["exit"] = "exit"
    outcome: Literal["finished", "preempted", "failed"]
    step: int = Field(ge=0)
    attempted_updates: int = Field(ge=0)
    update_secs: float = Field(ge=0)
    wall_secs: float = Field(ge=0)
    requests: dict[str, int] = Field(default_factory=dict, max_length=16)
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
    "KINDS", "MAX_EVENT_BYTES", "SCHEMA_VERSION", "ExitEvent", "FirstUpdateEvent", "JournalEvent", "NoticeEvent",
    "ProgressEvent", "ResumeEvent", "SaveEvent", "StartEvent", "encode_event", "event_for", "parse_event",
]
