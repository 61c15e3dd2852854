"""On-policy-distillation checkpoints on the store (the seed's contract, rebuilt on manifests).

- :mod:`opd_store.opd.checkpoint`: ``save_opd_checkpoint``, ``load_opd_checkpoint``,
  ``load_adapter``, ``latest_complete_checkpoint`` in one import; they live in
  :mod:`~opd_store.opd.names` (payload layout, references), :mod:`~opd_store.opd.snapshot`,
  :mod:`~opd_store.opd.save`, :mod:`~opd_store.opd.load` and :mod:`~opd_store.opd.adapter`.
- :mod:`opd_store.opd.async_save`: ``AsyncCheckpointer``, the same save on the background worker
  (:mod:`~opd_store.opd.staging`: its reusable host buffers).
- :mod:`opd_store.opd.distributed`: the process group, collective loads, rank-0 decisions.
- :mod:`opd_store.opd.config`: the pydantic ``OPDConfig`` with execution-only markings.
- :mod:`opd_store.opd.resume`: resume modes and ``validate_execution_change``.
- :mod:`opd_store.opd.rng`: per-rank RNG capture/restore, ``preserve_global_rng``.
- :mod:`opd_store.opd.safe_load`: weights-only loading with a narrow allow-list; save-time sanitiser.
- :mod:`opd_store.opd.legacy`: migration of seed-layout checkpoints into any store.
- :mod:`opd_store.opd.data`: ``LoaderPosition``, a shuffled DataLoader's position for mid-epoch
  resume; ``GlobalSamplePosition``, a global sample index re-split over any number of ranks.
- :mod:`opd_store.opd.sharded`, :mod:`opd_store.opd.sharded_load`: checkpoints of a sharded
  (FSDP2) student through DCP; :mod:`opd_store.opd.elastic`: the elastic-resume policy.
"""
