"""The S3 server of ``opd-store demo --s3-emulator``: moto's ``ThreadedMotoServer`` on 127.0.0.1
(port chosen by the OS) in the demo's own process, with throwaway credentials. Needs the
``emulator`` extra (``moto[server]``); the base install pulls in no server."""

from __future__ import annotations

import logging
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "opd-demo", "AWS_SECRET_ACCESS_KEY": "opd-demo", "AWS_DEFAULT_REGION": "us-east-1"}


class DemoS3Server:
    """A moto S3 server for one demo run; :meth:`stop` ends it (and everything it held).

    Raises:
        ImportError: moto's server is not installed (``pip install 'opd_store[emulator]'``).
    """

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request log lines
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"

    def environment(self) -> dict[str, str]:
        """The environment a training process needs to reach this server with botocore."""
        return dict(CREDENTIALS)

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server."""
        return {"endpoint_url": self.endpoint_url, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                "client_kwargs": {"region_name": CREDENTIALS["AWS_DEFAULT_REGION"]}}

    def create_bucket(self, bucket: str) -> None:
        """``CreateBucket`` as one plain ``PUT /<bucket>`` (moto checks no signature by default)."""
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint_url}/{bucket}", method="PUT"), timeout=30).read()

    def stop(self) -> None:
        self._server.stop()


__all__ = ["DemoS3Server"]
