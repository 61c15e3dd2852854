"""Test and benchmark support for opd_store's own tests and benchmarks: real servers on loopback
(moto, SeaweedFS, fake-gcs-server), fault, holding and bandwidth-shaping proxies, a preloaded fork
server for child processes, and the soak.

Installed beside opd_store by ``scripts/setup.sh`` and never shipped in its wheel; what a user
writing their own ``Storage`` needs (the conformance suite, a fault-injecting wrapper) is
:mod:`opd_store.testing`. Nothing here is imported by ``import opd_store``; each submodule imports
its heavy dependencies (moto, boto3, torch) only when a function that needs them is called.
"""
