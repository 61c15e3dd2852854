"""Started with every Python process of ``python -m bench.upstream_dcp`` (this folder is first on its
``PYTHONPATH``): PyTorch's distributed tests run each rank in a process of its own (``spawn``), and
each must save through opd_store too. Does nothing unless ``OPD_UPSTREAM_DCP`` is set."""

import os

if os.environ.get("OPD_UPSTREAM_DCP"):
    from bench.upstream_dcp.substitute import install

    install()
