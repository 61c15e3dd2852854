"""What a checkpoint is on the wire, with no I/O of its own: object names (:mod:`._names`), where
a save's objects go (:mod:`._layout`: the key layout the manifest records), the manifest schema and its parser (:mod:`._manifest`), streaming CRC32C (:mod:`._checksum`) and torch
(de)serialisation of payloads (:mod:`._torch_io`, imported on first use: it imports torch)."""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ._checksum import Crc32c, crc32c_base64, crc32c_hex
from ._layout import (
    DEFAULT_SPREAD_PREFIXES,
    SPREAD_DIR,
    KeyLayout,
    key_in_step,
    object_rel,
    split_key_in_step,
    split_step_rel,
    step_rel,
)
from ._manifest import MAX_MANIFEST_BYTES, Manifest, PayloadEntry, Writer, manifest_json_schema, parse_manifest
from ._names import (
    JOURNAL_PREFIX,
    MANIFEST_NAME,
    attempt_created_secs,
    check_attempt_id,
    check_payload_name,
    is_attempt_id,
    new_attempt_id,
    parse_step_dirname,
    probe_name,
    step_dirname,
)

if TYPE_CHECKING:
    from ._torch_io import torch_load, torch_save, weights_only_load

__getattr__ = lazy_exports(__name__, {name: "._torch_io" for name in ("torch_load", "torch_save", "weights_only_load")})

__all__ = [
    "DEFAULT_SPREAD_PREFIXES", "JOURNAL_PREFIX", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "SPREAD_DIR", "Crc32c",
    "KeyLayout", "Manifest", "PayloadEntry", "Writer", "key_in_step", "object_rel", "split_key_in_step",
    "split_step_rel", "step_rel",
    "attempt_created_secs", "check_attempt_id", "check_payload_name", "crc32c_base64", "crc32c_hex", "is_attempt_id",
    "manifest_json_schema", "new_attempt_id", "parse_manifest", "parse_step_dirname", "probe_name", "step_dirname",
    "torch_load", "torch_save", "weights_only_load",
]
