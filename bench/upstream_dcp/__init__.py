"""PyTorch's own ``torch.distributed.checkpoint`` tests, unmodified, run against opd_store's DCP layer.

``python -m bench.upstream_dcp --pytorch-tests /path/to/pytorch/test/distributed/checkpoint`` runs
the test files named in :data:`~bench.upstream_dcp.__main__.FILES` under pytest with DCP's
``FileSystemWriter``/``FileSystemReader`` replaced (:mod:`bench.upstream_dcp.substitute`) in the
runner and in every rank process it spawns (:mod:`bench.upstream_dcp.site`'s ``sitecustomize``).
PyTorch's test files are not part of this repository: point the command at a checkout of them.
Results and the cases that do not apply: docs/upstream-tests.md.
"""
