"""Requests a store sent, by kind: what the run journal records per save and the cost report prices.

Every :class:`~opd_store.storage._base.Storage` holds one :class:`RequestTally` (``storage.requests``).
The verbs count themselves (:mod:`opd_store.storage._fsspec` counts each outermost verb call once,
so a verb built on another is one request), and a parallel part writer counts the requests it
sends (:class:`~opd_store.storage.transfers._part_writer.PartWriter`: a single-request object is
one ``put``; a multipart object one ``post`` to start, one ``put`` per part and one ``post`` to
assemble). The kinds follow the object stores' price classes:

========  ====================================================  =====================================
kind      requests                                               S3 / GCS price class
========  ====================================================  =====================================
list      listings (one per page the client asked for: counted   PUT/COPY/POST/LIST / class A
          once per verb)
head      an object's size or the store's clock                  GET and others / class B
get       an object's bytes (a parallel ranged read counts once) GET and others / class B
put       an object or one part of it                            PUT/COPY/POST/LIST / class A
post      a multipart upload started or assembled (GCS compose)  PUT/COPY/POST/LIST / class A
delete    an object or a prefix deleted, an upload aborted       free on both
========  ====================================================  =====================================

What is counted is what opd_store asks for, not what crossed the wire: a client's own retries of
one request are one request here (a failed S3 request is not billed; docs/ledger.md).
"""

from __future__ import annotations

import threading

KINDS = ("list", "head", "get", "put", "post", "delete")


class RequestTally:
    """A thread-safe count of requests by kind (module docstring); kinds outside :data:`KINDS` are refused.

    Raises:
        ValueError: (``add``) an unknown kind.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(KINDS, 0)
        self._depth = threading.local()

    def add(self, kind: str, count: int = 1) -> None:
        """Count ``count`` requests of ``kind``."""
        if kind not in self._counts:
            raise ValueError(f"unknown request kind {kind!r}; one of {list(KINDS)}")
        with self._lock:
            self._counts[kind] += count

    def snapshot(self) -> dict[str, int]:
        """The counts so far, every kind present (zeros included)."""
        with self._lock:
            return dict(self._counts)

    def enter_verb(self) -> bool:
        """Mark a verb call on this thread; True for the outermost one (the one to count)."""
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        return depth == 0

    def exit_verb(self) -> None:
        """Unmark the verb call of :meth:`enter_verb`."""
        self._depth.value -= 1


def difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Requests counted between two snapshots, by kind (kinds with none left out)."""
    return {kind: after.get(kind, 0) - before.get(kind, 0) for kind in KINDS if after.get(kind, 0) != before.get(kind, 0)}


__all__ = ["KINDS", "RequestTally", "difference"]
