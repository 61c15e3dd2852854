"""A proxy that holds picked requests: :class:`HoldProxy` (the recording proxy of
:mod:`opd_testkit.proxies`, with requests held until a test releases or drops them), so a
process can be killed with an upload provably unfinished, or ranges counted while they are in
flight."""

from __future__ import annotations

import threading
from typing import Callable

from .proxies import Request, S3Proxy


class HoldProxy(S3Proxy):
    """Holds each request for which ``hold(method, path)`` is true (``path`` with its query) until
    :meth:`release` (then forwards it) or :meth:`drop` (then closes its connection: it never reaches
    the server, as if the client died first); every other request is forwarded.

    Attributes:
        held (list[str]): ``"METHOD path"`` of each request held so far.
    """

    def __init__(self, upstream: str, hold: Callable[[str, str], bool]) -> None:
        self.hold = hold
        self.held: list[str] = []
        self._held_changed = threading.Condition()
        self._released = threading.Event()
        self._dropping = False
        super().__init__(upstream)

    def _decide(self, record: Request) -> tuple | None:
        path = record.path + (f"?{record.query}" if record.query else "")
        if not self.hold(record.method, path):
            return None
        with self._held_changed:
            self.held.append(f"{record.method} {path}")
            self._held_changed.notify_all()
        self._released.wait()
        return ("drop",) if self._dropping else None

    def wait_held(self, count: int, timeout_secs: float = 60.0) -> list[str]:
        """Block until at least ``count`` requests are held; the held ones.

        Raises:
            TimeoutError: fewer were held after ``timeout_secs``.
        """
        with self._held_changed:
            if not self._held_changed.wait_for(lambda: len(self.held) >= count, timeout_secs):
                raise TimeoutError(f"{len(self.held)} requests held after {timeout_secs} s, expected {count}: {self.held}")
            return list(self.held)

    def release(self) -> None:
        self._released.set()

    def drop(self) -> None:
        self._dropping = True
        self._released.set()

    def stop(self) -> None:
        self.drop()
        super().stop()


__all__ = ["HoldProxy"]
