"""Which bytes of each object the GETs a proxy saw read: "a resume reads each byte once", counted
against the S3 server (docs/resume.md, "One download per resume").

A payload is read once when the ``GetObject`` requests for its key (whole or ranged, as
``storage/transfers/_ranged_reads.py`` sends them) cover every byte of it exactly once:
:func:`times_read` returns ``(1, 1)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


def ranges_read(requests: Iterable[Any]) -> dict[str, list[tuple[int, int]]]:
    """``{"bucket/key": [(start, end), ...]}`` (end exclusive) of every answered ``GetObject``
    among ``requests`` (:class:`~opd_testkit.proxies.Request` records), in the order they came."""
    out: dict[str, list[tuple[int, int]]] = {}
    for request in requests:
        if request.op != "GetObject" or request.status not in (200, 206):
            continue
        match = _RANGE.fullmatch(request.headers.get("range", "").strip())
        if match is None:
            start, end = 0, request.response_bytes
        else:
            start = int(match.group(1))
            end = int(match.group(2)) + 1 if match.group(2) else start + request.response_bytes
            end = min(end, start + request.response_bytes)
        out.setdefault(unquote(request.path).lstrip("/"), []).append((start, end))
    return out


def times_read(ranges: Iterable[tuple[int, int]], size_bytes: int) -> tuple[int, int]:
    """``(fewest, most)`` times any byte of ``[0, size_bytes)`` was read by ``ranges``; ``(1, 1)``
    is "every byte read exactly once", ``(0, 0)`` "never read" (an empty object: ``(0, 0)`` too)."""
    edges: dict[int, int] = {}
    for start, end in ranges:
        start, end = max(0, start), min(size_bytes, end)
        if start < end:
            edges[start] = edges.get(start, 0) + 1
            edges[end] = edges.get(end, 0) - 1
    if size_bytes <= 0:
        return (0, 0)
    counts, depth, position = [], 0, 0
    for edge in sorted(set(edges) | {0, size_bytes}):
        if edge > position:
            counts.append(depth)
        depth += edges.get(edge, 0)
        position = edge
    return (min(counts), max(counts))


def payload_reads(requests: Iterable[Any], backend: Any, step: int, manifest: Any) -> dict[str, tuple[int, int]]:
    """:func:`times_read` of every payload of ``manifest`` (step ``step`` of ``backend``, an S3
    :class:`~opd_testkit.stores.Backend`), by payload name."""
    ranges = ranges_read(requests)
    prefix = f"{backend.raw_root()}/step-{step:06d}"
    return {entry.name: times_read(ranges.get(f"{prefix}/{entry.path}", []), entry.size_bytes)
            for entry in manifest.payloads}


__all__ = ["payload_reads", "ranges_read", "times_read"]
