"""One rank of test_core_write_errors.py's multi-rank rows: a real process in a gloo group.

Run as ``python core_rank_child.py SPEC_JSON`` (rank, world size, file rendezvous, store URL and
options, ``out``, and ``steps``: the steps to save, one per backend failure the test armed in its
proxy for that step). Every rank saves each step in multi-rank mode (rank 0 the shared payloads and
``rng-rank-00.pt``, rank 1 ``rng-rank-01.pt``) and writes ``<out>/rank-<r>.json``: per step the
error's type, the classes it is, its message, its ``failures`` and its causes' types.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist


def describe(exc: BaseException) -> dict:
    causes, cause = [], exc.__cause__
    while cause is not None:
        causes.append(type(cause).__name__)
        cause = cause.__cause__
    return {"type": type(exc).__name__, "bases": [cls.__name__ for cls in type(exc).__mro__], "message": str(exc),
            "failures": {str(k): v for k, v in getattr(exc, "failures", {}).items()}, "causes": causes}


def main() -> int:
    spec = json.loads(sys.argv[1])
    rank, world_size = spec["rank"], spec["world_size"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    from opd_testkit import opd as objects

    from opd_store import CheckpointStore, save_opd_checkpoint

    store = CheckpointStore(spec["url"], storage_options=spec["storage_options"])
    results = {}
    for step, big in spec["steps"]:
        teacher = {"update_count": step, **({"big": torch.zeros(3 << 20)} if big else {})}  # 12 MiB: multipart
        try:
            results[str(step)] = {"url": save_opd_checkpoint(**objects.save_kwargs(store, successful=step,
                                                                                     teacher_state=teacher))}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[str(step)] = describe(exc)
    with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as handle:
        json.dump(results, handle)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
