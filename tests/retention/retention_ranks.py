"""One rank of the multi-rank retention table (tests/retention/test_retention_everywhere.py).

``python tests/retention/retention_ranks.py SPEC_JSON``: joins a gloo process group (the spec's
rendezvous file), then for each store of the spec saves steps 1-4 with ``save_opd_checkpoint(retention=keep_last=1)``
in multi-rank mode (every rank its own RNG part, rank 0 commits), flushes the store, and (rank 0)
writes ``<out>/result.json``: ``{store kind: {tier: steps left}}``.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from opd_testkit.stores import use_emulator_environment

use_emulator_environment()  # before fsspec's S3/GCS backends are imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from opd_testkit import opd as fixtures  # noqa: E402

from opd_store import CheckpointStore, TieredStore, save_opd_checkpoint  # noqa: E402
from opd_store.retention import RetentionPolicy  # noqa: E402


def open_target(target: dict):
    bucket = CheckpointStore(target["url"], storage_options=target["storage_options"])
    if target.get("local") is None:
        return bucket, {"store": bucket}
    return TieredStore(target["local"], bucket), {"bucket": bucket, "local": CheckpointStore(target["local"])}


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["init_method"], rank=spec["rank"],
                            world_size=spec["world_size"], timeout=datetime.timedelta(seconds=600))
    result = {}
    for kind, target in spec["targets"].items():
        store, tiers = open_target(target)
        for step in (1, 2, 3, 4):
            kwargs = fixtures.save_kwargs(store, successful=step, retention=RetentionPolicy(keep_last=1))
            save_opd_checkpoint(**kwargs)
        store.close()  # a tiered store: every upload and retention pass done (rank 0 uploads)
        dist.barrier()
        result[kind] = {name: tier.steps() for name, tier in tiers.items()}
    if spec["rank"] == 0:
        Path(spec["out"], "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
