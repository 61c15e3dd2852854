"""Benchmarks for opd_store (printed side by side in one run; not timed tests).

Run from the repository root::

    .venv/bin/python -m bench                 # raw / torch.save / seed / DCP / opd_store
    .venv/bin/python -m bench --sizes 256 --sections speed,crc   # quicker
"""
