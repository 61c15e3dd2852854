"""opd_store for the trainers people already use.

* :mod:`opd_store.integrations.transformers` (extra ``[hf]``): a ``transformers.TrainerCallback``
  that commits every checkpoint the Hugging Face ``Trainer`` (and TRL's trainers built on it, such
  as ``GKDTrainer``) writes, and the one call that resumes from the store on a fresh machine.
* :mod:`opd_store.integrations.lightning` (extra ``[lightning]``): a Lightning ``CheckpointIO``
  plugin that saves, loads and removes checkpoints in a store, and a ``ModelCheckpoint`` whose
  ``fit(ckpt_path="last")`` finds the newest complete checkpoint in the bucket.

Both take any store (a URL, a plain store, a :class:`~opd_store.TieredStore`) and commit with its
write-then-commit-manifest protocol (docs/protocol.md) through the one save pipeline
(:mod:`opd_store.pipeline`; ARCHITECTURE.md, "The save path"). Nothing here is imported by
``import opd_store``; each module imports its framework when it is imported. Usage and
guarantees: docs/integrations.md.
"""
