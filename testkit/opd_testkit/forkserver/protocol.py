"""The fork server's wire protocol, both ends, and its smallest client: the ``opd-store`` shim command.

One Unix-socket connection per child: the client sends an 8-byte big-endian length with the
child's three descriptors (stdin, stdout, stderr, passed with ``SCM_RIGHTS``), then that many bytes
of JSON (``argv``, ``env``, ``cwd``); the server answers ``{"pid": N}`` and, once the child has been
reaped, ``{"status": S}`` (one JSON line each; ``S`` as :attr:`subprocess.Popen.returncode` reports
it: negative for a signal). A connection that closes before the child ends means its client is
gone: the server kills the child.

The shim command (:func:`shim_command`) runs this file by path (``python protocol.py --client
SOCKET ARGS...``), not as ``python -m``, so that it pays no import of the ``opd_store`` package: this
module imports the standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from typing import Any

HEADER = struct.Struct(">Q")
"""The request's length in bytes, sent with the three descriptors."""


def program_of(argv: list[str]) -> tuple[str, str, list[str]]:
    """``(kind, target, sys.argv)`` of a ``python`` command line: kind ``module``, ``path`` or ``code``.

    Raises:
        ValueError: not ``[python, "-m", MODULE, ...]``, ``[python, "-c", CODE, ...]`` or
            ``[python, SCRIPT, ...]``.
    """
    if len(argv) < 2 or "python" not in os.path.basename(argv[0]):
        raise ValueError(f"not a python command line: {argv!r}")
    if argv[1] == "-m" and len(argv) >= 3:
        return "module", argv[2], [argv[2], *argv[3:]]
    if argv[1] == "-c" and len(argv) >= 3:
        return "code", argv[2], ["-c", *argv[3:]]
    if argv[1].startswith("-"):
        raise ValueError(f"python option {argv[1]!r} is not supported by the fork server: {argv!r}")
    return "path", argv[1], argv[1:]


class Connection:
    """The client end: one request to a server, sent with the child's three descriptors; its answers.

    Args:
        socket_path (str): the server's Unix socket.
        argv (list[str]): the child's command line (see :func:`program_of`).
        env (dict[str, str]): the child's whole environment.
        cwd (str): the child's working directory.
        fds (list[int]): the child's stdin, stdout and stderr (this process keeps its own copies).

    Raises:
        OSError: the server cannot be reached.
        RuntimeError: the server went away before it answered with the child's pid.
    """

    def __init__(self, socket_path: str, argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> None:
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        socket.send_fds(self.sock, [HEADER.pack(len(request))], fds)
        self.sock.sendall(request)
        self._buffer = b""
        self.pid: int = self.message(None)["pid"]

    def message(self, timeout: float | None) -> dict[str, Any] | None:
        """The server's next JSON line; ``None`` when none came within ``timeout`` seconds (0: poll).

        Raises:
            RuntimeError: the server closed the connection (it went away while the child ran).
        """
        while b"\n" not in self._buffer:
            self.sock.settimeout(timeout)
            try:
                data = self.sock.recv(4096)
            except (BlockingIOError, TimeoutError):
                return None
            finally:
                self.sock.settimeout(None)
            if not data:
                raise RuntimeError("the fork server went away while the child ran")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        self.sock.close()


def receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The server end: read one request from an accepted connection.

    Returns:
        ``(request, fds)``: the JSON request (``argv``, ``env``, ``cwd``) and the descriptors that
        came with it (now open in this process).

    Raises:
        EOFError: the client went away mid-request.
        OSError, ValueError: a broken connection or a request that is not JSON.
    """
    head, fds, _flags, _addr = socket.recv_fds(conn, HEADER.size, 3)
    while len(head) < HEADER.size:  # a stream socket may deliver the header in pieces
        more = conn.recv(HEADER.size - len(head))
        if not more:
            raise EOFError("client went away")
        head += more
    (length,) = HEADER.unpack(head)
    body = b""
    while len(body) < length:
        more = conn.recv(length - len(body))
        if not more:
            raise EOFError("client went away")
        body += more
    return json.loads(body), list(fds)


def answer(conn: socket.socket, message: dict[str, int]) -> None:
    """The server end: send one JSON line (``{"pid": N}`` or ``{"status": S}``)."""
    conn.sendall(json.dumps(message).encode() + b"\n")


FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def shim_command(socket_path: str, argv: list[str]) -> int:
    """The ``opd-store`` shim command: run ``argv`` in a child of the server at ``socket_path``
    with this process's stdio, environment and directory; forward :data:`FORWARDED_SIGNALS`; return
    its exit status (ending this process by the child's signal when a signal ended it)."""
    conn = Connection(socket_path, argv, dict(os.environ), os.getcwd(), [0, 1, 2])
    for name in FORWARDED_SIGNALS:
        signal.signal(getattr(signal, name), lambda signum, _frame: os.kill(conn.pid, signum))
    status = conn.message(None)["status"]
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return 128 - status if status < 0 else status


def shim_script(socket_path: str) -> str:
    """The text of an ``opd-store`` shell script that runs ``python -m opd_store`` through the
    server at ``socket_path`` (see :func:`shim_command`)."""
    return (f"#!/bin/sh\nexec '{sys.executable}' '{os.path.abspath(__file__)}' --client "
            f"'{socket_path}' -m opd_store \"$@\"\n")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--client"] or len(sys.argv) < 3:
        raise SystemExit(f"usage: {sys.argv[0]} --client SOCKET ARGS...")
    raise SystemExit(shim_command(sys.argv[2], [sys.executable, *sys.argv[3:]]))
