"""Dry-run planner: compiles one RL step's real jitted programs on a simulated CPU mesh and reports cost.

  python -m rl_jax.plan --config=configs/X.py[:arg] [--device h100|h200|tpu_v5p] [--json OUT]
      [--devices N] [--layers N] [--programs sync,generate,old_forward,update]
      [--dispatch gspmd,shard_map] [--set model.scan_layers=False ...]

Everything is abstract (shapes + shardings, no parameter memory): the trainer's params and
optimizer state, the sampler's (quantized) weights, the rollout and the train batch. The
programs are the ones the trainer jits: the sampler-weight sync, the sampler's generate, the
theta_old forward (where the trainer runs it apart from the update: `default_programs`) and the
update, lowered with the config's mesh and batch shapes and compiled
by XLA:CPU on `mesh size` simulated devices. Per program it prints per-device bytes (arguments
by kind, outputs, temporaries, the other programs' state that stays resident meanwhile), FLOPs
and bytes accessed, and a roofline time on the named accelerator; it exits 1 naming the
largest contributors when a program does not fit that accelerator's memory.

The package: `config` (what to plan, no jax), `hw` (the accelerators, the roofline and the fit
check), `state` (abstract state and its bytes), `cost` (one compiled program's figures), `steps`
(the step's programs compiled), `report` (`run`: the table and the verdict), `cli` (`main`). Only
`cli` and `config` load without jax: the command line re-executes itself with the mesh's simulated
device count (jax's CPU backend reads it once, when it starts), so the model stack loads once, there.
"""
