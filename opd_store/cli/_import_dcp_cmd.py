"""``opd-store import-dcp SRC STORE --step N``: commit a checkpoint DCP's own writers wrote."""

from __future__ import annotations

import argparse

from ._common import add_store_options, open_store, step_arg, store_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "import-dcp",
        help="verify a checkpoint written by DCP's FileSystemWriter/FsspecWriter and commit it with a manifest",
        description=(
            "A directory written by torch.distributed.checkpoint's own writers (.metadata and "
            "__<rank>_<n>.distcp files, no manifest) is not a checkpoint of a store, even inside its "
            "step-NNNNNN/ prefix: `opd-store ls --all` shows such a step as uncommitted. This command "
            "decodes its metadata without running code, checks that every rank's file holds every item "
            "the metadata places there (each object and tensor deserialised, shapes and dtypes compared), "
            "copies the files into a new attempt of STEP in STORE and commits the manifest. SRC may be "
            "STORE's own step prefix; its files are left in place (delete them once the copy is verified)."
        ),
    )
    parser.add_argument("src", help="the DCP checkpoint directory (local path or URL)")
    parser.add_argument("store", help="destination store URL (local path, s3://, gs://, ...)")
    parser.add_argument("--step", type=step_arg, required=True, help="the step to commit it as")
    add_store_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..dcp import adopt_dcp_checkpoint

    options = store_options(args)
    store = open_store(args.store, args, create=True, options=options)  # it commits into STORE: writes proven
    url = adopt_dcp_checkpoint(args.src, store, args.step, source_storage_options=options)
    manifest = store.manifest(args.step)
    print(f"committed {url} ({len(manifest.payloads)} payloads, {manifest.total_size_bytes} bytes, "
          f"world size {manifest.world_size})")
    return 0
