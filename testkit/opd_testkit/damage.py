"""Damage a committed payload the way another program (or bit rot) would: through the backend's own
client, never through opd_store (which never rewrites a committed object).

The kinds every entry point's resume is tested against (:data:`DAMAGE_KINDS`): the payload deleted,
truncated to half its size, or one byte flipped in its middle (same size: only its CRC32C tells).
A missing rank file of a multi-rank checkpoint is ``delete`` of that rank's payload.
"""

from __future__ import annotations

from typing import Any

DAMAGE_KINDS = ("delete", "truncate", "flip")


def payload_path(backend: Any, step: int, name: str, *, attempt_id: str | None = None) -> str:
    """The raw backend path of payload ``name`` of committed ``step`` (the manifest's attempt, or
    ``attempt_id``)."""
    if attempt_id is None:
        from opd_store.format import MANIFEST_NAME, parse_manifest

        manifest = f"{backend.raw_root()}/step-{step:06d}/{MANIFEST_NAME}"
        attempt_id = parse_manifest(backend.raw_fs().cat_file(manifest), url=manifest).attempt_id
    return f"{backend.raw_root()}/step-{step:06d}/{attempt_id}/{name}"


def damage_payload(backend: Any, step: int, name: str, kind: str) -> str:
    """Damage payload ``name`` of committed ``step`` of ``backend`` (a :class:`~opd_testkit.stores.Backend`).

    Args:
        kind (str): ``delete``, ``truncate`` (to half its size) or ``flip`` (one byte in the middle).

    Returns:
        str: the payload's path relative to the store root (what an error should name).

    Raises:
        ValueError: an unknown ``kind``.
        FileNotFoundError: no such payload.
    """
    if kind not in DAMAGE_KINDS:
        raise ValueError(f"damage kind must be one of {DAMAGE_KINDS}, got {kind!r}")
    fs = backend.raw_fs()
    path = payload_path(backend, step, name)
    data = fs.cat_file(path)
    if kind == "delete":
        fs.rm_file(path)
    elif kind == "truncate":
        fs.pipe_file(path, data[: len(data) // 2])
    else:
        middle = len(data) // 2
        fs.pipe_file(path, data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    return path[len(backend.raw_root()) + 1:]


__all__ = ["DAMAGE_KINDS", "damage_payload", "payload_path"]
