"""Lightning's own checkpoint tests, unmodified, with their checkpoint I/O routed through
``opd_store.integrations.lightning`` (:mod:`.plugin`); ``python -m bench.upstream_lightning PATH``
runs them (:mod:`.__main__`). docs/integrations.md records the command, the counts and the cases that
do not apply."""
