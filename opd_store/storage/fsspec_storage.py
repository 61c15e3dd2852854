"""The storage verbs over one fsspec filesystem (every backend of :mod:`opd_store.storage.backends`).

Every verb that can decide a checkpoint's state (list, size, read) sees the backend as it is now:
s3fs and gcsfs cache listings and object sizes per instance (field notes: a stale cached size made
s3fs return a truncated body without error), so each such verb drops the instance's caches first.
Stores get a private filesystem instance (``skip_instance_cache=True``), so dropping its caches
costs other code nothing. A missing object or prefix is recognised through the one table of
backend failures (:mod:`opd_store.storage.backend_errors`).
"""

from __future__ import annotations

from typing import BinaryIO

from .backend_errors import describe, is_missing
from .base import Storage


class FsspecStorage(Storage):
    """The listing, reading, writing and deleting verbs of :class:`Storage` over ``self.fs``.

    A concrete backend adds the create-only write (:meth:`Storage.create_exclusive`) and says
    whether it has multipart uploads (:class:`~opd_store.storage.base.NoMultipartUploads`).
    """

    def _rel(self, full: str, base: str) -> str:
        full = self.fs._strip_protocol(full).rstrip("/")  # noqa: SLF001 - fsspec's documented path normaliser
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

    # -- reads ---------------------------------------------------------------------------------
    def list_children(self, rel: str = "") -> tuple[list[str], dict[str, int]]:
        self.refresh()
        base = self.path(rel)
        try:
            entries = self._list_dir(base)
        except Exception as exc:  # noqa: BLE001 - a missing prefix lists as empty
            if is_missing(exc):
                return [], {}
            raise
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
        self.refresh()
        base = self.path(rel)
        try:
            found = self.fs.find(base, detail=True)
        except Exception as exc:  # noqa: BLE001 - a missing prefix lists as empty
            if is_missing(exc):
                return {}
            raise
        out: dict[str, int] = {}
        for full, info in found.items():
            if info.get("type") == "directory":
                continue
            name = self._rel(full, base)
            if name:
                out[name] = int(info.get("size") or 0)
        return out

    def size(self, rel: str) -> int | None:
        self.refresh()
        try:
            info = self.fs.info(self.path(rel))
        except Exception as exc:  # noqa: BLE001 - a missing object has no size
            if is_missing(exc):
                return None
            raise
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    def read_bytes(self, rel: str, *, small: bool = False, max_bytes: int | None = None) -> bytes:
        self.refresh()
        if max_bytes is not None:
            return self.fs.cat_file(self.path(rel), start=0, end=max_bytes + 1)
        return self.fs.cat_file(self.path(rel))

    def open_read(self, rel: str) -> BinaryIO:
        """A streaming binary reader of the object ``rel`` (nothing is held whole).

        Raises:
            FileNotFoundError: no such object.
        """
        self.refresh()
        return self.fs.open(self.path(rel), "rb")

    # -- writes --------------------------------------------------------------------------------
    def open_write(self, rel: str) -> BinaryIO:
        return self.fs.open(self.path(rel), "wb")

    def delete(self, rel: str) -> None:
        try:
            self.fs.rm_file(self.path(rel))
        except Exception as exc:  # noqa: BLE001 - a missing object is not an error
            if not is_missing(exc):
                raise
        finally:
            self.refresh()

    def delete_tree(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except Exception as exc:  # noqa: BLE001 - a missing prefix is not an error
            if not is_missing(exc):
                raise
        finally:
            self.refresh()

    # -- reachability --------------------------------------------------------------------------
    def check_reachable(self) -> None:
        """Fail fast when the store cannot be used: missing bucket, credentials or connection.

        Bucketed backends ask for the bucket first (``probe_bucket``) or let the root listing
        tell a missing bucket from an empty store; a missing root of a store is fine (the first
        save creates it).

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
                except Exception as exc:  # noqa: BLE001 - classified below
                    if is_missing(exc):
                        raise StoreUnreachableError(missing_bucket) from exc
                    raise
            try:
                self._list_dir(self.root)
            except Exception as exc:  # noqa: BLE001 - classified below
                if not is_missing(exc):
                    raise
                if bucket is not None and not self.probe_bucket:
                    # The listing is the probe: it raises only when the bucket is missing.
                    raise StoreUnreachableError(missing_bucket) from exc
                # else: an empty store; the first save creates it
        except StoreUnreachableError:
            raise
        except Exception as exc:  # noqa: BLE001 - every backend failure is reported the same way
            raise StoreUnreachableError(f"{self.url_root}: cannot reach the store ({describe(exc)})") from exc


__all__ = ["FsspecStorage"]
