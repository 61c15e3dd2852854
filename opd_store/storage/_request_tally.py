"""Requests a store sent, by kind: what the run journal records per save and the cost report prices.

Every :class:`~opd_store.storage._base.Storage` holds one :class:`RequestTally` (``storage.requests``).
S3 and GCS count at their client, one count per API request it sends (every page of a listing,
every part, every ranged GET; :func:`count_calls` wraps s3fs's ``_call_s3`` and gcsfs's
``_request``, the funnels every request of theirs and of opd_store's goes through, and the GCS
ranged reads count their own). On the other backends (local, memory) nothing is sent: each
outermost verb call counts as the one request it would be (:mod:`opd_store.storage._fsspec`). The
kinds follow the object stores' price classes:

========  ====================================================  =====================================
kind      requests                                               S3 / GCS price class
========  ====================================================  =====================================
list      listings (one per page)                                PUT/COPY/POST/LIST / class A
head      an object's metadata or size                           GET and others / class B
get       an object's bytes (one per range)                      GET and others / class B
put       an object or one part of it                            PUT/COPY/POST/LIST / class A
post      a multipart upload started or assembled (GCS compose)  PUT/COPY/POST/LIST / class A
delete    an object or a prefix deleted, an upload aborted       free on both
========  ====================================================  =====================================

A client's own retries of one request count once (botocore's inside ``_call_s3``, and so do the
retries of gcsfs's ``_request``: docs/ledger.md).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

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


def count_calls(client: Any, attribute: str, kind_of: Callable[..., str], tally: RequestTally) -> None:
    """Count every call of the coroutine method ``client.<attribute>`` in ``tally``, under the kind
    ``kind_of(*args, **kwargs)`` names (a wrapper set on the instance: the client's own calls of
    ``self.<attribute>`` go through it too)."""
    method = getattr(client, attribute)

    @functools.wraps(method)
    async def counted(*args: Any, **kwargs: Any) -> Any:
        tally.add(kind_of(*args, **kwargs))
        return await method(*args, **kwargs)

    setattr(client, attribute, counted)


def difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Requests counted between two snapshots, by kind (kinds with none left out)."""
    return {kind: after.get(kind, 0) - before.get(kind, 0) for kind in KINDS if after.get(kind, 0) != before.get(kind, 0)}


__all__ = ["KINDS", "RequestTally", "count_calls", "difference"]
