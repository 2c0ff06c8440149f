"""Per-source mismatch attribution: a step's sampled tokens teacher-forced through one-source samplers.

docs/math.md#mismatch-attribution. The reference is the trainer at the p_old forward's weights,
routing on its own. Each variant is the sampler with one of the run's mismatch sources switched
on (its weight format, activation format, KV-cache format, compute dtype, weight noise or stale
weights) and the rest off, run as the sampler runs it (quantized weights, a KV cache written and
read in the sampler's format) over the rollout's tokens in one teacher-forced pass; `total` is the
run's own sampler. Per variant, over the response tokens: KL(q_s || p) and TV exactly over the
vocabulary, k1 / k3 at the sampled tokens (the estimators the run's `mismatch/*` meters use) and,
for an MoE model, the agreement of the variant's routing with the trainer's.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl_jax.logprobs import next_token_logq
from rl_jax.models.kv_cache import init_cache
from rl_jax.models.layers import dtype_of
from rl_jax.quant.config import QuantConfig
from rl_jax.rl.step import masked_mean, routing_hits
from rl_jax.rollout import Rollout, response_slice
from rl_jax.sampler import weights as sampler_weights
from rl_jax.sampler.config import SamplerConfig

STATS = ("kl", "tv", "k1", "k3")
# The variant that replays the trainer's routes into the run's sampler: total minus it is the
# share of the total that routing flips carry.
TRAINER_ROUTES = "total_trainer_routes"
# |teacher-forced - recorded log q| of one token that float32 rounding alone explains on these
# programs (two orders of the same sums; ~1e-6 measured): `logq_err_frac` counts the tokens past it.
LOGQ_ROUNDING = 1e-5


@dataclasses.dataclass(frozen=True)
class Variant:
  """One teacher-forced sampler: its quantization, compute dtype, and whether it adds the run's
  weight noise, runs the stale weights, or replays the trainer's own experts (routing off)."""
  quant: QuantConfig
  dtype: str
  noise: bool = False
  stale: bool = False
  trainer_routes: bool = False

  @property
  def kv_spec(self):
    return self.quant.kv if self.quant.kv.format != "fp32" else None


def variants(sampler: SamplerConfig, model_dtype: str, stale: bool, moe: bool) -> dict[str, Variant]:
  """The run's mismatch sources, one variant each, then `total` (the run's sampler) and, for an
  MoE model, `total_trainer_routes`. A source that is off in the run has no variant.

  Activation quantization runs inside the quantized matmul, so it has no variant alone: its
  variant is `weights+activations`, and its share is that minus `weights` (`contributions`).
  """
  q = sampler.quant
  common = dict(backend=q.backend, quantize_lm_head=q.quantize_lm_head)
  clean = QuantConfig(**common)
  out = {}
  if q.weights.format != "fp32":
    out["weights"] = Variant(QuantConfig(weights=q.weights, **common), model_dtype)
  if q.activations.format != "fp32":
    out["weights+activations"] = Variant(QuantConfig(weights=q.weights, activations=q.activations, **common),
                                         model_dtype)
  if q.kv.format != "fp32":
    out["kv"] = Variant(QuantConfig(kv=q.kv, **common), model_dtype)
  if sampler.dtype != model_dtype:
    out["dtype"] = Variant(clean, sampler.dtype)
  if sampler.noise != "none":
    out["noise"] = Variant(clean, model_dtype, noise=True)
  if stale:
    out["staleness"] = Variant(clean, model_dtype, stale=True)
  out["total"] = Variant(q, sampler.dtype, noise=sampler.noise != "none", stale=stale)
  if moe:
    out[TRAINER_ROUTES] = dataclasses.replace(out["total"], trainer_routes=True)
  return out


def _divergences(logq_BTV, logp_BTV, y_BT, mask_BT) -> dict[str, jax.Array]:
  """Means over response tokens of KL(q || p), TV (exact over V) and k1, k3 at the tokens y."""
  q_BTV, p_BTV = jnp.exp(logq_BTV), jnp.exp(logp_BTV)
  # q log(q / p) is 0 where q underflows to 0 (its log is then -inf).
  kl_BT = jnp.sum(jnp.where(q_BTV > 0, q_BTV * (logq_BTV - logp_BTV), 0.0), axis=-1)
  tv_BT = 0.5 * jnp.sum(jnp.abs(q_BTV - p_BTV), axis=-1)
  at = lambda x_BTV: jnp.take_along_axis(x_BTV, y_BT[..., None], axis=-1)[..., 0]
  d_BT = at(logq_BTV) - at(logp_BTV)  # log q(y) - log p(y): k1's summand, as mismatch/kl_k1
  return dict(kl=masked_mean(kl_BT, mask_BT), tv=masked_mean(tv_BT, mask_BT), k1=masked_mean(d_BT, mask_BT),
              k3=masked_mean(jnp.expm1(-d_BT) + d_BT, mask_BT))


def attribute(ref_params, stale_params, noise, ro: Rollout, *, graphdef: nnx.GraphDef,
              variant_graphs: tuple[tuple[str, Variant, nnx.GraphDef], ...], temperature: float) -> dict:
  """The traceable attribution of `ro`'s rows (the jit is `programs.LearnerPrograms.attribution`).

  ref_params: the trainer's weights of the p_old forward; stale_params: the weights the sampler
  was synced from (None without staleness); noise: the run's weight-noise offsets (None without).
  Returns `{variant: {stat: scalar}}`, plus `routing_agreement` per free-routing MoE variant and
  `logq_err_max` for `total`: the largest |teacher-forced log q(y) - the recorded log q(y)|, how
  closely the one-pass teacher forcing reproduces what the sampler computed token by token, and
  `logq_err_frac`: the share of response tokens where that exceeds `LOGQ_ROUNDING`.
  """
  b, s = ro.tokens_BS.shape
  valid_BS = ro.valid_BS
  y_BT, mask_BT = ro.response_BT, ro.response_mask_BT
  ref = nnx.merge(graphdef, ref_params)(ro.tokens_BS, ro.positions_BS, valid_BS)
  logp_BTV = response_slice(next_token_logq(ref.logits_BSV, temperature), ro)
  out = {}
  for name, v, vgraph in variant_graphs:
    src = stale_params if v.stale else ref_params
    state = sampler_weights.sync_weights(src, noise if v.noise else None, v.quant, v.dtype)
    model = nnx.merge(vgraph, state)
    cache = init_cache(model.cfg, b, s, dtype_of(v.dtype), v.kv_spec, backend=v.quant.backend)
    kw = {}
    if v.trainer_routes:
      kw = dict(replay_ids_BSLK=ref.expert_ids_BSLK, replay_mask_BS=valid_BS)
    # One pass over the whole buffer through the cache: K/V are written in the sampler's format and
    # read back from it, as each decode step reads them.
    o = model(ro.tokens_BS, ro.positions_BS, valid_BS, cache=cache, cache_index=0, kv_valid_BC=valid_BS, **kw)
    logq_BTV = response_slice(next_token_logq(o.logits_BSV, temperature), ro)
    stats = _divergences(logq_BTV, logp_BTV, y_BT, mask_BT)
    if ref.expert_ids_BSLK is not None and not v.trainer_routes:
      hits, slots = routing_hits(ref.expert_ids_BSLK, o.expert_ids_BSLK, ro.expert_valid_BS)
      stats["routing_agreement"] = hits / jnp.maximum(slots, 1.0)
    if name == "total":
      logq_y = jnp.take_along_axis(logq_BTV, y_BT[..., None], axis=-1)[..., 0]
      err_BT = jnp.where(mask_BT, jnp.abs(logq_y - ro.logq_BT), 0.0)
      stats["logq_err_max"] = jnp.max(err_BT)
      # Beyond float rounding: a quantizer (int8 activations, an int4 KV cache) whose input the
      # one-pass forward rounds differently from the token-by-token decode lands one step away.
      stats["logq_err_frac"] = (jnp.sum(err_BT > LOGQ_ROUNDING) /
                                jnp.maximum(jnp.sum(mask_BT), 1)).astype(jnp.float32)
    out[name] = stats
  return out


def contributions(raw: dict[str, dict[str, float]]) -> dict[str, float]:
  """`attribution/*` metrics from `attribute`'s host values.

  Per source its variant's stats (`activations`: `weights+activations` minus `weights`, the share
  activation quantization adds); `sum` over the sources of kl and tv; `interaction` = total -
  sum (what the sources do together beyond their separate effects; exactly 0 with one source);
  `routing` = total - total_trainer_routes (the share of the total carried by routing flips: the
  run's sampler with and without the trainer's experts replayed into it).
  """
  m, shares = {}, {}
  for name, stats in raw.items():
    if name == TRAINER_ROUTES:
      continue
    key = "activations" if name == "weights+activations" else name
    vals = dict(stats)  # `activations/routing_agreement` stays the weights+activations sampler's
    if key == "activations":
      vals.update({st: stats[st] - raw["weights"][st] for st in STATS})
    m.update({f"attribution/{key}/{k}": float(x) for k, x in vals.items()})
    if key != "total":
      shares[key] = vals
  total = raw["total"]
  for st in ("kl", "tv"):
    s = float(sum(v[st] for v in shares.values()))
    m[f"attribution/sum/{st}"] = s
    m[f"attribution/interaction/{st}"] = float(total[st]) - s
    if TRAINER_ROUTES in raw:
      m[f"attribution/routing/{st}"] = float(total[st]) - float(raw[TRAINER_ROUTES][st])
  return m


def sources(metrics: dict[str, Any]) -> list[str]:
  """The source names present in a metrics row (`attribution/<source>/kl`), in the logged order."""
  return [k.split("/")[1] for k in metrics if k.startswith("attribution/") and k.endswith("/kl")]


def to_host(tree) -> dict:
  return jax.tree.map(lambda x: float(np.asarray(x)), tree)
