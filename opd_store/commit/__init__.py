"""The commit protocol: a save attempt's payloads streamed under a prefix of their own
(:mod:`._attempt`, :mod:`._payload_writer`), then one manifest created only if absent
(:mod:`._transaction`); a rank's part of a multi-rank save (:mod:`._part_transaction`).
See docs/protocol.md."""

from ._part_transaction import PartTransaction
from ._payload_writer import PayloadWriter
from ._transaction import Transaction

__all__ = ["PartTransaction", "PayloadWriter", "Transaction"]
