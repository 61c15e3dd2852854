"""Object names of a checkpoint store: pure functions, no I/O.

Layout under a store root (a local directory or a bucket prefix)::

    step-000042/                          one prefix per step (seed naming, >= 6 digits)
    step-000042/manifest.json             the commit record; the step exists iff this exists
    step-000042/attempt-<utc>-<hex>/...   payload objects of one save attempt
    step-000042/COMPLETE                  a legacy checkpoint's marker (opd_store.store._legacy)
    .opd-store-probe-<hex>                a reachability probe (created and deleted at once by
                                          ``check_reachable``); not a step, never listed as one
    .opd-store-journal/<time>-...json     the run journal (:mod:`opd_store.ledger`): one create-only
                                          object per event, outside every step prefix, so no
                                          listing, ``ls``, ``verify``, retention or ``gc`` step
                                          logic takes it for a step; bounded by ``gc``

Step order is numeric, never lexicographic (``step-1000000`` follows ``step-999999``).
"""

from __future__ import annotations

import re
import secrets
import time

MANIFEST_NAME = "manifest.json"
STEP_PREFIX = "step-"
PROBE_PREFIX = ".opd-store-probe-"
JOURNAL_PREFIX = ".opd-store-journal"

_STEP_RE = re.compile(r"^step-(\d{6,})$")
_ATTEMPT_RE = re.compile(r"^attempt-(\d{8}T\d{6}Z)-([0-9a-f]{12})$")
# Characters refused in payload names: path tricks (backslash), glob / URL syntax that some fsspec
# backends would interpret (field notes: "keys with glob characters misread as patterns"), ":" (a
# protocol such as "s3://" or "file:", a Windows drive) and every control character (a hostile
# manifest must not name an object outside its attempt prefix).
_FORBIDDEN_NAME_CHARS = set("\\*?[]{}#:") | {chr(code) for code in range(32)} | {"\x7f"}


def step_dirname(step: int) -> str:
    """Return the prefix name of ``step`` (``step-000042``).

    Args:
        step (int): a non-negative step number (the seed uses ``successful_updates``).

    Raises:
        ValueError: ``step`` is negative or not an ``int``.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"{STEP_PREFIX}{step:06d}"


def parse_step_dirname(name: str) -> int | None:
    """Return the step of a canonical step prefix name, or ``None`` for any other name.

    Only the canonical spelling counts (``step-000042``, ``step-1000000``), so two names can never
    denote one step (``step-0000042`` is ignored).
    """
    match = _STEP_RE.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dirname(step) == name else None


def new_attempt_id(now_secs: float | None = None) -> str:
    """Return a fresh attempt id, ``attempt-YYYYMMDDTHHMMSSZ-<12 hex>`` (UTC).

    The timestamp lets tools age uncommitted attempts from the name alone; 48 random bits keep two
    writers of one step apart.
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now_secs is None else now_secs))
    return f"attempt-{stamp}-{secrets.token_hex(6)}"


def probe_name() -> str:
    """A fresh name for a reachability probe object at the store root (``.opd-store-probe-<hex>``).

    It lies outside every step prefix, so listings, ``ls``, retention and ``gc`` never see it as
    a step or an attempt (they read only ``step-NNNNNN/`` prefixes); 64 random bits keep two
    concurrent checks apart.
    """
    return f"{PROBE_PREFIX}{secrets.token_hex(8)}"


def is_attempt_id(name: str) -> bool:
    """True when ``name`` is an attempt id made by :func:`new_attempt_id`."""
    return isinstance(name, str) and _ATTEMPT_RE.fullmatch(name) is not None


def check_attempt_id(value: str) -> str:
    """Validate an attempt id (the form :func:`new_attempt_id` makes) and return it.

    Raises:
        ValueError: ``value`` is not of the form ``attempt-YYYYMMDDTHHMMSSZ-<12 hex>``.
    """
    if not is_attempt_id(value):
        raise ValueError(f"attempt_id {value!r} is not of the form attempt-YYYYMMDDTHHMMSSZ-<12 hex>")
    return value


def attempt_created_secs(attempt_id: str) -> float | None:
    """Seconds since the epoch (UTC) encoded in an attempt id, or ``None`` if it is not one."""
    match = _ATTEMPT_RE.fullmatch(attempt_id)
    if match is None:
        return None
    import calendar

    return float(calendar.timegm(time.strptime(match.group(1), "%Y%m%dT%H%M%SZ")))


def check_payload_name(name: str) -> str:
    """Validate a payload's relative name and return it.

    A name is one or more ``/``-separated components, none empty, ``.`` or ``..``, no leading
    ``/``, and no backslash, ``:``, glob (``* ? [ ] { }``), ``#`` or control characters (code
    points 0-31 and 127). This keeps a hostile manifest from naming objects outside its attempt
    prefix: no parent components, no absolute paths, no other protocol (``s3://``, ``file:``), no
    Windows separators or drives, no empty segments (``a//b``), no names a backend would read as
    a pattern.

    Raises:
        ValueError: the name is not a safe relative name.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"payload name must be a non-empty string, got {name!r}")
    if name.startswith("/") or any(ch in _FORBIDDEN_NAME_CHARS for ch in name):
        raise ValueError(f"payload name {name!r} must be relative and free of \\ : * ? [ ] {{ }} # and control characters")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"payload name {name!r} has an empty, '.' or '..' component")
    return name


__all__ = [
    "JOURNAL_PREFIX",
    "MANIFEST_NAME",
    "PROBE_PREFIX",
    "STEP_PREFIX",
    "attempt_created_secs",
    "check_attempt_id",
    "check_payload_name",
    "is_attempt_id",
    "new_attempt_id",
    "parse_step_dirname",
    "probe_name",
    "step_dirname",
]
