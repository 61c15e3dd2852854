"""One save (then one load) in a fresh process, reporting resident memory as JSON on stdout.

    python -m bench._rss_child --backend local|s3 --mode raw|store --size-mib N --root ROOT \
        [--storage-options JSON]

Readings (KiB, from /proc/self/status): ``baseline`` after imports and client set-up, ``with_state``
after building the state, ``save_peak`` the VmHWM of the save (VmHWM is reset to the current RSS
just before it, ``echo 5 > /proc/self/clear_refs``), then the same for one load.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import make_state, proc_status_kib, reset_peak_rss, state_nbytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("local", "s3"), required=True)
    parser.add_argument("--mode", choices=("raw", "store", "proto-sliced"), required=True,
                        help="proto-sliced: the store, with writes sliced to 8 MiB (bench/prototypes.py)")
    parser.add_argument("--n-tensors", type=int, default=64)
    parser.add_argument("--size-mib", type=int, required=True)
    parser.add_argument("--root", required=True, help="local directory, or s3://bucket/prefix")
    parser.add_argument("--storage-options", default="{}")
    args = parser.parse_args()
    options = json.loads(args.storage_options)

    import torch

    from opd_store import CheckpointStore

    fs = None
    store = None
    if args.mode != "raw":
        store = CheckpointStore(args.root, storage_options=options or None)
        if args.backend == "s3":
            store.storage.fs.connect()
    elif args.backend == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        fs.connect()
    raw_path = (
        os.path.join(args.root, "raw.pt") if args.backend == "local" else args.root.removeprefix("s3://") + "/raw.pt"
    )
    if args.backend == "local":
        os.makedirs(args.root, exist_ok=True)

    gc.collect()
    out: dict = {"backend": args.backend, "mode": args.mode, "pid": os.getpid()}
    out["baseline_kib"] = proc_status_kib("VmRSS")
    state = make_state(args.size_mib, n_tensors=args.n_tensors)
    out["state_bytes"] = state_nbytes(state)
    gc.collect()
    out["with_state_kib"] = proc_status_kib("VmRSS")
    out["hwm_reset"] = reset_peak_rss()

    started = time.perf_counter()
    if args.mode != "raw":
        from bench.prototypes import SlicedWrites

        with store.begin(1) as txn:
            with txn.open("state.pt") as writer:
                torch.save(state, SlicedWrites(writer) if args.mode == "proto-sliced" else writer)
    elif args.backend == "local":
        torch.save(state, raw_path)
        fd = os.open(raw_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        with fs.open(raw_path, "wb") as handle:
            torch.save(state, handle)
    out["save_secs"] = time.perf_counter() - started
    out["save_peak_kib"] = proc_status_kib("VmHWM")
    out["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    gc.collect()
    out["before_load_kib"] = proc_status_kib("VmRSS")
    reset_peak_rss()
    started = time.perf_counter()
    if args.mode != "raw":
        with store.open(1, "state.pt") as handle:
            loaded = torch.load(handle)
    elif args.backend == "local":
        loaded = torch.load(raw_path)
    else:
        loaded = torch.load(io.BytesIO(fs.cat_file(raw_path)))
    out["load_secs"] = time.perf_counter() - started
    out["load_peak_kib"] = proc_status_kib("VmHWM")
    out["after_load_kib"] = proc_status_kib("VmRSS")
    first = next(iter(state))
    out["loaded_ok"] = bool(torch.equal(loaded[first], state[first]))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
