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

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from ..errors import ManifestError
from ._layout import KeyLayout, object_rel
from ._names import check_attempt_id, check_payload_name

MANIFEST_FORMAT = "opd_store.manifest"
MANIFEST_FORMAT_VERSION = 2
"""The newest format this opd_store reads and writes. Version 2 added the key layout (``layout``
and each entry's ``prefix``); a manifest of the step layout is still written as version 1, byte for
byte what earlier versions wrote, so any opd_store reads it."""
READABLE_FORMAT_VERSIONS = (1, 2)
MAX_MANIFEST_BYTES = 8 << 20
"""Largest manifest accepted, written or read: 8 MiB. A manifest of 10,000 payloads is about
2 MiB; the limit keeps a hostile or damaged object from costing unbounded memory and time.
Readers fetch at most this many bytes plus one."""
_HEX8 = re.compile(r"^[0-9a-f]{8}$")


class Writer(BaseModel):
    """Who wrote the manifest: for forensics, never for decisions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    pid: int = Field(strict=True)
    rank: int = Field(default=0, strict=True)


class PayloadEntry(BaseModel):
    """One payload object of a checkpoint.

    Attributes:
        name: relative name inside the attempt (``training_state.pt``, ``adapter/config.json``).
        path: path relative to the step prefix, ``<attempt_id>/<name>``.
        size_bytes: exact object size in bytes.
        crc32c: CRC32C of the object's bytes, 8 lowercase hex digits, computed while streaming.
        prefix: the spread prefix whose step prefix holds the object (``.spread/0a``: the object is
            ``.spread/0a/step-NNNNNN/<path>``), or ``None`` (not written) for the step prefix
            itself (:mod:`opd_store.format._layout`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    path: str
    size_bytes: int = Field(ge=0, strict=True)
    crc32c: str
    prefix: str | None = None

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

    @model_serializer(mode="wrap")
    def _omit_step_prefix(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if self.prefix is None:
            data.pop("prefix", None)
        return data


class Manifest(BaseModel):
    """The commit record of one checkpoint (format version 1 or 2).

    Attributes:
        format: always ``opd_store.manifest``.
        format_version: 1 for the step layout, 2 for any other (given or not, it is the version
            the layout needs; a version-1 manifest naming another layout is refused).
        step: the checkpoint's step; must equal the step of the prefix holding the manifest.
        attempt_id: the save attempt whose prefix holds every payload.
        writer: host, pid and rank of the committing process.
        created_at: UTC time of the commit.
        world_size: number of ranks that wrote the checkpoint.
        payloads: every payload object, each with size and CRC32C; names unique; each under the
            step prefix or, in the spread layout, under one of the layout's prefixes.
        metadata: free-form JSON (trainer counters, fingerprints) readable without torch.
        layout: where the payloads lie (:class:`~opd_store.format._layout.KeyLayout`; not written
            for the step layout).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = MANIFEST_FORMAT
    format_version: int = Field(default=MANIFEST_FORMAT_VERSION, strict=True)
    step: int = Field(ge=0, strict=True)
    attempt_id: str
    writer: Writer
    created_at: _dt.datetime
    world_size: int = Field(default=1, ge=1, strict=True)
    payloads: tuple[PayloadEntry, ...]
    metadata: dict[str, Any] = Field(default_factory=dict)
    layout: KeyLayout = Field(default_factory=KeyLayout)

    @model_validator(mode="before")
    @classmethod
    def _version_of_layout(cls, data: Any) -> Any:
        # A manifest built without a version gets the one its layout needs (1 for the step layout).
        if isinstance(data, dict) and "format_version" not in data:
            layout = data.get("layout")
            if isinstance(layout, dict):
                default = layout.get("strategy", "step") == "step"
            else:
                default = not isinstance(layout, KeyLayout) or layout.is_default
            data = {**data, "format_version": 1 if default else MANIFEST_FORMAT_VERSION}
        return data

    @field_validator("format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value != MANIFEST_FORMAT:
            raise ValueError(f"not an opd_store manifest (format {value!r})")
        return value

    @field_validator("format_version")
    @classmethod
    def _version(cls, value: int) -> int:
        if value not in READABLE_FORMAT_VERSIONS:
            raise ValueError(f"manifest format_version {value} is not supported (this opd_store reads "
                             f"{' and '.join(map(str, READABLE_FORMAT_VERSIONS))})")
        return value

    @field_validator("attempt_id")
    @classmethod
    def _attempt(cls, value: str) -> str:
        return check_attempt_id(value)

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
        if self.format_version < 2 and not self.layout.is_default:
            raise ValueError(f"the {self.layout.strategy} layout needs format_version 2, not {self.format_version}")
        for entry in self.payloads:
            if entry.path != f"{self.attempt_id}/{entry.name}":
                raise ValueError(f"payload {entry.name!r} path {entry.path!r} is outside attempt {self.attempt_id}")
            if not self.layout.allows(entry.prefix):
                raise ValueError(f"payload {entry.name!r} lies under prefix {entry.prefix!r}, outside the prefixes "
                                 f"the {self.layout.strategy} layout allows")
        return self

    @model_serializer(mode="wrap")
    def _omit_step_layout(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The step layout is written as version 1 always was: no ``layout`` key.
        data = handler(self)
        if self.layout.is_default:
            data.pop("layout", None)
        return data

    def object_rel(self, entry: PayloadEntry) -> str:
        """The key of ``entry``'s object relative to the store root
        (:func:`~opd_store.format._layout.object_rel`)."""
        return object_rel(self.step, entry.prefix, entry.path)

    def prefixes(self) -> tuple[str | None, ...]:
        """Every prefix holding a payload, each once, in order of first use (``None``: the step
        prefix itself)."""
        return tuple(dict.fromkeys(entry.prefix for entry in self.payloads))

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
        """Serialise to UTF-8 JSON (stable key order, one object).

        Raises:
            ManifestError: the result is larger than :data:`MAX_MANIFEST_BYTES` (too much
                metadata); nothing is written.
        """
        data = (self.model_dump_json(indent=1) + "\n").encode("utf-8")
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"manifest of step {self.step} would be {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte "
                "limit; keep metadata small"
            )
        return data


def parse_manifest(data: bytes, *, url: str, expected_step: int | None = None) -> Manifest:
    """Parse and validate manifest bytes.

    Args:
        data (bytes): the manifest object's content.
        url (str): where it was read from, for the error message.
        expected_step (int | None): the step of the prefix holding it; a mismatch is refused.

    Every malformed input (not bytes, over :data:`MAX_MANIFEST_BYTES`, not UTF-8, not JSON, JSON
    nested too deeply or holding integers too long to convert, not a version-1 or -2 manifest, paths
    outside the attempt prefix, prefixes outside the layout's) raises :class:`ManifestError`, never another exception (fuzzed in
    ``tests/reliability/test_manifest_fuzz.py``).

    Raises:
        ManifestError: not UTF-8 JSON, not a valid version-1 or -2 manifest, too large, or for
            another step.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError(f"unreadable manifest at {url}: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"unreadable manifest at {url}: larger than the {MAX_MANIFEST_BYTES}-byte limit"
        )
    try:
        raw = json.loads(bytes(data).decode("utf-8"))
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(f"unreadable manifest at {url}: not a manifest: {_first_problem(exc)}") from exc
    except (ValueError, RecursionError) as exc:
        # ValueError covers UnicodeDecodeError, json.JSONDecodeError, pydantic's ValidationError
        # and int() refusing a 5,000-digit number; RecursionError a deeply nested document.
        raise ManifestError(f"unreadable manifest at {url}: {type(exc).__name__}: {_first_lines(exc)}") from exc
    if expected_step is not None and manifest.step != expected_step:
        raise ManifestError(f"manifest at {url} records step {manifest.step}, but lies under step {expected_step}")
    return manifest


def _first_problem(exc: ValidationError) -> str:
    """One line for pydantic's multi-line report: the first problem's field and reason, and how many
    more (before, its 20+ lines with errors.pydantic.dev links went into every caller's one line)."""
    problems = exc.errors(include_url=False, include_input=False)
    if not problems:  # pydantic always reports one; kept so a change there cannot break the message
        return "invalid"
    first = problems[0]
    field = ".".join(str(part) for part in first["loc"]) or "(the document)"
    reason = " ".join(str(first["msg"]).split())
    more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    return f"{field}: {reason}{more}"


def _first_lines(exc: BaseException, limit_chars: int = 2000) -> str:
    text = str(exc)
    return text if len(text) <= limit_chars else text[:limit_chars] + " ..."


def manifest_json_schema() -> dict[str, Any]:
    """The JSON Schema of :class:`Manifest` (written to ``docs/manifest-schema.json``)."""
    return Manifest.model_json_schema()


__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "READABLE_FORMAT_VERSIONS",
    "Manifest",
    "PayloadEntry",
    "Writer",
    "manifest_json_schema",
    "parse_manifest",
]
