"""The sampler <-> RL contract: the Rollout, its slot layout, alignment and group helpers."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rl_jax.logprobs import next_token_logq


def expert_id_dtype(n_experts: int) -> jnp.dtype:
  """The smallest integer dtype that holds every expert id 0..n_experts-1: uint8 up to 256
  experts, int16 up to 32768, else int32.

  Recorded routes (`Rollout.expert_ids_BSLK`, `TrainBatch.replay_ids_BSLK`, theta_old's own ids)
  are stored in it: at [MiniRL]'s 32k-token responses int32 ids of Qwen3-30B-A3B (48 MoE layers x
  8 slots) are 1.5 KiB a token, uint8 a quarter of that. Unrecorded slots hold 0 (masked by
  `expert_valid_BS`), so no sentinel needs a value of its own. Consumers cast to int32 where ids
  index or enter arithmetic (the model's replay, per layer); comparisons work across dtypes.
  """
  for dtype in (jnp.uint8, jnp.int16):
    if n_experts - 1 <= jnp.iinfo(dtype).max:
      return jnp.dtype(dtype)
  return jnp.dtype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rollout:
  """What the sampler generated and recorded, all on device.

  Dimension letters (one vocabulary for the repo): B batch rows, P prompt slots, T response
  slots, S = P + T the whole token buffer, V vocabulary, D hidden, L MoE layers, K top-k /
  experts per token.

  Layout (S = max_prompt_len + max_new_tokens, P = max_prompt_len, T = max_new_tokens):
    - `tokens_BS`: one buffer; the prompt is re-laid out *left-padded* in slots [0, P)
      (so every prompt ends at slot P-1) and response token t sits at slot P + t.
      Padding (left of the prompt, after the end of the response) holds `pad_id`.
    - `prompt_mask_BS` / `response_mask_BS`: real prompt / real response tokens. A
      response ends with its EOS token (included, mask True) or at T tokens.
    - `positions_BS`: RoPE positions, `default_positions(prompt_mask | response_mask)`,
      exactly what the sampler used; the trainer can pass them or let the model
      recompute them from `valid_BS`.
    - `logq_BT`, `topk_ids_BTK`, `topk_logq_BTK`, `head_mass_BT`: for response token t
      (slot P + t): `log q(y_t)` and the top-k of `log q(. | y_<t)`, where q is the
      log-softmax of the temperature-scaled full-vocabulary logits (docs/math.md#log-prob-conventions;
      never renormalized over a top-p / top-k set). `head_mass = sum_H q_v` over
      the recorded top-k H, or over the top-1 token when `record_topk = 0` (a floor on any
      head mass, recorded so the diagnostic exists in every config). Zero where
      `response_mask` is False.
    - `expert_ids_BSLK`: experts routed by the sampler in each MoE layer (L = MoE
      layers in `ModelConfig.moe_layers` order) for the token *at slot s*, prompt and
      response alike: the trainer's `replay_ids_BSLK` for a forward over `tokens_BS`.
      Stored compact, in `expert_id_dtype(n_experts)` (uint8 up to 256 experts), and 0 where
      `expert_valid_BS` is False (no sentinel value); the model casts them to int32 per layer.
      `expert_valid_BS` marks the slots that carry a route: real prompt tokens and every
      response token except each row's last one, which the sampler never fed back.
    - `trunc_thresh_BT`, `trunc_logmass_BT`, `trunc_size_BT`: when the sampler truncates
      (`top_k` / `top_p`, `SamplerConfig.truncates`), the kept set K it drew token t from:
      K = {v : log q_v >= trunc_thresh} (the threshold lies midway between the least likely kept
      and the most likely cut log q; -inf when nothing was cut), its mass log q(K) and its size |K|, so that
      `log q(y_t) - trunc_logmass` is the log-probability under the truncated, renormalized
      distribution really sampled (docs/math.md#truncated-sampling). Zero where `response_mask`
      is False; None without truncation.
    - `version_BT`: int32, the policy version (updates applied to the trainer's weights) that
      sampled response token t, when the sampler took newer weights in the middle of the
      rollout (`rl.inflight_updates`, docs/math.md#in-flight-weight-updates); 0 where
      `response_mask` is False. None when one version sampled the whole rollout (the
      trainer knows it: `InFlight.version`).
    - `topk_ids_BTK` / `topk_logq_BTK` are None when `record_topk = 0`; `expert_ids_BSLK` is None for a
      dense model or `record_experts = False`.
  In the trainer's teacher-forced forward over `tokens_BS`, the logits at slot s predict
  token s+1; `trainer_targets` and `response_slice` do that shift, `trainer_logprobs`
  returns `log p` at the response tokens and at the top-k ids, aligned with `logq_BT`
  and `topk_ids_BTK`. Replay for R3: `replay_ids_BSLK=expert_ids_BSLK,
  replay_mask_BS=expert_valid_BS` in that same forward.
  """
  tokens_BS: jax.Array
  positions_BS: jax.Array
  prompt_mask_BS: jax.Array
  response_mask_BS: jax.Array
  logq_BT: jax.Array
  topk_ids_BTK: jax.Array | None
  topk_logq_BTK: jax.Array | None
  head_mass_BT: jax.Array
  expert_ids_BSLK: jax.Array | None
  expert_valid_BS: jax.Array
  lengths_B: jax.Array
  prompt_lengths_B: jax.Array
  prompt_len: int = dataclasses.field(metadata=dict(static=True))
  trunc_thresh_BT: jax.Array | None = None
  trunc_logmass_BT: jax.Array | None = None
  trunc_size_BT: jax.Array | None = None
  version_BT: jax.Array | None = None

  @property
  def valid_BS(self) -> jax.Array:
    """Real tokens (prompt or response): the trainer's `valid_BS`."""
    return self.prompt_mask_BS | self.response_mask_BS

  @property
  def response_BT(self) -> jax.Array:
    """Response tokens `[B, T]`, aligned with `logq_BT`."""
    return self.tokens_BS[:, self.prompt_len:]

  @property
  def response_mask_BT(self) -> jax.Array:
    return self.response_mask_BS[:, self.prompt_len:]


# ----------------------------------------------------------------------------------------
# Alignment helpers for the trainer.


def trainer_targets(rollout: Rollout) -> tuple[jax.Array, jax.Array]:
  """Targets and loss mask aligned with the logits of a forward over `rollout.tokens_BS`.

  `logits_BSV[:, s]` predicts token s+1, so `targets_BS[:, s] = tokens_BS[:, s+1]` and
  `mask_BS[:, s] = response_mask_BS[:, s+1]` (the last slot predicts nothing: pad,
  False). `log p(y)` at response tokens is then
  `take_along_axis(log_softmax(logits_BSV / T), targets_BS[..., None], -1)[..., 0]`
  under `mask_BS`, and `response_slice(that, rollout)` lines it up with `logq_BT`.
  """
  pad = jnp.zeros_like(rollout.tokens_BS[:, :1])
  targets_BS = jnp.concatenate([rollout.tokens_BS[:, 1:], pad], axis=1)
  mask_BS = jnp.concatenate([rollout.response_mask_BS[:, 1:], jnp.zeros_like(pad, bool)], axis=1)
  return targets_BS, mask_BS


def response_slice(x_BS: jax.Array, rollout: Rollout) -> jax.Array:
  """The logits-aligned slots [P-1, P-1+T) of `x_BS...`: entry t goes with response token t.

  Apply it to anything computed from the trainer's logits over `tokens_BS` (logits,
  log-probs at `trainer_targets`, top-k) to compare with `logq_BT` / `topk_*_BTK`.
  """
  return response_slots(x_BS, rollout.prompt_len, rollout.logq_BT.shape[1])


def response_slots(x_BS: jax.Array, prompt_len: int, t: int) -> jax.Array:
  """`response_slice` from the layout's two numbers (P, T), for code that holds no Rollout."""
  return jax.lax.slice_in_dim(x_BS, prompt_len - 1, prompt_len - 1 + t, axis=1)


def trainer_logprobs(logits_BSV: jax.Array, rollout: Rollout, temperature: float
                     ) -> tuple[jax.Array, jax.Array | None]:
  """The trainer's `log p` lined up with the rollout: `(logp_BT, logp_at_topk_BTK)`.

  `logits_BSV` is the trainer's forward over `rollout.tokens_BS` (with
  `rollout.positions_BS` / `rollout.valid_BS`). Same temperature and full-vocabulary
  log-softmax as the sampler, so `logp_BT - logq_BT` is the log IS ratio, and
  `logp_at_topk_BTK` is `log p` at the sampler's top-k ids (score centering's head).
  """
  logp_BTV = response_slice(next_token_logq(logits_BSV, temperature), rollout)
  logp_BT = jnp.take_along_axis(logp_BTV, rollout.response_BT[..., None], axis=-1)[..., 0]
  logp_BT = jnp.where(rollout.response_mask_BT, logp_BT, 0.0)
  if rollout.topk_ids_BTK is None:
    return logp_BT, None
  return logp_BT, jnp.take_along_axis(logp_BTV, rollout.topk_ids_BTK, axis=-1)


def response_to_logit_slots(x_BT: jax.Array, rollout: Rollout, fill=0) -> jax.Array:
  """Inverse of `response_slice`: puts a response-aligned `x_BT...` at logits slots `[B, S...]`."""
  b, t = x_BT.shape[:2]
  s = rollout.tokens_BS.shape[1]
  left = jnp.full((b, rollout.prompt_len - 1) + x_BT.shape[2:], fill, x_BT.dtype)
  right = jnp.full((b, s - (rollout.prompt_len - 1) - t) + x_BT.shape[2:], fill, x_BT.dtype)
  return jnp.concatenate([left, x_BT, right], axis=1)


# ----------------------------------------------------------------------------------------
# Group sampling helpers.


def repeat_prompts(prompts: Any, group_size: int) -> Any:
  """Each prompt `group_size` times in a row: rows [i*G, (i+1)*G) are prompt i's group.

  `prompts` may be an array or any pytree of batch-leading arrays (e.g. `(ids, valid)`).
  """
  if group_size < 1:
    raise ValueError(f"group size must be >= 1, got {group_size}")
  return jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x), group_size, axis=0), prompts)


def group_index(num_prompts: int, group_size: int) -> jax.Array:
  """Prompt index of every row of a `repeat_prompts` batch, `[num_prompts * group_size]`."""
  return jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), group_size)
