"""``torch.distributed.checkpoint`` (DCP) on opd_store: sharded state committed by one manifest.

:class:`StoreWriter` / :class:`StoreReader` are DCP's storage seam over any store (``dcp.save``,
``dcp.load``, ``dcp.async_save`` run unchanged); :func:`save`, :func:`load`, :func:`async_save`
add the committed URL and opd_store's typed errors; :func:`adopt_dcp_checkpoint` commits a
directory DCP's own writers wrote. Layout and guarantees: docs/sharded.md.
"""

from ._adopt import adopt_dcp_checkpoint
from ._api import async_save, load, save
from ._metadata_io import writer_rank
from ._reader import StoreReader
from ._writer import StoreWriter

__all__ = ["StoreReader", "StoreWriter", "adopt_dcp_checkpoint", "async_save", "load", "save", "writer_rank"]
