"""The shared jitted loss module: one loss, called by the trainer's update and by every notebook.

What each file holds (the math is docs/math.md's; the metrics docs/metrics.md's):
  registry.py          the methods' table `METHOD_REGISTRY`, `MethodSpec`, `method` (a spec),
                       `add_method` and `register_method` (a user's module); `Param` (a config
                       field owned by one method) is rl_jax/config_registry.py's.
  methods.py           every correction rule `(TokenInputs, LossConfig) -> RuleOutput`, its
                       weight function and its spec, and `BUILTIN_METHODS`: all of them, listed.
  loss_config.py       `LossConfig`: frozen, validated, hashable (a static argument under jit),
                       with each registered method's `Param`s as fields; it puts
                       `BUILTIN_METHODS` in the table before the class is created.
  losses.py            the jitted loss: rejection + rule + weight normalization + score centering
                       + aggregation (`rl_loss`, `rl_loss_from_logprobs`, `rl_loss_from_hidden`).
  loss_diagnostics.py  the stop-gradient statistics returned with the loss (logged as `loss/*`),
                       additive so micro-batches combine exactly.

The package imports nothing itself, so importing a submodule does not pull in the rest. The
advantage estimators and reward modes keep their own tables (rl_jax/rl/advantages.py).
"""
