"""The fork server process: preload, then fork one child per request and report its end.

Started by :class:`~opd_testkit.forkserver.ForkServer` as ``python -m
opd_testkit.forkserver.server SOCKET PRELOAD...``. It binds its Unix socket and prints
``listening`` on stdout (a client may connect from then on: its request waits in the socket's
backlog), imports the preload, starts no thread, prints ``ready``, and then serves requests
(:mod:`.protocol`): a fork
per request, the child's pid at once, its exit status once it has been reaped. It kills a child
whose client connection closes, and exits, killing every child, when its stdin closes (its parent
is gone).
"""

from __future__ import annotations

import atexit
import gc
import os
import selectors
import signal
import socket
import sys
import threading
from typing import Callable, Sequence

from .child import become, end_if_quick_exit
from .preload import import_preload
from .protocol import answer, receive


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve(socket_path: str, preload: Sequence[str]) -> Callable[[], None]:
    """The server loop. Returns only in a forked child, with the program that child must run.

    Raises:
        RuntimeError: importing ``preload`` started a thread (forking then is unsafe).
        ModuleNotFoundError: a required preload module is not installed.
        SystemExit: the server's stdin closed (status 0).
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    sys.stdout.write("listening\n")
    sys.stdout.flush()
    atexit.register(end_if_quick_exit)  # first: in a child, after every hook the preload registers
    import_preload(preload)
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        raise RuntimeError(f"preloading {list(preload)} started threads {names}; forking now is unsafe")
    # Everything imported so far goes to the collector's permanent generation: a child's collections
    # (the last ones at its exit among them) then never write to these objects' headers, which
    # would copy most of the server's memory into every child (1.6 s of CPU per child with torch
    # and transformers loaded, 0.3 s with this; the gc module docs recommend it before fork()).
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):  # the client process is gone
                    for pid in children:
                        _kill(pid)
                    raise SystemExit(0)
            elif isinstance(key.data, int):  # a client connection: readable means it went away
                selector.unregister(key.fileobj)
                try:
                    gone = not key.fileobj.recv(1)
                except OSError:
                    gone = True
                if gone and key.data in children:
                    _kill(key.data)  # its client was killed: so is the child
            elif key.data == "reap":
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                while children:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        try:
                            selector.unregister(conn)
                        except (KeyError, ValueError):
                            pass
                        try:
                            answer(conn, {"status": os.waitstatus_to_exitcode(status)})
                        except OSError:
                            pass
                        conn.close()
            else:
                conn, _ = listener.accept()
                try:
                    request, fds = receive(conn)
                except (OSError, EOFError, ValueError):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    conn.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    os.close(sys.stdin.fileno())
                    return become(request, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                answer(conn, {"pid": pid})
                selector.register(conn, selectors.EVENT_READ, pid)


def main(argv: list[str]) -> None:
    """``SOCKET PRELOAD...``: serve; in a forked child, run the requested program."""
    program = serve(argv[0], argv[1:])
    del argv
    program()


if __name__ == "__main__":
    main(sys.argv[1:])
