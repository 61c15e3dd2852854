"""A process that saves through a :class:`TieredStore` and then waits to be killed.

``python tests/tiered/tier_child.py LOCAL_DIR BACKEND_JSON STEPS``: saves each step of the
comma-separated STEPS with the payloads ``payloads_for(f"step{N}")`` of ``tests/proc_writer.py``,
printing ``committed N`` after each local commit; then flushes the uploads, prints ``flushed``,
and blocks reading stdin. The parent decides when to SIGKILL it from the stores' state.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opd_testkit.stores import Backend, use_emulator_environment  # noqa: E402

use_emulator_environment()  # before fsspec's S3/GCS backends are imported
from proc_writer import payloads_for  # noqa: E402

from opd_store.tiered import TieredStore  # noqa: E402


def main() -> None:
    local_dir, backend_json, steps = sys.argv[1:4]
    backend = Backend.from_json(backend_json)
    store = TieredStore(local_dir, backend.url, storage_options=backend.storage_options)
    for step in (int(s) for s in steps.split(",")):
        with store.begin(step) as txn:
            for name, data in payloads_for(f"step{step}").items():
                txn.write_bytes(name, data)
        print(f"committed {step}", flush=True)
    store.flush()
    print("flushed", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
