"""Child process of test_endpoint.py: a store at a custom ``endpoint_url`` with explicit keys,
run with no AWS variables (save, list, exists, load, delete and `opd-store gc`) and empty AWS config files, so any request that ignored the store's
options would find no credentials (or go to AWS, unreachable here) instead of passing silently.

Usage: python endpoint_child.py '<json: url, endpoint_url, key, secret>'  -> prints a JSON report.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    leaked = sorted(name for name in os.environ if name.startswith("AWS_") and name not in (
        "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"))
    from opd_store import CheckpointStore

    options = {"endpoint_url": args["endpoint_url"], "key": args["key"], "secret": args["secret"]}
    store = CheckpointStore(args["url"], storage_options=options)
    report: dict = {"aws_env": leaked}
    store.check_reachable()
    with store.begin(1) as txn:
        txn.write_bytes("model.bin", b"step one")
    with store.begin(2) as txn:
        txn.write_bytes("model.bin", b"step two")
    report["steps"] = store.steps()
    report["is_complete"] = [store.is_complete(1), store.is_complete(2), store.is_complete(3)]
    report["latest"] = store.latest_step()
    report["read"] = store.read(2, "model.bin").decode()
    store.delete(1)
    report["after_delete"] = store.steps()
    with store.begin(3) as txn:
        txn.write_bytes("model.bin", b"step three")
    from opd_store.cli import main as cli_main

    report["gc_exit"] = cli_main([
        "gc", args["url"], "--keep-last", "1", "--yes", "--s3-endpoint-url", args["endpoint_url"],
        "--storage-option", f"key={args['key']}", "--storage-option", f"secret={args['secret']}",
    ])
    report["after_gc"] = store.steps()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
