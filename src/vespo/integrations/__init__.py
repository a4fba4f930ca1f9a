"""Adapters that run vespo's losses inside other RL frameworks.

    vespo.integrations.verl   importing it registers `vespo` (and `vespo_<name>` for vespo's other
                              losses) in verl's policy-loss registry
    vespo.integrations.trl    `VespoGRPOTrainer`, TRL's GRPOTrainer computing its loss with vespo's
                              losses and logging vespo's diagnostics
    vespo.integrations.trl_async  `VespoAsyncGRPOTrainer`, the same in TRL's experimental
                              AsyncGRPOTrainer (μ = the generation server's log-probs)

Both are optional: this package imports nothing, and neither verl nor TRL is imported until one of
the submodules is. See docs/integrations.md for the command lines.
"""
