"""On-policy-distillation checkpoints on the store (the seed's contract, rebuilt on manifests).

- :mod:`opd_store.opd.checkpoint`: ``save_opd_checkpoint``, ``load_opd_checkpoint``,
  ``load_adapter``, ``latest_complete_checkpoint``.
- :mod:`opd_store.opd.config`: the pydantic ``OPDConfig`` with execution-only markings.
- :mod:`opd_store.opd.resume`: resume modes and ``validate_execution_change``.
- :mod:`opd_store.opd.rng`: per-rank RNG capture/restore, ``preserve_global_rng``.
- :mod:`opd_store.opd.safe_load`: weights-only loading with a narrow allow-list; save-time sanitiser.
- :mod:`opd_store.opd.legacy`: migration of seed-layout checkpoints into any store.
- :mod:`opd_store.opd.data`: ``LoaderPosition``, a shuffled DataLoader's position for mid-epoch resume.
"""
