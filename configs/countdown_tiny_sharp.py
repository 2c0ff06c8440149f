"""The README main job with a sharper SFT warm start: room for RL to learn, hold or collapse (issue 37).

Command:
  python -m rl_jax.main --config=configs/countdown_tiny_sharp.py --workdir=/tmp/rl_jax_sharp
Hardware: 2 CPU cores, no accelerator. Runtime: ~5 minutes on an idle 2-core machine, the SFT warm
start included (~2 minutes of it: 300 SFT steps instead of countdown_tiny's 100).
Setting: countdown_tiny.py unchanged except the warm start: the SFT config's own 300-step schedule
(AdamW 3e-3, cosine over 300 steps), not its 100-step early checkpoint. The `dose_response` study
(rl_jax/study/studies.py) starts from this warm start.
Expected (measured, seed 0, held-out greedy accuracy on the first 1024 eval problems, the SFT job's
own evaluation, 2 shared cores):
  SFT 300 steps: 0.072 at step 100, 0.246 at step 200, 0.289 at step 300 (49 s CPU, 2:04 wall)
  (countdown_tiny's 100-step warm start: 0.045 at step 0 of the protocol studies).
  python -m rl_jax.main --config=configs/sft_countdown_tiny.py --workdir=W \\
      --config.sft.eval_size=1024 --config.sft.eval_every=100
A 4-operand Countdown (n_operands=4, max_target=60, ~9 answer tokens) was tried too: see
docs/results.md#a-warm-start-with-room-to-fall. `:test` gives countdown_tiny's seconds-long variant.
"""
import ml_collections

from rl_jax.configs import countdown_tiny

SFT_STEPS = 300


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  cfg = countdown_tiny.get_config(arg)
  if arg != "test":
    cfg.sft.steps = cfg.sft.eval_every = cfg.sft_optim.total_steps = SFT_STEPS
    cfg.sft.eval_size = 1024
  return cfg
