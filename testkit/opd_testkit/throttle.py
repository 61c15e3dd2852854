"""A TCP proxy on loopback that caps every connection's bandwidth: the model of a real object store.

Real object stores give each connection a bounded share of bandwidth (AWS S3: roughly 50-100 MB/s
per connection) and reach the network's speed only with many connections at once. A server on
loopback has no such limit, so one connection looks as fast as many. :class:`CappedProxy` puts the
limit back: it forwards bytes between each client connection and the server unchanged (any
protocol: it never parses HTTP) and paces each direction of each connection to at most
``cap_bytes_per_sec`` with a token bucket (bursts of at most :data:`BURST_BYTES`, so an idle
keep-alive connection does not save up a fast start). Connections are independent: ``n`` of them
move up to ``n x cap`` together.

* :class:`CappedProxy`: the proxy in threads of this process (tests).
* :class:`CappedProxyProcess`: the proxy in a process of its own (``python -m
  opd_testkit.throttle``), so that a benchmark's client and the proxy do not share a GIL.

Both listen on 127.0.0.1 on a port the OS chooses and count connections, bytes each way and the
largest number of connections open at once.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

from .control import ControlledProcess

DEFAULT_CAP_BYTES_PER_SEC = 64 << 20
CHUNK_BYTES = 256 << 10
BURST_BYTES = 256 << 10


class _Bucket:
    """A token bucket: :meth:`take` blocks until ``n`` bytes fit ``rate`` (burst :data:`BURST_BYTES`)."""

    def __init__(self, rate: float, burst_bytes: int = BURST_BYTES) -> None:
        self.rate = rate
        self.burst = float(burst_bytes)
        self.tokens = self.burst
        self.last = time.monotonic()

    def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= n
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)  # pacing the stream, not synchronising threads


class CappedProxy:
    """Forward every connection to ``upstream``, each direction capped at ``cap_bytes_per_sec``.

    Args:
        upstream (str): the server, ``http://127.0.0.1:PORT`` or ``127.0.0.1:PORT``.
        cap_bytes_per_sec (float | None): the cap per connection and direction; ``None``: no cap.
        burst_bytes (int): the most a connection moves at once above the cap (:data:`BURST_BYTES`;
            a small one makes a small save take its bytes' time: the ledger's notice tests).
        uploads_only (bool): cap only what clients send (saves slow, loads at full speed).

    Attributes:
        endpoint_url (str): ``http://127.0.0.1:<port>``, where clients connect.
        port (int): the listening port.
    """

    def __init__(self, upstream: str, cap_bytes_per_sec: float | None = DEFAULT_CAP_BYTES_PER_SEC,
                 burst_bytes: int = BURST_BYTES, uploads_only: bool = False) -> None:
        self.burst_bytes = burst_bytes
        self.uploads_only = uploads_only
        split = urlsplit(upstream if "//" in upstream else f"//{upstream}")
        self.upstream = (split.hostname or "127.0.0.1", split.port)
        self.cap_bytes_per_sec = cap_bytes_per_sec
        self._lock = threading.Lock()
        self._open = 0
        self._stats = {"connections": 0, "peak_open": 0, "bytes_up": 0, "bytes_down": 0}
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._closing = False
        self._thread = threading.Thread(target=self._accept_loop, name="capped-proxy", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, int]:
        """``connections`` accepted, ``peak_open`` (most open at once), ``bytes_up`` (client to
        server) and ``bytes_down``, since the last :meth:`reset_stats`."""
        with self._lock:
            return dict(self._stats)

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {"connections": 0, "peak_open": self._open, "bytes_up": 0, "bytes_down": 0}

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name="capped-proxy-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._open += 1
            self._stats["connections"] += 1
            self._stats["peak_open"] = max(self._stats["peak_open"], self._open)
        down = threading.Thread(target=self._pump, args=(server, client, "bytes_down"), daemon=True)
        down.start()
        self._pump(client, server, "bytes_up")
        down.join()
        for sock in (client, server):
            sock.close()
        with self._lock:
            self._open -= 1

    def _pump(self, src: socket.socket, dst: socket.socket, counter: str) -> None:
        capped = self.cap_bytes_per_sec and not (self.uploads_only and counter == "bytes_down")
        bucket = _Bucket(self.cap_bytes_per_sec, self.burst_bytes) if capped else None
        buffer = bytearray(CHUNK_BYTES)
        view = memoryview(buffer)
        try:
            while True:
                count = src.recv_into(buffer, CHUNK_BYTES)
                if count == 0:
                    break
                if bucket is not None:
                    bucket.take(count)
                dst.sendall(view[:count])
                with self._lock:
                    self._stats[counter] += count
        except OSError:
            pass
        finally:
            for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                try:
                    sock.shutdown(how)
                except OSError:
                    pass

    def stop(self) -> None:
        self._closing = True
        self._listener.close()


class CappedProxyProcess:
    """:class:`CappedProxy` in a process of its own (same arguments and attributes).

    :meth:`stats` and :meth:`reset_stats` talk to it over its stdin/stdout.
    """

    def __init__(self, upstream: str, cap_bytes_per_sec: float | None = DEFAULT_CAP_BYTES_PER_SEC) -> None:
        self.cap_bytes_per_sec = cap_bytes_per_sec
        args = [sys.executable, "-m", "opd_testkit.throttle", upstream]
        if cap_bytes_per_sec:
            args += ["--cap", str(int(cap_bytes_per_sec))]
        self._control = ControlledProcess(args, "capped proxy")
        self.process, self.port = self._control.process, self._control.port
        self.endpoint_url, self.pid = self._control.endpoint_url, self._control.pid

    def _ask(self, command: str) -> str:
        return self._control.ask(command)

    def stats(self) -> dict[str, int]:
        return json.loads(self._ask("stats"))

    def reset_stats(self) -> None:
        self._ask("reset")

    def stop(self) -> None:
        self._control.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m opd_testkit.throttle UPSTREAM [--cap BYTES_PER_SEC]``: serve until stdin
    closes; prints ``PORT <n>``, then answers ``stats`` (one JSON line) and ``reset``."""
    parser = argparse.ArgumentParser(prog="python -m opd_testkit.throttle")
    parser.add_argument("upstream")
    parser.add_argument("--cap", type=float, default=None, help="bytes per second per connection and direction")
    args = parser.parse_args(argv)
    proxy = CappedProxy(args.upstream, args.cap)
    print(f"PORT {proxy.port}", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "stats":
            print(json.dumps(proxy.stats()), flush=True)
        elif command == "reset":
            proxy.reset_stats()
            print("ok", flush=True)
    proxy.stop()
    os._exit(0)


__all__ = ["BURST_BYTES", "CHUNK_BYTES", "DEFAULT_CAP_BYTES_PER_SEC", "CappedProxy", "CappedProxyProcess"]

if __name__ == "__main__":
    main()
