"""Live metrics for Prometheus (the ``prometheus`` extra): :class:`PrometheusExporter` is a journal
sink whose metrics (listed in docs/ledger.md, "Live metrics (Prometheus)") live in a registry of their own,
served over HTTP and/or written for node_exporter's textfile collector (temporary file and
rename, so the collector never reads half a file).
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("opd_store.ledger")


class PrometheusExporter:
    """The job's metrics (module docstring).

    Args:
        port (int | None): serve ``/metrics`` over HTTP on this port (0: one the OS picks,
            :attr:`port` says which); ``None``: no server.
        addr (str): the address the server listens on.
        textfile (str | Path | None): write the metrics to this file after every event.

    Raises:
        ImportError: ``prometheus_client`` is not installed (``pip install 'opd_store[prometheus]'``).
        ValueError: ``port`` is not 0 to 65535 (else ``bind()`` raises ``OverflowError``).
        FileNotFoundError: the directory of ``textfile`` does not exist (else each write fails,
            naming a temporary file).
        OSError: the port cannot be bound.
    """

    def __init__(self, *, port: int | None = None, addr: str = "0.0.0.0", textfile: str | Path | None = None) -> None:
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ValueError(f"metrics port must be an int from 0 (one the OS picks) to 65535, got {port!r}")
        if textfile is not None and not Path(textfile).resolve().parent.is_dir():
            raise FileNotFoundError(f"metrics textfile {textfile}: its directory does not exist")
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ImportError("metrics need prometheus_client: pip install 'opd_store[prometheus]'") from exc
        self._prom = prom
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.save_duration = prom.Summary("opd_store_save_duration_seconds", "seconds of a committed save",
                                          ["phase"], registry=r)
        self.saved_bytes = prom.Counter("opd_store_saved_bytes", "bytes of committed saves", registry=r)
        self.saves = prom.Counter("opd_store_saves", "committed saves", registry=r)
        self.save_failures = prom.Counter("opd_store_save_failures", "saves that failed", registry=r)
        self.last_step = prom.Gauge("opd_store_last_committed_step", "newest step committed by this process",
                                    registry=r)
        self.lost_updates = prom.Counter("opd_store_lost_updates", "updates redone or lost to preemptions", registry=r)
        self.resume_secs = prom.Gauge("opd_store_resume_seconds", "seconds from process start to the first update",
                                      registry=r)
        self.requests = prom.Counter("opd_store_requests", "store requests of saves", ["kind"], registry=r)
        self.textfile = Path(textfile) if textfile is not None else None
        self.port = None
        self._server = None
        if port is not None:
            self._server, _thread = prom.start_http_server(port, addr=addr, registry=r)
            self.port = self._server.server_address[1]
        self._write()

    def observe(self, event) -> None:
        """Update the metrics from one journal event."""
        if event.kind == "save":
            self.saves.inc()
            self.save_duration.labels("blocking").observe(event.blocking_secs)
            self.save_duration.labels("commit").observe(event.commit_secs)
            if event.size_bytes:
                self.saved_bytes.inc(event.size_bytes)
            self.last_step.set(event.step)
            for kind, count in event.requests.items():
                self.requests.labels(kind).inc(count)
        elif event.kind == "resume":
            if event.updates_redone:
                self.lost_updates.inc(event.updates_redone)
            if event.resumed_step is not None:
                self.last_step.set(event.resumed_step)
        elif event.kind == "notice" and event.updates_lost:
            self.lost_updates.inc(event.updates_lost)
        elif event.kind == "first_update":
            self.resume_secs.set(event.secs_from_process_start)
        self._write()

    def save_failed(self) -> None:
        """Count one failed save."""
        self.save_failures.inc()
        self._write()

    def _write(self) -> None:
        if self.textfile is not None:
            self._prom.write_to_textfile(str(self.textfile), self.registry)

    def close(self) -> None:
        """Stop the HTTP server (the textfile stays, as node_exporter expects)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["PrometheusExporter"]
