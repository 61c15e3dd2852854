"""The manifest: the one object whose existence commits a checkpoint.

JSON only (never pickle), validated with pydantic on both write and read, so a hostile or damaged
manifest is refused with :class:`~opd_store.errors.ManifestError` before any path in it is used.
``docs/manifest-schema.json`` is generated from :class:`Manifest`.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ManifestError
from .layout import check_payload_name, is_attempt_id

MANIFEST_FORMAT = "opd_store.manifest"
MANIFEST_FORMAT_VERSION = 1
_HEX8 = re.compile(r"^[0-9a-f]{8}$")


class Writer(BaseModel):
    """Who wrote the manifest: for forensics, never for decisions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    pid: int
    rank: int = 0


class PayloadEntry(BaseModel):
    """One payload object of a checkpoint.

    Attributes:
        name: relative name inside the attempt (``training_state.pt``, ``adapter/config.json``).
        path: path relative to the step prefix, ``<attempt_id>/<name>``.
        size_bytes: exact object size in bytes.
        crc32c: CRC32C of the object's bytes, 8 lowercase hex digits, computed while streaming.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    path: str
    size_bytes: int = Field(ge=0)
    crc32c: str

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return check_payload_name(value)

    @field_validator("crc32c")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not _HEX8.match(value):
            raise ValueError(f"crc32c must be 8 lowercase hex digits, got {value!r}")
        return value


class Manifest(BaseModel):
    """The commit record of one checkpoint (format version 1).

    Attributes:
        format: always ``opd_store.manifest``.
        format_version: 1.
        step: the checkpoint's step; must equal the step of the prefix holding the manifest.
        attempt_id: the save attempt whose prefix holds every payload.
        writer: host, pid and rank of the committing process.
        created_at: UTC time of the commit.
        world_size: number of ranks that wrote the checkpoint.
        payloads: every payload object, each with size and CRC32C; names unique.
        metadata: free-form JSON (trainer counters, fingerprints) readable without torch.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = MANIFEST_FORMAT
    format_version: int = MANIFEST_FORMAT_VERSION
    step: int = Field(ge=0)
    attempt_id: str
    writer: Writer
    created_at: _dt.datetime
    world_size: int = Field(default=1, ge=1)
    payloads: tuple[PayloadEntry, ...]
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value != MANIFEST_FORMAT:
            raise ValueError(f"not an opd_store manifest (format {value!r})")
        return value

    @field_validator("format_version")
    @classmethod
    def _version(cls, value: int) -> int:
        if value != MANIFEST_FORMAT_VERSION:
            raise ValueError(
                f"manifest format_version {value} is not supported (this opd_store reads {MANIFEST_FORMAT_VERSION})"
            )
        return value

    @field_validator("attempt_id")
    @classmethod
    def _attempt(cls, value: str) -> str:
        if not is_attempt_id(value):
            raise ValueError(f"attempt_id {value!r} is not of the form attempt-YYYYMMDDTHHMMSSZ-<12 hex>")
        return value

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: _dt.datetime) -> _dt.datetime:
        if value.tzinfo is None:
            raise ValueError("created_at must carry a UTC offset")
        return value.astimezone(_dt.timezone.utc)

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        names = [entry.name for entry in self.payloads]
        if len(set(names)) != len(names):
            raise ValueError("payload names are not unique")
        for entry in self.payloads:
            if entry.path != f"{self.attempt_id}/{entry.name}":
                raise ValueError(f"payload {entry.name!r} path {entry.path!r} is outside attempt {self.attempt_id}")
        return self

    def entry(self, name: str) -> PayloadEntry | None:
        """The payload entry called ``name``, or ``None``."""
        for entry in self.payloads:
            if entry.name == name:
                return entry
        return None

    @property
    def total_size_bytes(self) -> int:
        """Sum of every payload's ``size_bytes``."""
        return sum(entry.size_bytes for entry in self.payloads)

    def to_json_bytes(self) -> bytes:
        """Serialise to UTF-8 JSON (stable key order, one object)."""
        return (self.model_dump_json(indent=1) + "\n").encode("utf-8")


def parse_manifest(data: bytes, *, url: str, expected_step: int | None = None) -> Manifest:
    """Parse and validate manifest bytes.

    Args:
        data (bytes): the manifest object's content.
        url (str): where it was read from, for the error message.
        expected_step (int | None): the step of the prefix holding it; a mismatch is refused.

    Raises:
        ManifestError: not UTF-8 JSON, not a valid version-1 manifest, or for another step.
    """
    try:
        raw = json.loads(data.decode("utf-8"))
        manifest = Manifest.model_validate(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, ValidationError) as exc:
        raise ManifestError(f"unreadable manifest at {url}: {exc}") from exc
    if expected_step is not None and manifest.step != expected_step:
        raise ManifestError(f"manifest at {url} records step {manifest.step}, but lies under step {expected_step}")
    return manifest


def manifest_json_schema() -> dict[str, Any]:
    """The JSON Schema of :class:`Manifest` (written to ``docs/manifest-schema.json``)."""
    return Manifest.model_json_schema()


__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_FORMAT_VERSION",
    "Manifest",
    "PayloadEntry",
    "Writer",
    "manifest_json_schema",
    "parse_manifest",
]
