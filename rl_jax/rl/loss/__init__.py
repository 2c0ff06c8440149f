"""The shared jitted loss module: one loss, called by the trainer's update and by every notebook.

What each file holds (the math is docs/math.md's; the metrics docs/metrics.md's):
  registry.py          the registry tables (`METHOD_REGISTRY`, `ADVANTAGE_REGISTRY`,
                       `REWARD_MODE_REGISTRY`), their decorators and `Param` (a config field owned
                       by one method or estimator); imports nothing else of rl_jax.rl.
  methods.py           every correction rule `(TokenInputs, LossConfig) -> RuleOutput` and its
                       weight function, each registered with `@register_method`.
  loss_config.py       `LossConfig`: frozen, validated, hashable (a static argument under jit),
                       with each registered method's `Param`s as fields.
  losses.py            the jitted loss: rejection + rule + weight normalization + score centering
                       + aggregation (`rl_loss`, `rl_loss_from_logprobs`, `rl_loss_from_hidden`).
  loss_diagnostics.py  the stop-gradient statistics returned with the loss (logged as `loss/*`),
                       additive so micro-batches combine exactly.

The package imports nothing itself: `rl_jax.rl.advantages` reads `registry` while
`loss_config` imports `advantages`, so importing a submodule must not pull in the rest.
"""
