"""transformers' own checkpoint tests against :class:`~opd_store.integrations.transformers.StoreCallback`:
the pytest plugin that routes their checkpoint I/O through the store (:mod:`.plugin`) and the
command that runs them (``python -m bench.upstream_transformers CHECKOUT``, :mod:`.__main__`)."""
