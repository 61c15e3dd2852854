"""The storage seam: a handful of verbs over one fsspec filesystem and a root prefix.

Everything above this module speaks in paths relative to the store root (``step-000001/manifest.json``)
and never touches fsspec. Every verb that can decide a checkpoint's state (list, size, read) sees the
backend as it is now: s3fs and gcsfs cache listings and object sizes per instance (field notes: a
stale cached size made s3fs return a truncated body without error), so each such verb drops the
instance's caches first. Stores get a private filesystem instance (``skip_instance_cache=True``), so
dropping its caches costs other code nothing.
"""

from __future__ import annotations

import logging
import posixpath
from typing import BinaryIO

logger = logging.getLogger("opd_store.storage")


class Storage:
    """One fsspec filesystem rooted at a prefix.

    Subclasses provide the create-only primitive (:meth:`create_exclusive`) of their backend and
    may override the streaming writer.

    Attributes:
        fs (fsspec.AbstractFileSystem): the filesystem (private instance).
        root (str): the root in the filesystem's own path spelling, no trailing ``/``.
        url_root (str): the root as a URL (plain absolute path for local stores).
        commit_primitive (str): one line naming how the manifest is made create-only.
        write_slice_bytes (int): the largest single ``write()`` a payload writer hands this
            backend's file object (zero-copy slices of larger buffers).
    """

    commit_primitive = "none"
    atomic_create = False
    # fsspec's buffered files copy each whole write() into their part buffer before uploading: one
    # 1 GiB tensor would cost ~3 GiB of RSS. 8 MiB slices keep it to one part.
    write_slice_bytes = 8 << 20

    def __init__(self, fs, root: str, url_root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        stripped = url_root.rstrip("/")
        # A store at a filesystem's root ("memory:///") keeps its slashes: "memory:" is no URL.
        self.url_root = stripped if stripped and not stripped.endswith(":") else url_root

    # -- names -------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """Filesystem path of ``rel`` (relative to the root)."""
        if not rel:
            return self.root
        return self.root + rel if self.root.endswith("/") else f"{self.root}/{rel}"

    def url(self, rel: str = "") -> str:
        """URL of ``rel``, spelled like :attr:`url_root`."""
        if not rel:
            return self.url_root
        return self.url_root + rel if self.url_root.endswith("/") else f"{self.url_root}/{rel}"

    def _rel(self, full: str, base: str) -> str:
        full = self.fs._strip_protocol(full).rstrip("/")
        base = base.rstrip("/")
        if full == base:
            return ""
        prefix = base + "/" if not base.endswith("/") else base
        if not full.startswith(prefix):
            raise ValueError(f"listing returned {full!r} outside {base!r}")
        return full[len(prefix):]

    def refresh(self) -> None:
        """Drop every listing and size cached by the filesystem instance."""
        self.fs.invalidate_cache()

    # -- reads (always fresh) -------------------------------------------------------------
    def list_children(self, rel: str = "") -> tuple[list[str], dict[str, int]]:
        """Immediate children of ``rel``: (sub-prefix names, {file name: size_bytes}).

        One delimiter listing (paginated by the backend). A missing prefix lists as empty.
        """
        self.refresh()
        base = self.path(rel)
        try:
            entries = self._list_dir(base)
        except FileNotFoundError:
            return [], {}
        dirs: list[str] = []
        files: dict[str, int] = {}
        for entry in entries:
            name = self._rel(entry["name"], base)
            if not name or "/" in name:
                continue
            if entry.get("type") == "directory":
                dirs.append(name)
            else:
                files[name] = int(entry.get("size") or 0)
        return dirs, files

    def _list_dir(self, base: str) -> list[dict]:
        """One fresh delimiter listing of the filesystem path ``base`` (fsspec ``ls`` entries).

        Raises:
            FileNotFoundError: ``base`` (or its bucket) does not exist.
        """
        return self.fs.ls(base, detail=True, refresh=True)

    def list_tree(self, rel: str = "") -> dict[str, int]:
        """Every object below ``rel``, recursively: {path relative to ``rel``: size_bytes}.

        One flat listing (no per-object request). A missing prefix lists as empty.
        """
        self.refresh()
        base = self.path(rel)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, int] = {}
        for full, info in found.items():
            if info.get("type") == "directory":
                continue
            name = self._rel(full, base)
            if name:
                out[name] = int(info.get("size") or 0)
        return out

    def size(self, rel: str) -> int | None:
        """Size in bytes of the object ``rel``, or ``None`` when it does not exist (or is a prefix)."""
        self.refresh()
        try:
            info = self.fs.info(self.path(rel))
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    def read_bytes(self, rel: str, *, small: bool = False, max_bytes: int | None = None) -> bytes:
        """The whole object ``rel``, or its first ``max_bytes + 1`` bytes.

        Args:
            rel (str): object path relative to the root.
            small (bool): the object is known to be small (a manifest): backends that would first
                ask for its size to plan a parallel download skip that request.
            max_bytes (int | None): fetch at most ``max_bytes + 1`` bytes (one ranged request), so
                a caller with a size limit sees that the object is over it without fetching it all.

        Raises:
            FileNotFoundError: no such object.
        """
        self.refresh()
        if max_bytes is not None:
            return self.fs.cat_file(self.path(rel), start=0, end=max_bytes + 1)
        return self.fs.cat_file(self.path(rel))

    def check_reachable(self) -> None:
        """Fail fast when the store cannot be used: missing bucket, credentials or connection.

        Raises:
            StoreUnreachableError: naming the store URL and the backend's cause.
        """
        from ..errors import StoreUnreachableError

        self.refresh()
        bucket = self.root.split("/", 1)[0] if self.bucketed else None
        missing_bucket = f"{self.url_root}: bucket {bucket!r} does not exist"
        try:
            if bucket is not None and self.probe_bucket:
                try:
                    self.fs.info(bucket)
                except FileNotFoundError as exc:
                    raise StoreUnreachableError(missing_bucket) from exc
            try:
                self._list_dir(self.root)
            except FileNotFoundError as exc:
                if bucket is not None and not self.probe_bucket:
                    # The listing is the probe: it raises only when the bucket is missing.
                    raise StoreUnreachableError(missing_bucket) from exc
                # else: an empty store; the first save creates it
        except StoreUnreachableError:
            raise
        except Exception as exc:  # noqa: BLE001 - every backend failure is reported the same way
            cause = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
            raise StoreUnreachableError(f"{self.url_root}: cannot reach the store ({cause})") from exc

    bucketed = False
    # Ask for the bucket itself before listing the root (False: the root listing tells).
    probe_bucket = True

    def open_checked(self, rel: str) -> tuple[BinaryIO, int, str]:
        """A seekable reader of the whole object ``rel`` with its measured size and CRC32C.

        The default fetches the object whole (one request where the backend allows) and serves it
        from memory; the CRC is computed over exactly the bytes the reader returns.

        Returns:
            tuple[BinaryIO, int, str]: (reader positioned at 0, size_bytes, crc32c as 8 hex digits).

        Raises:
            FileNotFoundError: no such object.
        """
        import io

        from ..checksum import crc32c_hex

        data = self.read_bytes(rel)
        return io.BytesIO(data), len(data), crc32c_hex(data)

    def open_read(self, rel: str) -> BinaryIO:
        """A streaming binary reader of the object ``rel`` (for copies: nothing is held whole).

        Raises:
            FileNotFoundError: no such object.
        """
        self.refresh()
        return self.fs.open(self.path(rel), "rb")

    def list_uploads(self) -> list[tuple[str, str, float]]:
        """Unfinished multipart uploads under the root: ``(rel, upload_id, initiated_secs)``.

        Only object stores with multipart uploads have any (S3); the default has none.
        """
        return []

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Abort one unfinished multipart upload from :meth:`list_uploads`."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    # -- writes ------------------------------------------------------------------------------
    def open_write(self, rel: str) -> BinaryIO:
        """A new binary writer for the object ``rel``; the object appears at ``close()``.

        Callers abort with :meth:`abort_write` instead of closing when anything went wrong.
        """
        return self.fs.open(self.path(rel), "wb")

    def abort_write(self, handle: BinaryIO, rel: str) -> None:
        """Throw away a writer from :meth:`open_write` without publishing it (best effort)."""
        discard = getattr(handle, "discard", None)
        try:
            if discard is not None:
                discard()
                # fsspec buffered files upload on close() and close themselves at garbage
                # collection; a discarded writer must never publish its partial bytes.
                handle.closed = True
            else:
                handle.close()
                self.delete(rel)
        except Exception:  # noqa: BLE001 - cleanup of an already failing save
            logger.warning("could not discard partial object %s", self.url(rel), exc_info=True)

    def finish_write(self, handle: BinaryIO, rel: str) -> None:
        """Publish a writer from :meth:`open_write` (durably, where the backend needs a flush)."""
        handle.close()

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create the small object ``rel`` holding ``data`` only if it does not exist.

        Raises:
            FileExistsError: the object exists (the create lost).
            UnsupportedBackendError: the backend has no create-only write.
            OSError: any other failure; the create may or may not have landed.
        """
        raise NotImplementedError

    def sync_prefix(self, rel: str) -> None:
        """Make the names of objects written under ``rel`` durable (local: fsync the directories)."""

    def delete(self, rel: str) -> None:
        """Delete the object ``rel``; a missing object is not an error."""
        try:
            self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass
        finally:
            self.refresh()

    def delete_tree(self, rel: str) -> None:
        """Delete every object below ``rel``; a missing prefix is not an error."""
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass
        finally:
            self.refresh()

    def describe(self) -> str:
        return f"{type(self).__name__}({self.url_root})"

    __repr__ = describe


def join(*parts: str) -> str:
    """Join relative key parts with ``/`` (never ``os.path.join``: keys are not local paths)."""
    return posixpath.join(*[p for p in parts if p])


__all__ = ["Storage", "join"]
