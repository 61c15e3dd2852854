"""``StoreAddress``: what rebuilds a store in another process (DCP's process-based ``async_save``).

``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` pickles the storage
writer and sends it to a background process started with ``spawn``. A store's clients (an s3fs or
gcsfs instance, its event loop and connections, the closure that builds them lazily) live in one
process and do not pickle; what does is the store's address: its URL, its storage options and the
choice of storage class those imply (a check-then-put commit when the store was opened with
``allow_check_then_put``). The other process opens a store of its own from it, with its own clients.

Refused (``TypeError`` naming the store), because a copy in another process would not be the same
store: ``memory://`` (fsspec's memory filesystem is one per process: the save would commit into the
background process's memory), a :class:`~opd_store.tiered.TieredStore` (its uploads run in this
process), and a store built over a storage its URL does not rebuild
(``CheckpointStore.from_storage`` over a wrapper, such as ``FaultyStorage`` in tests).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..storage import CheckThenPutStorage, MemoryStorage, open_storage
from ..store import BaseStore, CheckpointStore


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
            TypeError: a store another process cannot open as the same store (see the module
                docstring), naming the store.
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


__all__ = ["StoreAddress"]
