"""Reads checked against the manifest: one payload's bytes, a deep verify.

A payload is never handed to a caller before its size and CRC32C equal the manifest's entry
(``torch.load`` of a damaged archive could otherwise fail anywhere, or worse, load). Remote
objects are fetched whole into memory, never through a seeking file reader (ranged reads through an
s3fs file fetched 2.7x the bytes, field notes): on S3 with parallel ranged GETs of the manifest's
size into one buffer (``Storage.open_checked``); local files are checksummed through a read-only memory map and the
file itself is returned, so a load reads the page cache once more instead of copying. Payload
objects are never rewritten after their commit (each attempt has its own prefix), so a checked
reader stays valid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, BinaryIO, Callable

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError
from ..format import Manifest, step_dirname
from ..storage import is_missing
from ._resume_guard import remedy
from ._status import COMPLETE, CORRUPT, Problem, StepState, VerifyReport

if TYPE_CHECKING:
    from ..storage import Storage


def open_payload(storage: "Storage", step: int, name: str, manifest: Manifest) -> BinaryIO:
    """A seekable reader of the payload ``name`` of ``step``, after its size and CRC32C were
    checked against ``manifest``.

    Raises:
        ValueError: ``manifest`` is another step's.
        CheckpointNotFoundError: the manifest has no payload ``name``.
        IncompleteCheckpointError: the manifest lists the object but it is absent.
        IntegrityError: size or checksum differ (names URL, step, object, expected and actual).
        Both damage errors end with the remedy (:func:`~opd_store.store._resume_guard.remedy`).
    """
    if manifest.step != step:
        raise ValueError(f"the manifest given for step {step} is the manifest of step {manifest.step}")
    entry = manifest.entry(name)
    if entry is None:
        raise CheckpointNotFoundError(f"step {step} at {storage.url(step_dirname(step))} has no payload {name!r}")
    rel = manifest.object_rel(entry)
    url = storage.url(rel)
    try:
        reader, size_bytes, crc = storage.open_checked(rel, size_bytes=entry.size_bytes)
    except Exception as exc:  # noqa: BLE001 - a missing payload is named; anything else propagates
        if is_missing(exc):
            raise IncompleteCheckpointError(f"step {step}: payload {name!r} listed in the manifest is missing at {url}; "
                                            f"{remedy(storage.url_root, step)}") from exc
        raise
    if size_bytes != entry.size_bytes or crc != entry.crc32c:
        reader.close()
        what = (f"has {size_bytes} bytes, manifest says {entry.size_bytes}" if size_bytes != entry.size_bytes
                else f"has crc32c {crc}, manifest says {entry.crc32c}")
        raise IntegrityError(f"step {step}: payload {name!r} at {url} {what}; {remedy(storage.url_root, step)}")
    return reader


KeepReader = Callable[[str, BinaryIO], None]
"""``keep(name, reader)``: takes the reader of a payload a deep verify found intact (the callee
owns it and closes it), so that a load can use the bytes the verify read (docs/resume.md)."""


def verify_step(storage: "Storage", step: int, state: StepState, *, deep: bool = False,
                keep: KeepReader | None = None) -> VerifyReport:
    """The :class:`VerifyReport` of ``step`` from its state; with ``deep`` every payload is read
    and its CRC32C recomputed (a complete step with a checksum problem becomes ``corrupt``), and
    the reader of each payload found intact is handed to ``keep`` (closed when ``keep`` is ``None``)."""
    status, manifest, problems = state.status, state.manifest, list(state.problems)
    checked = len(manifest.payloads) if manifest else 0
    if deep and manifest is not None:
        for entry in manifest.payloads:
            if any(p.name == entry.name for p in problems):
                continue
            try:
                reader, _size, actual = storage.open_checked(manifest.object_rel(entry), size_bytes=entry.size_bytes)
            except Exception as exc:  # noqa: BLE001 - a vanished payload is a problem; anything else propagates
                if not is_missing(exc):
                    raise
                problems.append(Problem(entry.name, "missing", f"{entry.path} vanished while verifying"))
                continue
            if actual != entry.crc32c:
                reader.close()
                problems.append(
                    Problem(entry.name, "checksum", f"{entry.path}: expected crc32c {entry.crc32c}, found {actual}")
                )
            elif keep is not None:
                keep(entry.name, reader)
            else:
                reader.close()
        if problems and status == COMPLETE:
            status = CORRUPT
    return VerifyReport(url=storage.url(step_dirname(step)), step=step, status=status, deep=deep,
                        checked_objects=checked, problems=tuple(problems))


__all__ = ["KeepReader", "open_payload", "verify_step"]
