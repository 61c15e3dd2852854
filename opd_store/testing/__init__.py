"""Test and benchmark support for opd_store: real servers on loopback, proxies, fresh machines.

Installed with the product so that ``tests/``, ``bench/`` and ``opd-store demo`` share one copy.
Nothing here is imported by ``import opd_store``; each submodule imports its heavy dependencies
(moto, boto3, torch) only when a function that needs them is called.
"""
