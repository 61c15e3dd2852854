"""On-policy-distillation (OPD) checkpoints on the store: config schema, resume modes, save/load.

Submodules:
    config: the pydantic ``OPDConfig`` schema, with execution-only and rollout-limit markings.
    resume: resume-mode validation (``exact``, ``execution_change``, ``rollout_limit_change``).
    checkpoint: saving and loading OPD checkpoints on any store URL.
"""
