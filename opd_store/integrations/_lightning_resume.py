"""Which Lightning checkpoint a load reads, and its bytes read once, verified.

``ckpt_path="last"`` reads the newest ``last*.ckpt`` commit, or, when it is damaged or no
``last*.ckpt`` name holds a commit (deleted as the damage's remedy says, or a kill before the first
``last.ckpt`` commit), the newest intact version of any name with a warning (a new save commits
above every listed version, so no collision; never a silent fresh start); an explicit path reads
its newest version or fails naming the damage; a path outside the root is another store or a plain
file read unchecked. The rule: docs/resume.md, "A damaged checkpoint"; in Lightning's terms:
docs/integrations.md, "Lightning".
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import io
import logging
import os
import re
from typing import Any, BinaryIO

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError, ManifestError
from ..storage import open_storage, refuse_mistyped_url
from ..store import COMPLETE, CORRUPT, INCOMPLETE, BaseStore, CheckpointInfo

logger = logging.getLogger("opd_store.integrations.lightning")

PAYLOAD_NAME = "checkpoint.ckpt"
DAMAGE = (IntegrityError, IncompleteCheckpointError, ManifestError)
"""What a committed version whose bytes no longer match its manifest raises when it is opened."""
_COMMITTED = (COMPLETE, INCOMPLETE, CORRUPT)
_EPOCH = _dt.datetime.min.replace(tzinfo=_dt.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Version:
    """One committed version of a checkpoint name.

    Attributes:
        name (str): the name relative to the root (``last.ckpt``), or the path of an outside store.
        store (BaseStore): the name's store.
        info (CheckpointInfo): the version (its ``step``) with status and manifest.
    """

    name: str
    store: BaseStore
    info: CheckpointInfo

    @property
    def global_step(self) -> Any:
        return self.info.metadata.get("global_step")

    def describe(self) -> str:
        """``<name url> version N (global_step G)``."""
        return f"{self.store.url} version {self.info.step} (global_step {self.global_step})"

    def order(self) -> tuple:
        """Sort key, oldest first: commit time, then global_step, then version."""
        step = self.global_step if isinstance(self.global_step, int) else -1
        return self.info.created_at or _EPOCH, step, self.info.step

    def open(self) -> BinaryIO:
        """The payload's reader, its size and CRC32C checked against the manifest.

        Raises:
            IncompleteCheckpointError: a payload missing or short by the listing (nothing downloaded),
                or vanished since.
            IntegrityError: the downloaded bytes differ from the manifest.
            ManifestError: the manifest cannot be parsed.
        """
        if self.info.status != COMPLETE:
            detail = "; ".join(f"{self.store.step_url(self.info.step)}/{p.detail}" for p in self.info.problems)
            cls = ManifestError if self.info.manifest is None else IncompleteCheckpointError
            raise cls(f"step {self.info.step} is {self.info.status}: {detail or 'unreadable manifest'}")
        return self.store.open(self.info.step, PAYLOAD_NAME, manifest=self.info.manifest)


def committed_versions(name: str, store: BaseStore) -> list[Version]:
    """Every committed version of ``name`` (intact or damaged), oldest version first (one listing)."""
    return [Version(name, store, info) for info in store.checkpoints() if info.status in _COMMITTED]


def remedy(version: Version) -> str:
    return f"`opd-store delete {version.store.url} {version.info.step}`"


def open_newest(name: str, store: BaseStore) -> tuple[Version, BinaryIO] | None:
    """The newest committed version of ``name`` and its verified reader; ``None`` when the name
    holds no committed version.

    Raises:
        IntegrityError, IncompleteCheckpointError, ManifestError: (the damage's own class) that
            version is damaged; one line naming it, the file and the remedy.
    """
    versions = committed_versions(name, store)
    if not versions:
        return None
    newest = versions[-1]
    try:
        return newest, newest.open()
    except DAMAGE as exc:
        raise type(exc)(
            f"{newest.describe()} is damaged ({exc}); nothing was loaded: load another checkpoint "
            f"(ckpt_path=\"last\" resumes from the newest intact one) or remove this version with {remedy(newest)}"
        ) from exc


def is_last_name(name: str, pattern: re.Pattern) -> bool:
    return bool(pattern.match(name.rsplit("/", 1)[-1]))


def open_last(root_url: str, names: dict[str, BaseStore], pattern: re.Pattern) -> tuple[Version, BinaryIO]:
    """What ``ckpt_path="last"`` loads: the newest commit among names matching ``pattern``, else (it is
    damaged, or no such name holds a commit) the newest intact version of any name, with one warning
    naming the version loaded and the skipped ones.

    Args:
        root_url (str): the plugin's root (for messages).
        names (dict[str, BaseStore]): every checkpoint name under the root with its store.
        pattern (re.Pattern): the ``last*.ckpt`` names.

    Raises:
        CheckpointNotFoundError: no name under the root holds a committed version.
        IntegrityError, IncompleteCheckpointError, ManifestError: no committed version is intact
            (one line naming each and the remedy).
    """
    versions = sorted((version for name, store in names.items() for version in committed_versions(name, store)),
                      key=Version.order, reverse=True)
    if not versions:
        raise CheckpointNotFoundError(f"{root_url}: no committed checkpoint")
    lasts = [version for version in versions if is_last_name(version.name, pattern)]
    ordered = [lasts[0], *(v for v in versions if v is not lasts[0])] if lasts else versions
    skipped: list[tuple[Version, Exception]] = []
    for version in ordered:
        try:
            reader = version.open()
        except DAMAGE as exc:
            skipped.append((version, exc))
            continue
        if skipped or not lasts:
            logger.warning("%s: ckpt_path=\"last\" %sresumes from %s%s", root_url,
                           "" if lasts else "found no committed last*.ckpt checkpoint; ", version.describe(),
                           "; skipped the damaged " + "; ".join(f"{v.describe()} ({exc})" for v, exc in skipped)
                           if skipped else "")
        return version, reader
    error = skipped[0][1]
    raise type(error)(
        f"{root_url}: ckpt_path=\"last\" found no intact checkpoint (damaged: "
        + "; ".join(f"{v.describe()} ({exc})" for v, exc in skipped)
        + "); nothing was loaded: remove the damaged versions with "
        + ", ".join(remedy(v) for v, _exc in skipped) + ", or start from scratch with ckpt_path=None"
    ) from error


def open_plain(path: str | os.PathLike, storage_options: dict[str, Any]) -> BinaryIO | None:
    """A plain checkpoint file (not a store) at ``path``, read whole and unchecked (no manifest
    records its checksum), or ``None`` when there is no such object. A path without a protocol is
    local."""
    text = os.fspath(path)
    if "://" not in text:
        refuse_mistyped_url(text)
        text = os.path.abspath(text)
    parent, _, base = text.rstrip("/").rpartition("/")
    storage = open_storage(parent or "/", storage_options)
    if not base or storage.size(base) is None:
        return None
    return io.BytesIO(storage.read_bytes(base))


__all__ = ["DAMAGE", "PAYLOAD_NAME", "Version", "committed_versions", "is_last_name", "open_last", "open_newest",
           "open_plain"]
