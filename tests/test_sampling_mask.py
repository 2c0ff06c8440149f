"""loss.sampling_mask='kept_set' by enumeration: the truncated objective's exact gradient, masking outside the kept set."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax import rollout as rollout_lib
from rl_jax.logprobs import next_token_logq
from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.config_utils import from_dict
from rl_jax.rl import step as step_lib
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.rl.loss.losses import rl_loss
from rl_jax.sampler import decode
from rl_jax.sampler import generate as gen
from rl_jax.sampler.config import SamplerConfig

R, V = 6, 8          # contexts (rows of a tabular policy), vocabulary
TEMP = 0.7

pytestmark = pytest.mark.usefixtures("fast_compile")


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _case(mismatch, top_k, top_p, k_rec, seed=0):
  """A tabular policy theta [R, V] (one response token per context), a sampler q at `mismatch`,
  its kept sets K_q and what the trainer is given: q~ of the sampled token and of the head."""
  rng = np.random.default_rng(seed)
  theta = rng.normal(size=(R, V)).astype(np.float32)
  logq = np.log(_softmax((theta + mismatch * rng.normal(size=theta.shape)) / TEMP)).astype(np.float32)
  # Jitted, as the other programs below: eagerly every op compiles its own XLA program.
  _, tau = jax.jit(decode.truncate, static_argnums=(1, 2))(jnp.asarray(logq), top_k, top_p)
  tau = np.asarray(tau)
  kept = logq >= tau[:, None]                                 # K_q, the set the sampler drew from
  logmass = np.log(np.where(kept, np.exp(logq), 0).sum(-1))
  head = np.argsort(-logq, -1, kind="stable")[:, :k_rec]
  head_logq = np.take_along_axis(logq, head, -1)
  head_tq = np.where(head_logq >= tau[:, None], head_logq - logmass[:, None], -1e30).astype(np.float32)
  covered = kept.sum(-1) <= k_rec
  return theta, logq, tau, kept, logmass, head, head_tq, covered


def _per_token(cfg, theta, logq, tau, logmass, head, head_tq, covered, adv):
  """(grad, metrics) of the loss of the single-token batch (context r, token y), for every r, y."""
  rr, yy = np.meshgrid(np.arange(R), np.arange(V), indexing="ij")
  g, m = _per_token_grads(cfg, jnp.asarray(theta), jnp.asarray(yy, jnp.int32), jnp.asarray(rr, jnp.int32),
                          np.broadcast_to(np.asarray(adv, np.float32), (R, V)),
                          *(jnp.asarray(a) for a in (logq, logmass, head, head_tq, tau, covered)))
  return np.asarray(g, np.float64), {k: np.asarray(v) for k, v in m.items()}


# One jitted program: eagerly, every op of the vmapped gradient compiles its own XLA program.
@functools.partial(jax.jit, static_argnums=0)
def _per_token_grads(cfg, theta, yy, rr, adv, logq, logmass, head, head_tq, tau, covered):
  def one(th_V, y, r, a):
    def loss(th):
      return rl_loss(th[None, None], y[None, None], jnp.ones((1, 1), bool), a[None],
                     (logq[r, y] - logmass[r])[None, None], cfg,
                     topk_ids_BTK=head[r][None, None], topk_logq_BTK=head_tq[r][None, None],
                     trunc_thresh_BT=tau[r][None, None],
                     trunc_covered_BT=covered[r][None, None])
    return jax.grad(loss, has_aux=True)(th_V)

  return jax.vmap(jax.vmap(one, (None, 0, 0, 0)), (0, 0, 0, 0))(theta, yy, rr, adv)


def _truncated_grad(theta, kset, reward):
  """Exact d/d theta of J = sum_r sum_{y in K_r} p~(y | r) R(r, y), p~ = softmax(theta / TEMP) on K_r."""
  p = np.where(kset, _softmax(theta.astype(np.float64) / TEMP), 0.0)
  p /= p.sum(-1, keepdims=True)
  pr = (p * reward).sum(-1, keepdims=True)
  return p * (reward - pr) / TEMP   # sum_y p_y R_y (e_y - p) / TEMP on K, 0 off it


@pytest.mark.parametrize("method,mismatch,top_k,top_p,k_rec", [
    ("pg", 0.0, 3, 1.0, 4),          # on-policy: PG
    ("naive_is", 1.0, 3, 1.0, 4),    # off-policy, top-k cut, head covers K
    ("naive_is", 1.0, 0, 0.8, V),    # off-policy, nucleus, full head
    ("naive_is", 1.0, 4, 0.9, 5),    # both cuts
])
def test_expected_gradient_is_the_truncated_objectives(method, mismatch, top_k, top_p, k_rec):
  theta, logq, tau, kept, logmass, head, head_tq, covered = _case(mismatch, top_k, top_p, k_rec)
  assert covered.all() and kept.sum(-1).max() < V and (kept.sum(-1) > 1).sum() >= R - 1
  reward = np.random.default_rng(1).normal(size=(R, V))
  cfg = LossConfig(method=method, sampling_mask="kept_set", temperature=TEMP)
  g, m = _per_token(cfg, theta, logq, tau, logmass, head, head_tq, covered, reward)
  qt = np.where(kept, np.exp(logq - logmass[:, None]), 0.0)       # q~, the sampling distribution
  expected = -np.einsum("ry,ryv->rv", qt, g)                       # E_q~[-grad loss]
  np.testing.assert_allclose(expected, _truncated_grad(theta, kept, reward), atol=2e-5)
  assert np.all(m["sampling_mask/outside_frac"][kept] == 0)
  # The full-vocabulary convention estimates another objective here.
  g_none, _ = _per_token(dataclasses.replace(cfg, sampling_mask="none"), theta,
                         logq, tau, logmass, head, head_tq, covered, reward)
  assert np.abs(-np.einsum("ry,ryv->rv", qt, g_none) - expected).max() > 1e-2


@pytest.mark.parametrize("centering,k_rec", [("full", V), ("topk", 4)])
def test_score_centering_is_zero_mean_under_the_truncated_sampler(centering, k_rec):
  """A constant advantage: centering's expectation over q~ on K cancels PG's drift exactly."""
  theta, logq, tau, kept, logmass, head, head_tq, covered = _case(1.0, 3, 1.0, k_rec)
  qt = np.where(kept, np.exp(logq - logmass[:, None]), 0.0)
  for sc, zero in (("none", False), (centering, True)):
    cfg = LossConfig(method="pg", sampling_mask="kept_set", temperature=TEMP, score_centering=sc, topk=k_rec)
    g, _ = _per_token(cfg, theta, logq, tau, logmass, head, head_tq, covered, np.ones(()))
    drift = np.abs(np.einsum("ry,ryv->rv", qt, g)).max()
    assert (drift < 2e-6) if zero else (drift > 1e-2), (sc, drift)


def test_token_outside_the_rebuilt_set_is_counted_and_masked():
  """A head of 1 cannot hold the nucleus: the trainer rebuilds K by the threshold on its own p,
  and a sampled token p puts below it is masked (zero gradient) and counted, never weighted."""
  theta, logq, tau, kept, logmass, head, head_tq, covered = _case(1.5, 0, 0.95, 1, seed=3)
  assert not covered.any()
  adv = np.random.default_rng(2).normal(size=(R, V))
  cfg = LossConfig(method="naive_is", sampling_mask="kept_set", temperature=TEMP)
  g, m = _per_token(cfg, theta, logq, tau, logmass, head, head_tq, covered, adv)
  logp = np.log(_softmax(theta.astype(np.float64) / TEMP))
  in_head = np.zeros((R, V), bool)
  np.put_along_axis(in_head, head, True, -1)
  k_hat = (logp >= tau[:, None]) | in_head                          # the trainer's rebuild
  outside = kept & ~k_hat
  assert outside.sum() >= 2 and (kept & k_hat).sum() >= 2           # both kinds occur
  np.testing.assert_array_equal(m["sampling_mask/outside_frac"][kept], outside[kept].astype(np.float32))
  assert np.all(g[outside] == 0)
  p_hat = np.where(k_hat, np.exp(logp), 0)
  p_hat /= p_hat.sum(-1, keepdims=True)
  for r, y in zip(*np.nonzero(kept & k_hat)):   # naive IS on p~ over K-hat: -(p~/q~) A (e_y - p~) / T on K-hat
    w = p_hat[r, y] / np.exp(logq[r, y] - logmass[r])
    e = np.eye(V)[y]
    np.testing.assert_allclose(g[r, y], -w * adv[r, y] * (e - p_hat[r]) * k_hat[r] / TEMP, atol=2e-5)


@pytest.mark.parametrize("top_k,top_p,k_rec", [(6, 1.0, 8), (0, 0.9, 4)])
def test_on_policy_ratios_are_one_in_both_modes(top_k, top_p, k_rec):
  """A real sampler's rollout, scored by the same weights: p~ / q~ = 1 (to the sampler's float
  error), no token outside the rebuilt sets, kept-set record consistent with the trainer's p."""
  vocab = 64
  mcfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=64,
                     init_std=0.2, tie_embeddings=False)
  model = Transformer(mcfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  scfg = SamplerConfig(max_prompt_len=4, max_new_tokens=6, temperature=TEMP, top_k=top_k, top_p=top_p,
                       record_topk=k_rec, eos_id=1)
  prompts = np.random.default_rng(0).integers(2, vocab, (8, 4)).astype(np.int32)
  ro = gen.generate(graphdef, params, prompts, np.ones_like(prompts, bool), jax.random.key(0), scfg)
  mask = np.asarray(ro.response_mask_BT)
  size = np.asarray(ro.trunc_size_BT)
  assert (size[mask] >= 1).all() and (size[~mask] == 0).all()
  # The record against the kept sets of the trainer's p (= q up to rounding), cut in numpy.
  # Jitted here and below: eagerly every op of a forward compiles its own XLA program.
  logp_BSV = jax.jit(lambda params, *a: next_token_logq(nnx.merge(graphdef, params)(*a).logits_BSV, TEMP))(
      params, ro.tokens_BS, ro.positions_BS, ro.valid_BS)
  logp_XV = np.asarray(rollout_lib.response_slice(logp_BSV, ro))[mask]
  desc = -np.sort(-logp_XV, -1)
  n_keep = np.full(len(desc), vocab) if not top_k else np.full(len(desc), top_k)
  if top_p < 1:
    pk = np.where(np.arange(vocab) < n_keep[:, None], np.exp(desc), 0)
    pk /= pk.sum(-1, keepdims=True)
    n_keep = np.minimum(n_keep, ((np.cumsum(pk, -1) - pk) < top_p).sum(-1))
  np.testing.assert_array_equal(size[mask], n_keep)
  rows = np.arange(len(desc))
  tau = np.asarray(ro.trunc_thresh_BT)[mask]
  assert (desc[rows, n_keep - 1] > tau).all() and (desc[rows, n_keep] < tau).all()   # tau inside the gap
  mass = np.log(np.where(np.arange(vocab) < n_keep[:, None], np.exp(desc), 0).sum(-1))
  np.testing.assert_allclose(np.asarray(ro.trunc_logmass_BT)[mask], mass, atol=1e-4)
  assert (mass < -1e-3).any()
  adv = jnp.asarray(np.random.default_rng(1).normal(size=8), jnp.float32)
  old_forward = jax.jit(step_lib.old_forward, static_argnames=("graphdef", "loss_cfg"))
  loss_fn = jax.jit(step_lib.loss_fn, static_argnames=("graphdef", "loss_cfg", "aux_coef"))
  for mode in ("none", "kept_set"):
    cfg = LossConfig(method="naive_is", temperature=TEMP, sampling_mask=mode)
    batch = step_lib.TrainBatch.from_rollout(ro, adv, truncated=mode == "kept_set")
    logp_old, _, m_old = old_forward(params, batch, graphdef=graphdef, loss_cfg=cfg)
    _, m = loss_fn(params, batch.replace(logp_old_BT=logp_old), graphdef=graphdef, loss_cfg=cfg, aux_coef=0.0)
    assert abs(float(m["is_ratio_max"]) - 1) < 1e-4 and abs(float(m["is_ratio_min"]) - 1) < 1e-4, mode
    assert abs(float(m_old["mismatch/kl_k1"])) < 1e-5
    if mode == "kept_set":
      assert float(m["sampling_mask/outside_frac"]) == 0 and float(m_old["mismatch/sampling_outside_frac"]) == 0
      np.testing.assert_allclose(float(m["sampling_mask/kept_mass_p"]), np.exp(mass).mean(), rtol=1e-4)


def test_replay_is_a_deprecated_alias_of_kept_set():
  """The old value `sampling_mask='replay'` warns and becomes 'kept_set': an equal config with the
  same hash (the same static jit argument), so the loss is the same program."""
  with pytest.warns(DeprecationWarning, match=r"sampling_mask='replay' is deprecated.*'kept_set'"):
    old = LossConfig(method="naive_is", sampling_mask="replay", temperature=TEMP)
  new = LossConfig(method="naive_is", sampling_mask="kept_set", temperature=TEMP)
  assert old.sampling_mask == "kept_set" and old == new and hash(old) == hash(new) and old.kept_set_mask
  with pytest.warns(DeprecationWarning, match="'kept_set'"):   # the config-file path too
    assert from_dict(LossConfig, {"method": "naive_is", "sampling_mask": "replay", "temperature": TEMP},
                     prefix="loss") == new
  # The same program: the loss lowered under either config (shapes only, nothing compiled) is the
  # same text, and not that of the full-vocabulary target.
  sds = jax.ShapeDtypeStruct
  f32, i32 = jnp.float32, jnp.int32
  args = (sds((R, 1, V), f32), sds((R, 1), i32), sds((R, 1), bool), sds((R,), f32), sds((R, 1), f32))
  kw = dict(topk_ids_BTK=sds((R, 1, 4), i32), topk_logq_BTK=sds((R, 1, 4), f32),
            trunc_thresh_BT=sds((R, 1), f32), trunc_covered_BT=sds((R, 1), bool))
  hlo = lambda cfg: jax.jit(rl_loss, static_argnums=5).lower(*args, cfg, **kw).as_text()
  assert hlo(old) == hlo(new) != hlo(dataclasses.replace(new, sampling_mask="none"))


def test_sequence_statistics_run_over_the_kept_tokens():
  """A two-token response whose second token lies outside the trainer's rebuilt kept set: that
  token is masked before any method, so geo_mask's G_i and the rejection statistic are those of
  the first token alone (docs/math.md#every-method-in-one-table). Counted, the second token's
  log-ratio log(0.05 / 0.9) would put G_i at exp(-1.45) and the k1 mean at 1.45: dropped, rejected."""
  logits = np.log(np.array([[[0.4, 0.3, 0.2, 0.1], [0.05, 0.45, 0.25, 0.25]]], np.float32))
  targets = np.array([[0, 0]])
  # Token 0: every id kept (q~ = p there, on-policy); token 1: K = {v : log p_v >= log 0.2}, y = 0
  # (p = 0.05) outside it, its recorded log q~ far from anything p says.
  tau = np.array([[-1e30, np.log(0.2)]], np.float32)
  logq = np.array([[np.log(0.4), np.log(0.9)]], np.float32)
  adv = np.array([1.0], np.float32)
  cfg = LossConfig(method="geo_mask", sampling_mask="kept_set", rejection="k1", rejection_threshold=0.5)
  loss, m = rl_loss(logits, targets, np.ones((1, 2), bool), adv, logq, cfg, trunc_thresh_BT=tau)
  assert float(m["sampling_mask/outside_frac"]) == 0.5
  assert float(m["seq_frac_dropped"]) == 0.0 and float(m["seq_frac_rejected"]) == 0.0
  assert abs(float(m["rejection_stat_mean"])) < 1e-6
  # Weight 1 on token 0 (its ratio is 1), token 1 masked (its zero gradient:
  # test_token_outside_the_rebuilt_set_is_counted_and_masked): -A log p(y_0) over the 2 tokens of
  # the denominator.
  np.testing.assert_allclose(loss, -np.log(0.4) / 2, rtol=1e-5)
  assert float(m["weight_mean"]) == pytest.approx(1.0, rel=1e-5)
