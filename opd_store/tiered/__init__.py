"""A local tier in front of a bucket: saves commit to local disk and upload in the background
(docs/tiered.md)."""

from ._store import TieredStore

__all__ = ["TieredStore"]
