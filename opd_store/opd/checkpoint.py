"""The OPD layer's checkpoint functions in one import: save, load, adapter, discovery.

Each lives in its own module, along the seams of an OPD checkpoint:

========================  ===================================================================
:mod:`.names`             the payload layout, checkpoint references, the checks loads share
:mod:`.snapshot`          the snapshot stage of a save (the seed's rules; RNG captured first)
:mod:`.save`              :func:`save_opd_checkpoint` and the payload writes, on the pipeline
:mod:`.load`              :func:`load_opd_checkpoint`, :func:`latest_complete_checkpoint`
:mod:`.adapter`           :func:`load_adapter` (LoRA weights in place, and the processor)
:mod:`.sharded`           :func:`save_sharded_opd_checkpoint` (a sharded student, through DCP)
:mod:`.sharded_load`      :func:`load_sharded_opd_checkpoint` (resharded; elastic resume)
:mod:`.elastic`           the elastic-resume policy (RNG of new ranks, unclaimed states)
========================  ===================================================================
"""

from __future__ import annotations

from .adapter import load_adapter
from .load import latest_complete_checkpoint, load_opd_checkpoint
from .names import SCHEMA_V1, SCHEMA_V2, SCHEMAS, resolve_checkpoint, rng_payload_name
from .save import save_opd_checkpoint, write_opd_checkpoint
from .sharded import save_sharded_opd_checkpoint
from .sharded_load import ShardedResume, load_sharded_opd_checkpoint
from .snapshot import OpdSnapshot, snapshot_opd_checkpoint

__all__ = [
    "SCHEMAS",
    "SCHEMA_V1",
    "SCHEMA_V2",
    "OpdSnapshot",
    "ShardedResume",
    "latest_complete_checkpoint",
    "load_adapter",
    "load_opd_checkpoint",
    "load_sharded_opd_checkpoint",
    "resolve_checkpoint",
    "rng_payload_name",
    "save_opd_checkpoint",
    "save_sharded_opd_checkpoint",
    "snapshot_opd_checkpoint",
    "write_opd_checkpoint",
]
