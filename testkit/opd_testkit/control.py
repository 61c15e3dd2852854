"""A helper server in a process of its own, driven over its stdin and stdout: it prints
``PORT <n>`` once it listens on 127.0.0.1, then answers one-line commands (``stats``,
``reset``...) with one line each, and exits when its stdin closes. The bandwidth-capping proxy
(:mod:`.throttle`) and the rate-limit proxy (:mod:`.rate_limit`) run this way."""

from __future__ import annotations

import subprocess
from typing import Any


class ControlledProcess:
    """Start ``argv`` and wait for its ``PORT`` line.

    Attributes:
        process (subprocess.Popen): the process.
        port (int), endpoint_url (str), pid (int): where it listens, and its process id.

    Raises:
        RuntimeError: it printed something else first (naming ``what`` and the line).
    """

    def __init__(self, argv: list[str], what: str, **popen_kwargs: Any) -> None:
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen_kwargs)
        line = self.process.stdout.readline()
        if not line.startswith("PORT "):
            self.process.kill()
            raise RuntimeError(f"{what} did not start: {line!r}")
        self.port = int(line.split()[1])
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.pid = self.process.pid

    def ask(self, command: str) -> str:
        """Send one command line; return the one line it answers."""
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline()

    def stop(self) -> None:
        """Close its stdin (it exits), wait up to 10 s, then kill it."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


__all__ = ["ControlledProcess"]
