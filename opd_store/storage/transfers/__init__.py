"""Parallel transfers shared by the bucket backends: a store's settings and reused part buffers
(:mod:`._parts`: :class:`Transfers`), the pacing of its uploads under throttling (:mod:`._pacing`),
the part writer (:mod:`._part_writer`), request bodies (:mod:`._upload_bodies`), ranged reads
into one buffer (:mod:`._ranged_reads`) and the streaming reader of copies (:mod:`._range_stream`)."""

from ._pacing import Pacer, PacerStats, paced
from ._part_writer import PartWriter, named_error
from ._parts import Completion, MemoryReader, PartPool, Transfers, TransferSettings
from ._range_stream import RangeStream, range_fetcher
from ._ranged_reads import OtherSize, read_checked
from ._upload_bodies import PartBody

__all__ = ["Completion", "MemoryReader", "OtherSize", "Pacer", "PacerStats", "PartBody", "PartPool", "PartWriter",
           "RangeStream", "TransferSettings", "Transfers", "named_error", "paced", "range_fetcher", "read_checked"]
