"""``StoreAddress``: what rebuilds a store in another process (DCP's process-based ``async_save``).

A store's clients do not pickle; its URL, storage options and storage class choice do. Refused
(``TypeError``), since a copy elsewhere would not be the same store: ``memory://`` (one per
process), a ``TieredStore`` (its uploads run here), and a store over a storage its URL does not
rebuild (``from_storage`` over a wrapper).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..storage import CheckThenPutStorage, MemoryStorage, open_storage
from ..store import BaseStore, CheckpointStore, split_checkpoint_url


@dataclasses.dataclass(frozen=True)
class StoreAddress:
    """A store's URL and options: enough to open the same store in another process.

    Attributes:
        url (str): the store root.
        storage_options (dict): fsspec and opd_store options (must pickle: an aiobotocore session
            object does not).
        allow_check_then_put (bool): the store commits with check-then-put (a backend without a
            create-only write, opened with ``allow_check_then_put=True``).
    """

    url: str
    storage_options: dict[str, Any]
    allow_check_then_put: bool = False

    @classmethod
    def of(cls, store: BaseStore) -> "StoreAddress":
        """The address of ``store``.

        Raises:
            TypeError: a store another process cannot open as the same store, naming it.
        """
        if not isinstance(store, CheckpointStore):
            raise TypeError(f"{store!r} cannot be sent to another process: only a plain CheckpointStore is "
                            "rebuilt from its URL (a TieredStore's uploads run in the process that opened it)")
        if isinstance(store.storage, MemoryStorage):
            raise TypeError(f"{store!r} cannot be sent to another process: memory:// is one store per process, "
                            "so the other process would commit into its own memory")
        allow = isinstance(store.storage, CheckThenPutStorage)
        options = dict(store.storage_options)
        rebuilt = open_storage(store.url, options, allow_check_then_put=allow)  # no I/O
        if type(rebuilt) is not type(store.storage):
            raise TypeError(f"{store!r} cannot be sent to another process: it is built over a "
                            f"{type(store.storage).__name__}, and its URL opens a {type(rebuilt).__name__}")
        return cls(store.url, options, allow)

    def open(self) -> CheckpointStore:
        """A new store at this address (its clients are built on first use)."""
        return CheckpointStore(self.url, storage_options=self.storage_options,
                               allow_check_then_put=self.allow_check_then_put)


def is_step_url(checkpoint_id: Any) -> bool:
    """True for a store's step URL (what ``validate_checkpoint_id`` of the writer and reader
    answer); DCP (through 2.13) never asks them for a bare ``checkpoint_id``."""
    try:
        split_checkpoint_url(checkpoint_id)
    except (TypeError, ValueError):  # not a step URL, or a scheme no store opens
        return False
    return True


__all__ = ["is_step_url", "StoreAddress"]
