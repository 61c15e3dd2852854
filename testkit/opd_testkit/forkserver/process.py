"""A child of a fork server, used like :class:`subprocess.Popen`.

:class:`ForkedProcess` has the :class:`subprocess.Popen` surface the tests use (``pid``,
``returncode``, ``stdin``/``stdout``/``stderr`` pipes, ``poll``, ``wait``, ``communicate``,
``send_signal``, ``terminate``, ``kill``, a context manager). The child's exit status comes from the
server over the request's connection (:mod:`.protocol`), as :attr:`subprocess.Popen.returncode`
reports it: negative for the signal that ended it.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import threading
import time
from typing import Any

from .protocol import Connection

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT


class ForkedProcess:
    """A child of a fork server, used like :class:`subprocess.Popen`; made by
    :meth:`ForkServer.popen <opd_testkit.forkserver.ForkServer.popen>`.

    Args:
        socket_path (str): the server's Unix socket.
        args (list[str]): the child's Python command line.
        env, cwd, stdin, stdout, stderr: as :class:`subprocess.Popen` takes them (``env`` ``None``:
            this process's environment; ``cwd`` ``None``: this process's directory).
        text (bool): the pipes are text streams (``encoding``/``errors``, default UTF-8, strict).

    Raises:
        OSError: the server cannot be reached.
        RuntimeError: the server went away before the child started.
    """

    def __init__(self, socket_path: str, args: list[str], *, env, cwd, stdin, stdout, stderr, text: bool,
                 encoding: str | None, errors: str | None) -> None:
        self.args = args
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        self._readers: dict[str, threading.Thread] = {}
        self._collected: dict[str, list[bytes]] = {}
        ours: list[int] = []  # descriptors opened here for the child, closed once sent
        fds = []
        for which, spec in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
            if spec is None:
                fds.append(("stdin", "stdout", "stderr").index(which))
            elif spec == PIPE:
                read_fd, write_fd = os.pipe()
                child_end, our_end, mode = (read_fd, write_fd, "wb") if which == "stdin" else (write_fd, read_fd, "rb")
                stream = open(our_end, mode, buffering=0 if which == "stdin" else -1)  # noqa: SIM115
                if text:
                    stream = io.TextIOWrapper(stream, encoding=encoding or "utf-8", errors=errors or "strict",
                                              write_through=which == "stdin")
                setattr(self, which, stream)
                fds.append(child_end)
                ours.append(child_end)
            elif spec == DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                fds.append(fd)
                ours.append(fd)
            elif spec == STDOUT and which == "stderr":
                fds.append(fds[1])
            elif isinstance(spec, int):
                fds.append(spec)
            else:
                fds.append(spec.fileno())
        try:
            self._conn = Connection(socket_path, args, dict(os.environ if env is None else env),
                                    os.fspath(cwd) if cwd is not None else os.getcwd(), fds)
        finally:
            for fd in ours:
                os.close(fd)
        self.pid = self._conn.pid

    # the Popen surface ------------------------------------------------------------------------
    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            message = self._conn.message(timeout)
            if message is not None:
                self.returncode = message["status"]
                self._conn.close()
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Write ``input``, read stdout and stderr to their end, wait; ``(out, err)`` (``None``
        for a stream that is not a pipe).

        Raises:
            subprocess.TimeoutExpired: not finished within ``timeout``; call again to go on.
        """
        if self.stdin is not None and not self.stdin.closed:
            if input:
                try:
                    self.stdin.write(input)
                except BrokenPipeError:
                    pass
            self.stdin.close()
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                chunks: list = []
                self._collected[name] = chunks
                self._readers[name] = threading.Thread(target=lambda s=stream, c=chunks: c.append(s.read()),
                                                       daemon=True)
                self._readers[name].start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers.values():
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = err = None
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                value = self._collected[name][0] if self._collected[name] else stream.read()
                stream.close()
                if name == "stdout":
                    out = value
                else:
                    err = value
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> "ForkedProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stdin is not None and not self.stdin.closed:
            self.stdin.close()
        self.wait()
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()

    def __repr__(self) -> str:
        return f"ForkedProcess(pid={self.pid}, returncode={self.returncode}, args={self.args!r})"
