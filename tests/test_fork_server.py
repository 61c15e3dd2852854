"""The tests' fork server (:mod:`opd_store.testing.forkserver`) shared through its socket, as the
controller of a pytest-xdist run shares one with its workers (``tests/conftest.py``): a client
attached to another's server forks its children there, detaching leaves the server running, and a
server returned before its preload is imported forks only once the preload is done."""

from __future__ import annotations

import os
import sys

from opd_store.testing.forkserver import ForkServer

PROBE = "import os, sys; print(os.getppid(), 'colorsys' in sys.modules)"


def test_a_server_shared_through_its_socket_forks_the_children_of_every_client():
    owner = ForkServer(preload=("colorsys",), env={"PATH": "/usr/bin:/bin"}, wait_ready=False)
    try:
        attached = ForkServer(socket_path=owner.socket_path)
        first = attached.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
        # Requested as soon as the socket was bound: forked once the preload was done.
        server_pid, preloaded = first.stdout.split()
        assert (first.returncode, preloaded) == (0, "True")
        assert attached.alive() and attached.preload == ()
        attached.close()  # detaching does not stop the server
        second = owner.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
        assert (second.returncode, second.stdout.split()) == (0, [server_pid, "True"])
        assert owner.alive()
    finally:
        owner.close()
    assert not owner.alive() and not os.path.exists(owner.socket_path)
