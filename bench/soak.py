"""Soak: SIGKILL the main job N times at chosen events, resume each time on a fresh machine, compare.

    python -m bench.soak                          # 50 kills, local store under bench/results/tmp/
    python -m bench.soak --backend moto           # moto's S3 server in its own process
    python -m bench.soak --backend seaweed        # SeaweedFS (weed mini), a production S3 server
    python -m bench.soak --backend seaweed --local-tier   # a local tier in front of the bucket
    python -m bench.soak --nproc 2 --n 24         # two ranks: one rank (a different one each time) killed
    python -m bench.soak --n 12 --seed 3          # the short form

Kills are chosen by event, not by clock: each start is armed with one kill point of the job
(``opd_store.runtime._kill_points``) in a phase it still reaches (mid-update forward, backward or optimizer
step; between updates; a payload streaming, at a random byte; before the manifest's create; right
after the commit; a retention delete; a tier upload; an asynchronous save's background write),
the phase with the fewest kills first. A kill point the start never reached is a miss, redrawn.
The checks are in :mod:`opd_testkit.soak`; the verdict (at least N kills, every phase at
least 4 when N allows, every resume bit-exact) in :mod:`opd_testkit.soak_phases`.

The report (markdown, verdict first) is printed and written to
``bench/results/soak-<backend>[-tiered][-ranksN]-<date>.md``. Exit status 0 only when it passes.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from opd_testkit.soak import Soak
from opd_testkit.soak_report import render

from ._common import REPO_ROOT, machine_description, now_stamp


def _launcher(name: str, world_size: int):
    """``fork``: children of a preloaded fork server (the imports paid once); ``exec``: new
    interpreters. Multi-rank jobs always exec (their ranks are spawned interpreters anyway)."""
    if name == "exec" or world_size > 1:
        return subprocess.Popen
    from opd_testkit.forkserver import default_server

    return default_server().popen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="kills to count (default 50)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the kill choices (default: random)")
    parser.add_argument("--backend", choices=("local", "moto", "seaweed"), default="local")
    parser.add_argument("--local-tier", action="store_true", help="every start commits to a local tier first")
    parser.add_argument("--nproc", type=int, default=1, help="ranks of the job (default 1)")
    parser.add_argument("--updates", type=int, default=8, help="successful updates of the main job (default 8)")
    parser.add_argument("--checkpoint-every", type=int, default=2, help="save every K successful updates (default 2)")
    parser.add_argument("--train-seed", type=int, default=0, help="the main job's --seed (default 0)")
    parser.add_argument("--launcher", choices=("fork", "exec"), default="fork",
                        help="start each process from a preloaded fork server (default) or a new interpreter")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    parser.add_argument("--keep-workdir", action="store_true", help="keep bench/results/tmp/soak-* afterwards")
    args = parser.parse_args(argv)
    if args.n < 1 or args.nproc < 1:
        parser.error("--n and --nproc must be >= 1")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    workdir = REPO_ROOT / "bench" / "results" / "tmp" / f"soak-{stamp}"
    workdir.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        storage_env: dict[str, str] = {}
        store_args: list[str] = []
        options: dict = {}
        if args.backend == "local":
            store_url = str(workdir / "store")
        else:
            if args.backend == "moto":
                from opd_testkit.s3 import MotoProcess

                server = MotoProcess(key_buffer_bytes=None)
            else:
                from opd_testkit.seaweed import SeaweedS3

                server = SeaweedS3()
            server.create_bucket("opd-soak")
            store_url, options = f"s3://opd-soak/{stamp}", server.storage_options()
            storage_env = server.environment()
            store_args = ["--s3-endpoint-url", server.endpoint_url]
        print(f"store: {store_url}\nwork directory: {workdir}\nkill seed: {args.seed}", flush=True)
        soak = Soak(store_url=store_url, storage_options=options, storage_env=storage_env, store_args=store_args,
                    workdir=workdir, updates=args.updates, checkpoint_every=args.checkpoint_every,
                    train_seed=args.train_seed, world_size=args.nproc, tiered=args.local_tier,
                    popen=_launcher(args.launcher, args.nproc))
        began = time.monotonic()
        soak.run(args.n, args.seed)
        minutes = (time.monotonic() - began) / 60
    finally:
        if server is not None:
            server.stop()
    label = args.backend + ("-tiered" if args.local_tier else "") + (f"-ranks{args.nproc}" if args.nproc > 1 else "")
    header = [
        f"# Soak: {args.n} kills chosen by event, resumed on a fresh machine ({now_stamp()})", "",
        f"`python -m bench.soak {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
        f"- store: {args.backend}{' with a local tier in front (every start)' if args.local_tier else ''} (`{store_url}`)",
        f"- main job: `opd-store train --updates {args.updates} --checkpoint-every {args.checkpoint_every} "
        f"--seed {args.train_seed}{f' --nproc {args.nproc}' if args.nproc > 1 else ''}`; reference run "
        f"{soak.reference_secs:.1f} s; checkpoints {soak.reference.saves}",
        f"- kill seed {args.seed}; processes started by `{args.launcher if args.nproc == 1 else 'exec'}`; "
        f"{len(soak.starts)} starts in {len({s.prefix for s in soak.starts})} spot runs, {len(soak.kills)} kills "
        f"counted; misses (a kill point the start never reached, redrawn): {soak.misses}; {minutes:.1f} min",
    ]
    text, problems = render(kills=soak.kills, n=args.n, header=header, starts=soak.starts,
                            extra_problems=soak.start_problems + soak.report_problems, world_size=args.nproc,
                            machine=machine_description())
    print("\n" + text)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"soak-{label}-{time.strftime('%Y-%m-%d', time.gmtime())}.md"
    path.write_text(text, encoding="utf-8")
    print(f"written to {path}")
    if not args.keep_workdir and not problems:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
