"""The run journal's events: a versioned pydantic schema, one small JSON object per event.

Every event names the process start it belongs to (``start_id``, 16 hex digits, new for each
process start), its place in that start (``seq``, from 0), the writer's wall clock (``time_secs``,
seconds since the epoch: the *writer's* clock, so events of one start are ordered by ``seq`` and
starts by their first event), the host, the pid and the world size. The kinds:

============  ======================================================================================
start         the process started: ``process_started_secs`` (the kernel's start time of the
              process), the job's ``updates`` and checkpoint interval, the progress interval
resume        the step resumed from (``None``: from scratch), the updates the previous start made
              after that step (``updates_redone``, from the journal's names; ``None`` when unknown)
first_update  the first update of this start finished: ``secs_from_process_start``
progress      the step reached (at most one per ``progress_every_secs``; every update when 0)
save          a committed save: bytes, blocking seconds, seconds to commit, requests by kind
notice        a preemption notice: source, seconds left to its deadline, the decision
              (``save`` / ``skip`` / ``already_committed``) and the estimate it rested on
exit          the start ended: ``finished``, ``preempted`` or ``failed`` (a start killed outright
              writes none: the report infers the kill)
============  ======================================================================================

``step`` is the trainer's successful updates at the event and ``update_secs`` the seconds this start
has spent in updates so far (saves and waits excluded): the report's goodput and lost work rest on
them. A writer that does not measure something leaves the optional fields out (the trainer
integrations, :mod:`opd_store.integrations._trainer_journal`, have no estimate for a notice and no
failed updates). :data:`SCHEMA_VERSION` is written in every event; a reader refuses a newer one
(:func:`parse_event`), so a report from an older opd_store skips what it cannot read instead of
misreading it.
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
