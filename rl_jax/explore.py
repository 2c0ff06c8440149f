"""Exploration helpers the notebooks call: exact drift by enumeration, mismatch per regime, replay trajectories."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl_jax import rollout as rollout_lib
from rl_jax.config_utils import ConfigError
from rl_jax.rl import programs as programs_lib
from rl_jax.rl import step as step_lib
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.rl.loss.losses import rl_loss
from rl_jax.sampler import weights as sampler_weights
from rl_jax.sampler.config import SamplerConfig

# Every jitted program here (sync, generate, the p_old forward, the probe, the update) is the
# trainer's, from the one factory (`programs.build_local`): a notebook measures what a run executes.

# --- Drift and score centering by enumeration (docs/math.md#score-centering) -----------------
#
# One position, a vocabulary of V tokens: the trainer's p = softmax(z) and the sampler's q.
# Every expectation over y ~ q is a finite sum, so drift and variance are exact, not estimated.


def mismatched_pair(logits_V: jax.Array, direction_V: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
  """(log p, log q) with p = softmax(z) and q = softmax(z + scale * direction): scale 0 is on-policy."""
  logits_V = jnp.asarray(logits_V, jnp.float32)
  return (jax.nn.log_softmax(logits_V),
          jax.nn.log_softmax(logits_V + scale * jnp.asarray(direction_V, jnp.float32)))


def per_token_logit_grads(logp_V: jax.Array, logq_V: jax.Array, cfg: LossConfig, adv: float = 1.0) -> jax.Array:
  """g_YV: row y is d ell(y) / d z, the gradient in logit space of one token's loss when y is sampled.

  Every y of the vocabulary is one row of a batch through `rl_loss` itself (with the method,
  score centering and top-k of `cfg`), at theta = theta_old (log p_old = log p) and advantage
  `adv`; the sampler's top-k head is the top-`cfg.topk` of q ('full' uses all V ids).
  """
  logp_V = jnp.asarray(logp_V, jnp.float32)
  logq_V = jnp.asarray(logq_V, jnp.float32)
  v = logp_V.shape[0]
  if cfg.aggregation != "constant":
    raise ValueError(f"per_token_logit_grads needs loss.aggregation='constant' (one token per row, "
                     f"sum / V), got {cfg.aggregation!r}")
  k = v if cfg.score_centering == "full" else min(cfg.topk, v)
  top_logq_K, top_ids_K = jax.lax.top_k(logq_V, k)
  targets_B1 = jnp.arange(v, dtype=jnp.int32)[:, None]
  kw = {}
  if cfg.score_centering != "none":
    kw = dict(topk_ids_BTK=jnp.broadcast_to(top_ids_K, (v, 1, k)),
              topk_logq_BTK=jnp.broadcast_to(top_logq_K, (v, 1, k)))

  def total(z_B1V):
    loss, _ = rl_loss(z_B1V, targets_B1, jnp.ones((v, 1), bool), jnp.full((v,), adv, jnp.float32),
                      logq_V[:, None], cfg, logp_old_BT=logp_V[:, None], **kw)
    return loss

  z_B1V = jnp.broadcast_to(logp_V, (v, 1, v))
  # 'constant' aggregation divides the sum over the V rows by V; rows are independent.
  return jax.grad(total)(z_B1V)[:, 0, :] * v


def drift_and_variance(g_YV: jax.Array, logq_V: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(E_q[g] (the drift vector [V]), E_q ||g - E_q g||^2 (the per-token gradient variance)), exactly."""
  q_V = jnp.exp(jnp.asarray(logq_V, jnp.float32))
  mean_V = q_V @ g_YV
  return mean_V, q_V @ jnp.sum((g_YV - mean_V) ** 2, axis=-1)


def drift_sweep(logits_V: jax.Array, direction_V: jax.Array, scales: Sequence[float],
                cfgs: Mapping[str, LossConfig], adv: float = 1.0) -> dict[str, dict[str, np.ndarray]]:
  """For each named loss config: ||drift||, gradient variance and TV(q, p) at every mismatch scale.

  With a constant advantage the on-policy expected update is 0 (E_p[score] = 0); what
  survives under mismatch is the drift the loss leaves in the update.
  """
  out = {name: {"drift_norm": [], "variance": [], "tv": []} for name in cfgs}
  for s in scales:
    logp_V, logq_V = mismatched_pair(logits_V, direction_V, s)
    tv = float(0.5 * jnp.sum(jnp.abs(jnp.exp(logp_V) - jnp.exp(logq_V))))
    for name, cfg in cfgs.items():
      drift_V, var = drift_and_variance(per_token_logit_grads(logp_V, logq_V, cfg, adv), logq_V)
      out[name]["drift_norm"].append(float(jnp.linalg.norm(drift_V)))
      out[name]["variance"].append(float(var))
      out[name]["tv"].append(tv)
  return {n: {k: np.asarray(v) for k, v in d.items()} for n, d in out.items()}


def tail_reconstruction(logp_V: jax.Array, logq_V: jax.Array, k: int, eps: float = 1e-6) -> dict[str, np.ndarray]:
  """Top-k score centering's model of the sampler outside its head H: q_v ~ rho p_v on the tail.

  rho = max(1 - sum_H q, eps) / max(1 - sum_H p, eps) (the floor of `LossConfig.sc_eps`).
  Returns ids sorted by q (head first), q, p, the reconstruction (q on H, rho p on the tail),
  rho and the head mask. The tail's total mass is right by construction; its shape is exact
  only when q is proportional to p there.
  """
  logp_V = jnp.asarray(logp_V, jnp.float32)
  logq_V = jnp.asarray(logq_V, jnp.float32)
  order = jnp.argsort(-logq_V)
  q, p = jnp.exp(logq_V[order]), jnp.exp(logp_V[order])
  head = jnp.arange(q.shape[0]) < k
  rho = jnp.maximum(1 - jnp.sum(jnp.where(head, q, 0)), eps) / jnp.maximum(1 - jnp.sum(jnp.where(head, p, 0)), eps)
  recon = jnp.where(head, q, rho * p)
  return {k_: np.asarray(v) for k_, v in dict(ids=order, q=q, p=p, reconstructed_q=recon, rho=rho,
                                              head=head).items()}


# --- Train / inference mismatch of the sampler, per regime (docs/math.md#mismatch-sources) -----------


# [L]: per MoE layer, the fraction of (token, slot) whose sampler expert is among the trainer's top-k
# (the replay probe computes it inside its program).
routing_agreement_per_layer = programs_lib.routing_agreement_per_layer


def mismatch_stats(graphdef: nnx.GraphDef, params: Any, ro: rollout_lib.Rollout, temperature: float,
                   head_k: int) -> dict[str, float]:
  """KL(q || p) per token (k1, k3 and, when the sampler recorded the whole vocabulary, exact),
  the mass of p and of q on the sampler's top-`head_k` ids, and the routing agreement.

  p is the fp32 trainer at the same weights on the sampled tokens; the top-k recorded by the
  sampler must be at least `head_k` long.
  """
  out = nnx.merge(graphdef, params)(ro.tokens_BS, ro.positions_BS, ro.valid_BS)
  logp_BT, logp_at_BTK = rollout_lib.trainer_logprobs(out.logits_BSV, ro, temperature)
  mask = ro.response_mask_BT
  log_x = logp_BT - ro.logq_BT
  res = {"kl_k1": step_lib.masked_mean(-log_x, mask),
         "kl_k3": step_lib.masked_mean(jnp.exp(log_x) - 1.0 - log_x, mask)}
  if ro.topk_logq_BTK is not None:
    if ro.topk_logq_BTK.shape[-1] < head_k:
      raise ValueError(f"head_k={head_k} exceeds the sampler's record_topk={ro.topk_logq_BTK.shape[-1]}")
    res["head_mass_q"] = step_lib.masked_mean(jnp.exp(ro.topk_logq_BTK[..., :head_k]).sum(-1), mask)
    res["head_mass_p"] = step_lib.masked_mean(jnp.exp(logp_at_BTK[..., :head_k]).sum(-1), mask)
    if ro.topk_logq_BTK.shape[-1] == out.logits_BSV.shape[-1]:
      q_BTK = jnp.exp(ro.topk_logq_BTK)
      res["kl_exact"] = step_lib.masked_mean((q_BTK * (ro.topk_logq_BTK - logp_at_BTK)).sum(-1), mask)
  if ro.expert_ids_BSLK is not None and out.expert_ids_BSLK is not None:
    res["routing_agreement"] = step_lib.routing_agreement(out.expert_ids_BSLK, ro.expert_ids_BSLK,
                                                          ro.expert_valid_BS)
  return {k: float(v) for k, v in res.items()}


def sample(model_cfg: Any, params: Any, ids_BP: jax.Array, valid_BP: jax.Array, key: jax.Array,
           cfg: SamplerConfig, noise_key: jax.Array | None = None) -> rollout_lib.Rollout:
  """One rollout from the sampler `cfg` builds out of `params` (its noise, quantization and dtype):
  the trainer's sync and generate programs (`programs.build_local`)."""
  progs = programs_lib.build_local(model=model_cfg, sampler=cfg)
  delta = None
  if cfg.noise != "none":
    delta = sampler_weights.make_noise(params, cfg.noise, cfg.noise_sigma,
                                       noise_key if noise_key is not None else jax.random.key(1))
  return progs.sampler.generate(progs.sampler.sync(params, delta), ids_BP, valid_BP, key)


def regimes(presets: Sequence[str], noise_sigmas: Sequence[float], base: SamplerConfig,
            noise_mode: str = "relative") -> dict[str, SamplerConfig]:
  """Named sampler configs: one per quantization preset, then one fp32 sampler per weight-noise level."""
  out = {p: dataclasses.replace(base, quant=p, noise="none", noise_sigma=0.0) for p in presets}
  for s in noise_sigmas:
    out[f"noise {noise_mode} {s:g}"] = dataclasses.replace(base, quant="none", noise=noise_mode, noise_sigma=s)
  return out


def mismatch_by_regime(model_cfg: Any, graphdef: nnx.GraphDef, params: Any, ids_BP: jax.Array,
                       valid_BP: jax.Array, samplers: Mapping[str, SamplerConfig], key: jax.Array,
                       head_k: int = 8) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
  """`mismatch_stats` of each named sampler against the fp32 trainer, all from the same prompts and key.

  Returns (stats by regime, skipped): a regime the model's shapes cannot take (e.g. a block size
  that does not divide head_dim or a contraction dim: a ConfigError naming the key) is skipped,
  with the error as the reason, instead of ending the sweep.
  """
  stats, skipped = {}, {}
  for name, cfg in samplers.items():
    try:
      ro = sample(model_cfg, params, ids_BP, valid_BP, key, cfg)
    except ConfigError as e:
      skipped[name] = str(e)
      continue
    stats[name] = mismatch_stats(graphdef, params, ro, cfg.temperature, head_k)
  return stats, skipped


# --- Routing replay over N mini-batches (docs/math.md#routing-replay) -----------------------


def replay_trajectory(graphdef: nnx.GraphDef, params: Any, opt_state: Any, ro: rollout_lib.Rollout,
                      adv_B: jax.Array, *, loss_cfg: LossConfig, optimizer: Any, replay: step_lib.Replay,
                      n_minibatches: int, aux_coef: float = 0.0) -> dict[str, np.ndarray]:
  """One global step of the trainer, N mini-batch updates, probed before each update.

  As `rl_jax.rl.trainer` does it, with its programs (`programs.build_local`): `LearnerPrograms.prepare`
  (p_old under the replay's routing, the replay ids: R2 theta_old's own experts, R3 the
  sampler's), then the update per mini-batch. Before mini-batch i's update, at theta_i (i
  updates in), it records over that mini-batch's response tokens the IS log-ratio
  log p_theta_i - log q and the staleness log-ratio log p_theta_i - log p_old (mean |.| and
  max |.|), and per MoE layer the agreement of the trainer's own routing at theta_i with the
  sampler's. Returns arrays of length N (per-layer ones [N, L]) and the p_old forward's metrics.
  `params` and `opt_state` are left as they were (the update donates copies).
  """
  if ro.expert_ids_BSLK is None:
    raise ValueError("replay_trajectory needs a MoE rollout with recorded experts (sampler.record_experts)")
  if ro.tokens_BS.shape[0] % n_minibatches:
    raise ValueError(f"rl.n_minibatches={n_minibatches} does not divide the {ro.tokens_BS.shape[0]} rows")
  progs = programs_lib.build_local(graphdef, loss_cfg, replay=replay, optimizer=optimizer, aux_coef=aux_coef)
  # The trainer's update donates params and optimizer state: it gets copies, the caller keeps its own.
  params, opt_state = jax.tree.map(jnp.copy, (params, opt_state))
  batch, old_m = progs.learner.prepare(params, ro, adv_B)
  rows = batch.rows // n_minibatches
  rec = {k: [] for k in ("is_abs_mean", "is_abs_max", "stale_abs_mean", "stale_abs_max", "agreement_L", "loss")}
  for i in range(n_minibatches):
    sl = slice(i * rows, (i + 1) * rows)
    mb = batch.slice_rows(sl.start, sl.stop)
    logp_BT, agree_L = progs.learner.probe(params, mb, ro.expert_ids_BSLK[sl], ro.expert_valid_BS[sl])
    mask = mb.response_mask_BT
    for name, d_BT in (("is", logp_BT - mb.logq_BT), ("stale", logp_BT - mb.logp_old_BT)):
      a_BT = jnp.abs(d_BT)
      rec[f"{name}_abs_mean"].append(float(step_lib.masked_mean(a_BT, mask)))
      rec[f"{name}_abs_max"].append(float(jnp.max(jnp.where(mask, a_BT, 0.0))))
    rec["agreement_L"].append(np.asarray(agree_L))
    params, opt_state, m = progs.learner.update(params, opt_state, mb)
    rec["loss"].append(float(m["loss"]))
  out = {k: np.asarray(v) for k, v in rec.items()}
  out["old_forward"] = {k: float(v) for k, v in old_m.items()}
  return out


def token_logprobs(graphdef: nnx.GraphDef, params: Any, ro: rollout_lib.Rollout,
                   temperature: float) -> tuple[np.ndarray, np.ndarray]:
  """(log q(y_t), log p(y_t)) of every real response token, on the host: the sampler's and the fp32 trainer's."""
  out = nnx.merge(graphdef, params)(ro.tokens_BS, ro.positions_BS, ro.valid_BS)
  logp_BT, _ = rollout_lib.trainer_logprobs(out.logits_BSV, ro, temperature)
  mask = np.asarray(ro.response_mask_BT)
  return np.asarray(ro.logq_BT)[mask], np.asarray(logp_BT)[mask]


def trainer_routing_agreement(graphdef: nnx.GraphDef, params: Any, ro: rollout_lib.Rollout) -> np.ndarray:
  """[L]: per MoE layer, how often the fp32 trainer's own routing keeps the sampler's experts."""
  if ro.expert_ids_BSLK is None:
    raise ValueError("trainer_routing_agreement needs a MoE rollout with sampler.record_experts=True")
  out = nnx.merge(graphdef, params)(ro.tokens_BS, ro.positions_BS, ro.valid_BS)
  return np.asarray(routing_agreement_per_layer(out.expert_ids_BSLK, ro.expert_ids_BSLK, ro.expert_valid_BS))
