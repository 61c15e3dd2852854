"""Helpers of the CLI tests (a module name of its own: ``conftest`` is ambiguous in this suite)."""

from __future__ import annotations

from opd_testkit.stores import Backend


def cli_store_args(backend: Backend) -> list[str]:
    """The command-line store options that reach ``backend`` (moto: endpoint and test keys)."""
    if backend.name != "s3":
        return []
    options = backend.storage_options
    return [
        "--s3-endpoint-url", options["endpoint_url"],
        "--storage-option", f"key={options['key']}",
        "--storage-option", f"secret={options['secret']}",
        "--storage-option", "client_kwargs.region_name=us-east-1",
    ]
