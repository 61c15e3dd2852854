"""``torch.distributed.checkpoint`` (DCP) on opd_store: sharded state committed by one manifest.

* :class:`StoreWriter` / :class:`StoreReader`: DCP's storage seam over any store (local, memory,
  S3, GCS, tiered). ``dcp.save``, ``dcp.load`` and ``dcp.async_save`` run unchanged (planners,
  deduplication, resharding, staging); every rank writes its files under the save's one attempt
  and the coordinator commits the manifest (:mod:`opd_store.dcp._writer`); a load checks every
  byte it reads before any tensor changes (:mod:`opd_store.dcp._reader`).
* :func:`save`, :func:`load`, :func:`async_save`: the same with the committed URL returned and
  DCP's ``CheckpointException`` turned into opd_store's typed errors (:mod:`opd_store.dcp._api`).
* :func:`adopt_dcp_checkpoint`: commit a checkpoint DCP's own ``FileSystemWriter`` or
  ``FsspecWriter`` wrote (no manifest) after verifying it (:mod:`opd_store.dcp._adopt`).

Layout of a committed DCP step (docs/sharded.md)::

    step-000042/manifest.json
    step-000042/attempt-<utc>-<hex>/.metadata          DCP's metadata
    step-000042/attempt-<utc>-<hex>/__0_0.distcp       rank 0's chunks of sharded tensors
    step-000042/attempt-<utc>-<hex>/__1_1.distcp       rank 1's whole tensors and objects
    ...                                                (and any extra payloads: config.yaml, ...)
"""

from ._adopt import adopt_dcp_checkpoint
from ._api import async_save, load, save
from ._metadata_io import writer_rank
from ._reader import StoreReader
from ._writer import StoreWriter

__all__ = ["StoreReader", "StoreWriter", "adopt_dcp_checkpoint", "async_save", "load", "save", "writer_rank"]
