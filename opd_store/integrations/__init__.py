"""opd_store for the trainers people already use (docs/integrations.md).

:mod:`opd_store.integrations.transformers` (extra ``[hf]``): a ``TrainerCallback`` for the Hugging
Face ``Trainer`` and TRL, and the one-call resume. :mod:`opd_store.integrations.lightning` (extra
``[lightning]``): a ``CheckpointIO`` plugin and a ``ModelCheckpoint``. Both take any store and
commit through the save pipeline; neither is imported by ``import opd_store``.
"""
