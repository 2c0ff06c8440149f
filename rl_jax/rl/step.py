"""Pure RL step functions over a typed TrainBatch: the theta_old forward, the loss and one update.

Module-level so a notebook can import and jit them: every config argument is keyword-only and
hashable (`jax.jit(step.loss_fn, static_argnames=STATIC)`), the arrays are positional.
"""
from __future__ import annotations

import functools
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rl_jax import rollout as rollout_lib
from rl_jax.logprobs import chunked_logprobs, gather_logprobs, truncated_logprobs
from rl_jax.models.transformer import constrain_batch
from rl_jax.rl import meters
from rl_jax import microbatch
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.rl.loss.loss_diagnostics import finalize_stats, reduce_stacked
from rl_jax.rl.loss.losses import kept_set_args, normalizer, rl_loss, rl_loss_from_hidden

# Routing replay (docs/math.md#routing-replay): 'none', 'R2' (theta_old's own experts), 'R3' (the
# sampler's); the one type of `rl.routing_replay` (rl/job.py) and of the programs' `replay`.
Replay = Literal["none", "R2", "R3"]
# Keyword arguments of the step functions that are configuration (static under jit).
STATIC = ("graphdef", "loss_cfg", "aux_coef", "optimizer", "replay", "microbatches")


@flax.struct.dataclass
class TrainBatch:
  """What one global step trains on, rows = responses (B), laid out as `rl_jax.rollout.Rollout`.

  `logp_old_BT` is filled by `old_forward`, or, with `old_in_update`, by the update's own forward
  (`_forward_with_old`: its log-probs under stop-gradient, where the p_old forward is provably that
  forward: p_old at the update's params, one update per step; `RLJob.old_in_update`), which then
  also reports the `mismatch/*` metrics, against the sampler's experts `sampler_ids_BSLK` where
  recorded. `replay_*` only under routing replay (R2: the
  trainer's own theta_old experts, R3: the sampler's); top-k fields whenever the sampler
  recorded them (`sampler.record_topk` > 0): score centering reads them and the drift meter
  (`drift/*`) compares them with the trainer's distribution. Optional fields are None when
  absent (empty pytree nodes).

  Under `loss.sampling_mask='kept_set'` (`from_rollout(truncated=True)`; docs/math.md#truncated-sampling)
  `logq_BT` and `topk_logq_BTK` are the sampler's truncated, renormalized log-probs (-1e30 at head
  ids outside its kept set), `trunc_thresh_BT` the kept set's threshold tau and `trunc_covered_BT`
  whether the recorded head holds the whole kept set (then the trainer rebuilds it exactly from
  the head; elsewhere by the threshold on its own log-probs).
  """
  prompt_len: int = flax.struct.field(pytree_node=False)
  tokens_BS: jax.Array
  positions_BS: jax.Array
  valid_BS: jax.Array
  response_BT: jax.Array
  response_mask_BT: jax.Array
  logq_BT: jax.Array
  adv_B: jax.Array
  logp_old_BT: jax.Array | None = None
  topk_ids_BTK: jax.Array | None = None
  topk_logq_BTK: jax.Array | None = None
  replay_ids_BSLK: jax.Array | None = None  # compact: rollout.expert_id_dtype(n_experts)
  replay_mask_BS: jax.Array | None = None
  trunc_thresh_BT: jax.Array | None = None
  trunc_covered_BT: jax.Array | None = None
  old_in_update: bool = flax.struct.field(pytree_node=False, default=False)
  sampler_ids_BSLK: jax.Array | None = None  # only with old_in_update: the routing agreement's
  sampler_valid_BS: jax.Array | None = None

  @classmethod
  def from_rollout(cls, ro: rollout_lib.Rollout, adv_B: jax.Array, with_topk: bool = True,
                   truncated: bool = False) -> "TrainBatch":
    """The batch of a rollout; `truncated` (`loss.sampling_mask='kept_set'`) takes the sampler's
    truncated policy as q (its `trunc_*` record; an error if the rollout has none)."""
    topk = with_topk and ro.topk_ids_BTK is not None
    logq_BT = ro.logq_BT
    topk_logq_BTK = ro.topk_logq_BTK if topk else None
    trunc = {}
    if truncated:
      if ro.trunc_thresh_BT is None:
        raise ValueError("loss.sampling_mask='kept_set' needs a rollout of a truncating sampler "
                         "(sampler.top_k > 0 or sampler.top_p < 1): this one recorded no kept sets")
      tau_BT, mass_BT = ro.trunc_thresh_BT, ro.trunc_logmass_BT
      logq_BT = logq_BT - mass_BT  # 0 at padding, where the mass is recorded as 0
      covered_BT = jnp.zeros(tau_BT.shape, bool)
      if topk:
        # q~ = q / q(K) on K, 0 elsewhere: -1e30 (not -inf) keeps exp and differences finite.
        topk_logq_BTK = jnp.where(topk_logq_BTK >= tau_BT[..., None], topk_logq_BTK - mass_BT[..., None],
                                  -1e30)
        covered_BT = ro.trunc_size_BT <= ro.topk_ids_BTK.shape[-1]
      trunc = dict(trunc_thresh_BT=tau_BT, trunc_covered_BT=covered_BT)
    return cls(prompt_len=ro.prompt_len, tokens_BS=ro.tokens_BS, positions_BS=ro.positions_BS,
               valid_BS=ro.valid_BS, response_BT=ro.response_BT, response_mask_BT=ro.response_mask_BT,
               logq_BT=logq_BT, adv_B=adv_B, topk_ids_BTK=ro.topk_ids_BTK if topk else None,
               topk_logq_BTK=topk_logq_BTK, **trunc)

  @property
  def rows(self) -> int:
    return self.tokens_BS.shape[0]

  def slice_rows(self, start: int, stop: int) -> "TrainBatch":
    return jax.tree.map(lambda x: x[start:stop], self)

  def response_slots(self, x_BS: jax.Array) -> jax.Array:
    """The logits-aligned response slots of a forward over `tokens_BS` (see `rollout.response_slice`)."""
    return rollout_lib.response_slots(x_BS, self.prompt_len, self.logq_BT.shape[1])


def masked_mean(x, mask):
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def routing_hits(trainer_ids_BSLK, sampler_ids_BSLK, valid_BS) -> tuple[jax.Array, jax.Array]:
  """(hits, slots): (token, MoE layer, slot) triples where the sampler's expert is among the
  trainer's top-k, and all such triples at valid tokens."""
  hit = jnp.any(sampler_ids_BSLK[..., :, None] == trainer_ids_BSLK[..., None, :], axis=-1)
  mask = jnp.broadcast_to(valid_BS[:, :, None, None], hit.shape).astype(jnp.float32)
  return jnp.sum(hit.astype(jnp.float32) * mask), jnp.sum(mask)


def routing_agreement(trainer_ids_BSLK, sampler_ids_BSLK, valid_BS):
  """Fraction of (token, MoE layer, slot) where the sampler's expert is among the trainer's top-k."""
  hits, slots = routing_hits(trainer_ids_BSLK, sampler_ids_BSLK, valid_BS)
  return hits / jnp.maximum(slots, 1.0)


def _forward(model, batch: TrainBatch, **kw):
  # Hidden states only: the head runs at the T response slots alone (`_response_logits`),
  # not at all S positions. Slicing [B, S, V] logits instead costs the prompt slots' share
  # of the unembedding matmuls and, in the backward, a padded [B, S, V] cotangent.
  return model(batch.tokens_BS, batch.positions_BS, batch.valid_BS, return_hidden=True,
               compute_logits=False, **kw)


def _response_logits(model, out, batch: TrainBatch) -> jax.Array:
  """Float32 logits [B, T, V] at the response slots (unchunked losses)."""
  return model.logits(batch.response_slots(out.hidden_BSD))


def _replay_kw(batch: TrainBatch) -> dict:
  """Routing replay is on iff `batch.replay_ids_BSLK` is set."""
  if batch.replay_ids_BSLK is None:
    return {}
  return dict(replay_ids_BSLK=batch.replay_ids_BSLK, replay_mask_BS=batch.replay_mask_BS)


def _trunc(batch: TrainBatch, loss_cfg: LossConfig) -> dict:
  """The kept-set arguments of the loss under `loss.sampling_mask='kept_set'`, else nothing."""
  if not loss_cfg.kept_set_mask:
    return {}
  return dict(trunc_thresh_BT=batch.trunc_thresh_BT, trunc_covered_BT=batch.trunc_covered_BT)


def _sampled_logp(model, out, batch: TrainBatch, loss_cfg: LossConfig) -> jax.Array:
  """log p of the sampled tokens [B, T] from a forward's output, with the function the loss uses.

  Under `loss.sampling_mask='kept_set'` the truncated policy's log p~, and -inf where the token
  lies outside the kept set rebuilt from these logits (p~ = 0 there; the loss masks it).
  """
  targets_BT1 = batch.response_BT[..., None]
  temp = loss_cfg.temperature
  trunc = kept_set_args(loss_cfg, batch.trunc_thresh_BT, batch.trunc_covered_BT, batch.topk_ids_BTK,
                        batch.topk_logq_BTK, *batch.response_BT.shape)
  if loss_cfg.chunk_size > 0:
    hidden_BTD = batch.response_slots(out.hidden_BSD)
    outs = chunked_logprobs(hidden_BTD, model.unembed_weight(), targets_BT1, temp, loss_cfg.chunk_size, trunc)
  elif trunc is None:
    # The function the loss computes log p with (chunked or not): p_old and p agree in form.
    outs = gather_logprobs(_response_logits(model, out, batch), targets_BT1, temp)
  else:
    outs = truncated_logprobs(_response_logits(model, out, batch), targets_BT1, temp, *trunc)
  logp_BT = outs[0][..., 0]
  return logp_BT if trunc is None else jnp.where(outs[2][..., 0], logp_BT, -jnp.inf)


def _rl_loss(model, out, batch: TrainBatch, loss_cfg: LossConfig, norm=None, return_stats=False):
  """The RL loss (no load-balancing term) of a forward's output and its metrics (or, with
  `return_stats`, their sufficient statistics); `norm`: the whole mini-batch's aggregation
  denominator when `batch` is one micro-batch of it."""
  args = (batch.response_BT, batch.response_mask_BT, batch.adv_B, batch.logq_BT, loss_cfg)
  opt = dict(logp_old_BT=batch.logp_old_BT, topk_ids_BTK=batch.topk_ids_BTK,
             topk_logq_BTK=batch.topk_logq_BTK, norm=norm, return_stats=return_stats,
             **_trunc(batch, loss_cfg))
  if loss_cfg.chunk_size > 0:
    return rl_loss_from_hidden(batch.response_slots(out.hidden_BSD), model.unembed_weight(), *args, **opt)
  return rl_loss(_response_logits(model, out, batch), *args, **opt)


def old_forward(params, batch: TrainBatch, sampler_ids_BSLK=None, sampler_valid_BS=None, *,
                graphdef: nnx.GraphDef, loss_cfg: LossConfig, replay: Replay = "none", microbatches: int = 1):
  """theta_old's log-probs of the sampled tokens, its own routing and the mismatch metrics.

  p_old is computed under the same routing as the updates will use, so that at theta =
  theta_old every staleness ratio pi_theta / pi_theta_old is exactly 1: 'none' and R2 on the
  trainer's own routing, R3 replaying the sampler's experts (`sampler_ids_BSLK` where
  `sampler_valid_BS`). The `mismatch/*` metrics compare the sampler's q with this p_old.
  `microbatches` > 1 runs the forward over that many strided row micro-batches in a `lax.scan`
  (`rl_jax.microbatch`; `rl.forward_microbatch`): the same numbers, one micro-batch's
  activations live at a time.

  Returns (logp_old_BT, own_ids_BSLK or None, metrics): `own_ids_BSLK` are the experts the
  trainer itself routes to (R2 replays them), in `rollout.expert_id_dtype` like the sampler's.
  """
  if replay == "R3" and sampler_ids_BSLK is None:
    raise ValueError("routing_replay='R3' needs the sampler's expert ids (sampler.record_experts)")
  fwd = lambda b, ids, valid: _old_forward_rows(params, b, ids, valid, graphdef=graphdef,
                                                loss_cfg=loss_cfg, replay=replay)
  if microbatches == 1:
    logp_old_BT, own_ids_BSLK, st = fwd(batch, sampler_ids_BSLK, sampler_valid_BS)
  else:
    xs = microbatch.split((batch, sampler_ids_BSLK, sampler_valid_BS), microbatches)
    _, (logp_old_BT, own_ids_BSLK, st) = jax.lax.scan(lambda c, x: (c, fwd(*x)), None, xs)
    logp_old_BT, own_ids_BSLK = microbatch.merge((logp_old_BT, own_ids_BSLK))
    st = reduce_stacked(st)
  return logp_old_BT, own_ids_BSLK, _mismatch_metrics(st)


def _mismatch_metrics(st: dict) -> dict:
  """`mismatch/*` from `_old_forward_rows`' sums over response tokens (and routed slots)."""
  n = jnp.maximum(st["sum/_tokens"], 1.0)
  m = {f"mismatch/{k}": st[f"sum/{k}"] / n for k in ("kl_k1", "kl_k3", "prob_diff_mean")}
  m["mismatch/prob_diff_max"] = jnp.maximum(st["max/prob_diff_max"], 0.0)
  if "sum/_outside" in st:
    m["mismatch/sampling_outside_frac"] = st["sum/_outside"] / jnp.maximum(st["sum/_tokens"] + st["sum/_outside"], 1.0)
  if "sum/_route_hits" in st:
    m["mismatch/routing_agreement"] = st["sum/_route_hits"] / jnp.maximum(st["sum/_route_slots"], 1.0)
  return m


def _old_forward_rows(params, batch: TrainBatch, sampler_ids_BSLK, sampler_valid_BS, *,
                      graphdef: nnx.GraphDef, loss_cfg: LossConfig, replay: Replay):
  """`old_forward` on one set of rows: (logp_old_BT, own_ids_BSLK, sums for `_mismatch_metrics`)."""
  model = nnx.merge(graphdef, params)
  r3 = replay == "R3"
  kw = {}
  if r3:
    kw = dict(replay_ids_BSLK=sampler_ids_BSLK, replay_mask_BS=sampler_valid_BS, return_router_logits=True)
  out = _forward(model, batch, **kw)
  return _old_outputs(model, out, batch, sampler_ids_BSLK, sampler_valid_BS, loss_cfg, r3)


def _old_outputs(model, out, batch: TrainBatch, sampler_ids_BSLK, sampler_valid_BS, loss_cfg: LossConfig,
                 r3: bool):
  """(logp_old_BT, own_ids_BSLK, sums for `_mismatch_metrics`) of a forward at theta_old (`out`;
  with router logits under R3)."""
  logp_old_BT = _sampled_logp(model, out, batch, loss_cfg)
  own_ids_BSLK = out.expert_ids_BSLK
  if r3 and own_ids_BSLK is not None:
    # Under replay the model reports the replayed ids, but the agreement diagnostic is about
    # the trainer's own routing. Its router logits on this same forward give it without a
    # second forward: the per-layer top-k of the same softmax `moe.route` takes. Deeper layers
    # see hidden states shaped by the replayed experts of earlier ones, so this is the
    # layer-local agreement (identical at the first MoE layer); a second, un-replayed forward
    # only for a diagnostic would cost as much as the p_old forward itself.
    # Batch-sharded like the residual stream: unconstrained, GSPMD gathered the global batch's
    # [B, S, L, E] router probabilities on every device for the top-k (the 30B plan: 120 GiB).
    probs_BSLE = constrain_batch(jax.nn.softmax(out.router_logits_BSLE.astype(jnp.float32), axis=-1))
    own_ids_BSLK = jax.lax.top_k(probs_BSLE, own_ids_BSLK.shape[-1])[1]
  if own_ids_BSLK is not None:  # stored compact like the sampler's (R2 replays them)
    own_ids_BSLK = own_ids_BSLK.astype(rollout_lib.expert_id_dtype(model.cfg.n_experts))
  mask = batch.response_mask_BT.astype(jnp.float32)
  # Under sampling_mask='kept_set' a token outside theta_old's rebuilt kept set has p~_old = 0
  # (-inf): the updates mask it; the mismatch metrics are over the others, and count it.
  inside = jnp.isfinite(logp_old_BT)
  on = (mask > 0) & inside
  safe_old_BT = jnp.where(on, logp_old_BT, batch.logq_BT)
  log_x = safe_old_BT - batch.logq_BT
  x = jnp.exp(log_x)
  # |p - q| as q |e^(log p - log q) - 1|: no cancellation, and exactly 0 where the log-probs are equal
  # (two exps of one value can differ by an ulp across XLA:CPU fusions).
  diff = jnp.exp(batch.logq_BT) * jnp.abs(jnp.expm1(log_x))
  total = lambda v: jnp.sum(jnp.where(on, v, 0.0))
  st = {"sum/_tokens": jnp.sum(on.astype(jnp.float32)), "sum/kl_k1": total(-log_x),
        "sum/kl_k3": total(x - 1.0 - log_x), "sum/prob_diff_mean": total(diff),
        "max/prob_diff_max": jnp.max(jnp.where(on, diff, 0.0))}
  if loss_cfg.kept_set_mask:
    st["sum/_outside"] = jnp.sum(((mask > 0) & ~inside).astype(jnp.float32))
  if sampler_ids_BSLK is not None and own_ids_BSLK is not None:
    hits, slots = routing_hits(own_ids_BSLK, sampler_ids_BSLK, sampler_valid_BS)
    st["sum/_route_hits"], st["sum/_route_slots"] = hits, slots
  return logp_old_BT, own_ids_BSLK, st


def _forward_with_old(model, batch: TrainBatch, loss_cfg: LossConfig):
  """The update's forward (routing replay iff `batch.replay_ids_BSLK` is set) -> (out, batch, sums).

  With `batch.old_in_update` the batch comes back with `logp_old_BT` = this forward's log-probs of
  the sampled tokens under stop-gradient, and the sums of `_mismatch_metrics`: the p_old forward's
  outputs, from the forward that the update computes anyway (the same function at the same params
  on the same routing, so the ratios pi_theta / pi_theta_old are 1, to float32 rounding: XLA may fuse
  the two reads of the same logits differently). Else the batch as given and no sums.
  """
  kw = _replay_kw(batch)
  r3 = bool(kw)  # under old_in_update only R3 replays (R2's own experts are this forward's routing)
  if batch.old_in_update and r3:
    kw["return_router_logits"] = True
  out = _forward(model, batch, **kw)
  if not batch.old_in_update:
    return out, batch, {}
  logp_old_BT, _, st = _old_outputs(model, out, batch, batch.sampler_ids_BSLK, batch.sampler_valid_BS,
                                    loss_cfg, r3)
  return out, batch.replace(logp_old_BT=jax.lax.stop_gradient(logp_old_BT)), jax.lax.stop_gradient(st)


def loss_fn(params, batch: TrainBatch, *, graphdef: nnx.GraphDef, loss_cfg: LossConfig, aux_coef: float):
  """Loss of one mini-batch and its metrics; routing replay is on iff `batch.replay_ids_BSLK` is set;
  with `batch.old_in_update` also the `mismatch/*` metrics of p_old (`_forward_with_old`)."""
  model = nnx.merge(graphdef, params)
  out, batch, st_old = _forward_with_old(model, batch, loss_cfg)
  loss, metrics = _rl_loss(model, out, batch, loss_cfg)
  # The load-balancing loss uses the trainer's own routing, also under replay (models/moe.py).
  return loss + aux_coef * out.aux_loss, dict(metrics, aux_loss=out.aux_loss, moe_overflow=out.moe_overflow,
                                              **(_mismatch_metrics(st_old) if st_old else {}))


def _microbatch_loss(params, mb: TrainBatch, norm, valid_share, *, graphdef, loss_cfg, aux_coef):
  """One micro-batch's share of the mini-batch loss: the RL loss over the whole mini-batch's
  aggregation denominator `norm`, plus its `valid_share` of the load-balancing term (computed per
  micro-batch on its own routing, as Megatron and MaxText do: the aux loss's product of two token
  means does not split over rows exactly). Returns (loss, (stats, weighted aux, overflow, p_old's
  mismatch sums under `mb.old_in_update`))."""
  model = nnx.merge(graphdef, params)
  out, mb, st_old = _forward_with_old(model, mb, loss_cfg)
  loss, stats = _rl_loss(model, out, mb, loss_cfg, norm=norm, return_stats=True)
  aux = valid_share * out.aux_loss
  return loss + aux_coef * aux, (stats, aux, out.moe_overflow, st_old)


def _pin(tree, shardings):
  """`tree` (a gradient or an accumulator of one) laid out like the params: without it GSPMD may
  keep a `lax.scan` carry replicated (the 30B plan's first-order meter: two f32 gradient trees of
  all 30B parameters on every device, 256 GB of all-gathers)."""
  return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


def accumulated_grads(params, batch: TrainBatch, microbatches: int, *, graphdef: nnx.GraphDef,
                      loss_cfg: LossConfig, aux_coef: float, grad_shardings=None):
  """(loss, metrics, grads) of `batch` summed over `microbatches` strided row micro-batches in a
  `lax.scan` (gradient accumulation): the RL loss and its gradient equal the one-shot
  `loss_fn`'s to float32 rounding for every aggregation (the denominator comes from the whole
  batch), and so do the metrics (combined from sufficient statistics,
  `loss_diagnostics.diagnostic_stats`); the aux loss is the valid-token-weighted mean of the
  micro-batches' (`_microbatch_loss`)."""
  norm = normalizer(batch.response_mask_BT, loss_cfg.aggregation)
  valid_total = jnp.maximum(jnp.sum(batch.valid_BS.astype(jnp.float32)), 1.0)
  grad_fn = jax.value_and_grad(functools.partial(_microbatch_loss, graphdef=graphdef, loss_cfg=loss_cfg,
                                                 aux_coef=aux_coef), has_aux=True)

  def body(acc, mb):
    share = jnp.sum(mb.valid_BS.astype(jnp.float32)) / valid_total
    (loss, (stats, aux, overflow, st_old)), g = grad_fn(params, mb, norm, share)
    return _pin(jax.tree.map(jnp.add, acc, g), grad_shardings), (loss, stats, aux, overflow, st_old)

  zeros = _pin(jax.tree.map(jnp.zeros_like, params), grad_shardings)
  grads, (losses, stats, aux, overflow, st_old) = jax.lax.scan(body, zeros, microbatch.split(batch, microbatches))
  metrics = dict(finalize_stats(reduce_stacked(stats)), aux_loss=jnp.sum(aux), moe_overflow=jnp.mean(overflow),
                 **(_mismatch_metrics(reduce_stacked(st_old)) if st_old else {}))
  return jnp.sum(losses), metrics, grads


def first_order(params, batch: TrainBatch, *, graphdef: nnx.GraphDef, loss_cfg: LossConfig,
                microbatches: int = 1, grad_shardings=None) -> dict[str, jax.Array]:
  """The first-order-approximation meter ([MiniRL] Sec. 3) on one mini-batch.

  g_tok = grad of J_tok = -(the RL loss of `loss_fn`): the token-level objective the configured
  method optimizes (its rule, score centering, aggregation), without the load-balancing term,
  which is no part of either objective. g_seq = grad of the sequence-level objective
  J_seq = (1/Z) sum_i A_i prod_t pi_theta(y_it) / q(y_it) on the same tokens (q the sampler's
  logq; Z from `meters.seq_normalizer`, the constant of the loss's aggregation), through its
  stop-gradient surrogate (`meters.seq_objective_surrogate`). Both from one forward under the
  update's routing (replay included), two backward passes. Returns {'cosine', 'norm_ratio'}
  (`meters.grad_alignment`): on-policy (p = q), with PG and 'batch_tokens' or 'constant'
  aggregation, g_tok = g_seq, so both are 1; they move away under mismatch (the w_i differ from
  1), clipping / masking rules, and the per-response 1 / L_i of 'seq_mean'. Both objectives are
  sums over responses over a whole-batch denominator, so `microbatches` > 1 accumulates each
  gradient over strided row micro-batches (`rl.update_microbatch`) with the same result.
  """
  mask_BT = batch.response_mask_BT
  z = meters.seq_normalizer(mask_BT, loss_cfg.aggregation)
  norm = normalizer(mask_BT, loss_cfg.aggregation)

  def grads(mb):
    def objectives(p):
      model = nnx.merge(graphdef, p)
      out, mb_old, _ = _forward_with_old(model, mb, loss_cfg)
      loss, _ = _rl_loss(model, out, mb_old, loss_cfg, norm=norm)
      logp_BT = _sampled_logp(model, out, mb, loss_cfg)
      # Under sampling_mask='kept_set' the tokens outside a kept set (-inf) drop out of both objectives.
      mask_BT = mb.response_mask_BT > 0
      if loss_cfg.kept_set_mask:
        mask_BT = mask_BT & jnp.isfinite(logp_BT)
        if mb_old.logp_old_BT is not None:
          mask_BT = mask_BT & jnp.isfinite(mb_old.logp_old_BT)
      logp_BT = jnp.where(mask_BT, logp_BT, mb.logq_BT)
      j_seq, _ = meters.seq_objective_surrogate(logp_BT, mb.logq_BT, mb.adv_B, mask_BT, z)
      return -loss, j_seq

    (j_tok, j_seq), pullback = jax.vjp(objectives, params)
    one = lambda x: jnp.ones_like(x)
    zero = lambda x: jnp.zeros_like(x)
    g_tok, = pullback((one(j_tok), zero(j_seq)))
    g_seq, = pullback((zero(j_tok), one(j_seq)))
    return _pin(g_tok, grad_shardings), _pin(g_seq, grad_shardings)

  if microbatches == 1:
    g_tok, g_seq = grads(batch)
  else:
    def body(acc, mb):
      return tuple(_pin(jax.tree.map(jnp.add, a, g), grad_shardings) for a, g in zip(acc, grads(mb))), None

    zeros = _pin(jax.tree.map(jnp.zeros_like, params), grad_shardings)
    (g_tok, g_seq), _ = jax.lax.scan(body, (zeros, zeros), microbatch.split(batch, microbatches))
  return meters.grad_alignment(g_tok, g_seq)


def update(params, opt_state, batch: TrainBatch, *, graphdef: nnx.GraphDef, optimizer: Any,
           loss_cfg: LossConfig, aux_coef: float, microbatches: int = 1, grad_shardings=None):
  """One optimizer step on `batch`; a non-finite loss or gradient leaves params and state unchanged.

  `microbatches` > 1 accumulates the gradient over that many strided row micro-batches
  (`accumulated_grads`, `rl.update_microbatch`): one micro-batch's activations live at a time;
  `grad_shardings` (the params') pins the accumulator's layout.
  Returns (params, opt_state, metrics) with `metrics['finite']` telling the host which.
  """
  if microbatches == 1:
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: loss_fn(p, batch, graphdef=graphdef, loss_cfg=loss_cfg, aux_coef=aux_coef),
        has_aux=True)(params)
  else:
    loss, metrics, grads = accumulated_grads(params, batch, microbatches, graphdef=graphdef,
                                             loss_cfg=loss_cfg, aux_coef=aux_coef,
                                             grad_shardings=grad_shardings)
  gnorm = optax.global_norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
  updates, new_opt = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  return keep(new_params, params), keep(new_opt, opt_state), dict(metrics, loss=loss, grad_norm=gnorm,
                                                                 finite=ok)


# Jitted once per (graphdef, loss_cfg): the trainer calls it every `rl.meter_every` steps.
first_order_jit = jax.jit(first_order, static_argnames=("graphdef", "loss_cfg", "microbatches"))
