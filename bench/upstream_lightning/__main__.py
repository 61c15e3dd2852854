"""``python -m bench.upstream_lightning PATH [--baseline] [pytest args...]``: run Lightning's checkpoint
tests from its source tree at ``PATH`` (a checkout's ``tests/`` directory, the one holding
``tests_pytorch``) with their checkpoint I/O routed through opd_store
(:mod:`bench.upstream_lightning.plugin`); ``--baseline`` runs the same files without the plugin.

Lightning's test files are not part of this repository; fetch the tag of the installed ``lightning``
(docs/integrations.md, "Lightning's own checkpoint tests", records the counts for 2.6.5)::

    git clone --depth 1 -b 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pytorch-lightning
    python -m bench.upstream_lightning /tmp/pytorch-lightning/tests -n 2

They need the ``bench`` extra's ``cloudpickle`` and ``jsonargparse`` (Lightning's test requirements).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FILES = (
    "tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
    "tests_pytorch/checkpointing/test_trainer_checkpoint.py",
    "tests_pytorch/plugins/test_checkpoint_io_plugin.py",
)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    tests = Path(argv[0]).resolve()
    rest = argv[1:]
    baseline = "--baseline" in rest
    rest = [arg for arg in rest if arg != "--baseline"]
    missing = [name for name in FILES if not (tests / name).is_file()]
    if missing:
        print(f"{tests} does not hold Lightning's tests ({', '.join(missing)} missing)", file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), str(tests), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tests), "-q", "-rfE",
               *([] if baseline else ["-p", "bench.upstream_lightning.plugin"]), *FILES, *rest]
    return subprocess.call(command, cwd=tests, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
