"""``python -m bench.upstream_transformers TRANSFORMERS_CHECKOUT [pytest args ...]``: run transformers'
own checkpoint tests, unmodified, with their checkpoint I/O through ``StoreCallback``
(:mod:`bench.upstream_transformers.plugin`; docs/integrations.md).

``TRANSFORMERS_CHECKOUT`` is a directory holding transformers' ``tests/`` package (at least
``tests/__init__.py``, ``tests/trainer/__init__.py``, ``tests/trainer/trainer_test_utils.py`` and
``tests/trainer/test_trainer_checkpointing.py`` of the installed transformers' version). The tests
run offline (``HF_HUB_OFFLINE=1``): the cases that download a model fail the same way without the
plugin. Exit status: pytest's. For example::

    python -m bench.upstream_transformers /path/to/transformers
    OPD_UPSTREAM_ASYNC=1 python -m bench.upstream_transformers /path/to/transformers -k resume
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TEST_FILE = "tests/trainer/test_trainer_checkpointing.py"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    checkout = Path(argv[0]).resolve()
    if not (checkout / TEST_FILE).is_file():
        print(f"{checkout}: no {TEST_FILE} (give the directory that holds transformers' tests/)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import pytest

    return pytest.main(["-p", "bench.upstream_transformers.plugin", "-p", "no:cacheprovider", "-o", "addopts=",
                        f"--rootdir={checkout}", "-q", "-rfEs", "--tb=line", str(checkout / TEST_FILE), *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
