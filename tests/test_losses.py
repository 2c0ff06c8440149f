"""RL loss: every weight rule (docs/math.md#correction-methods), on-policy == PG, aggregation, jit, errors."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.config_utils import ConfigError, from_dict
from rl_jax.rl.loss import losses
from rl_jax.rl.loss.loss_config import METHODS, LossConfig, sc_composable_methods
from rl_jax.rl.loss.losses import (gather_logprobs, rl_loss, rl_loss_from_hidden,
                              rl_loss_from_logprobs)
from rl_jax.rl.loss.methods import METHOD_REGISTRY

# Every list is derived from the registry; docs/math.md#correction-methods pins the 11 methods it defines.
SC_METHODS = tuple(sc_composable_methods())
TABLE_METHODS = ("pg", "naive_is", "tis", "cispo", "mis", "ppo", "dapo", "gspo", "topr", "dppo",
                "minirl")
TABLE_SC_METHODS = ("pg", "naive_is", "tis", "cispo", "mis", "ppo", "dapo")
# docs/math.md#sequence-level-corrections: the field's corrections, registered after the papers'.
SEQ_METHODS = ("seq_tis", "seq_mis", "geo_mask", "opsm", "decoupled_ppo")
REJECTIONS = [(e, r) for e in ("k1", "k2", "k3") for r in ("mean", "sum", "max")]


# Tests batch many configs into one jit: the programs are tiny, compiling dominates.
pytestmark = pytest.mark.usefixtures("fast_compile")


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _rollout(seed=0, b=3, t=6, v=9, k=3, noise=0.7, temperature=1.0):
  """Trainer logits, a perturbed sampler's logged data, a ragged mask and advantages (numpy)."""
  rng = np.random.default_rng(seed)
  logits = (2.0 * rng.normal(size=(b, t, v))).astype(np.float32)
  samp_logq_BTV = _log_softmax(
      (logits + noise * rng.normal(size=(b, t, v))) / temperature).astype(np.float32)
  cdf = np.cumsum(np.exp(samp_logq_BTV), -1)
  targets = np.minimum((cdf < rng.random((b, t, 1))).sum(-1), v - 1)
  logq = np.take_along_axis(samp_logq_BTV, targets[..., None], -1)[..., 0]
  topk_ids = np.argsort(-samp_logq_BTV, -1, kind="stable")[..., :k]
  topk_logq = np.take_along_axis(samp_logq_BTV, topk_ids, -1)
  lengths = np.array([t, t - 2, 1] + [t] * (b - 3))[:b]
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  adv = np.linspace(1.0, -0.7, b).astype(np.float32)
  return dict(logits=logits, targets=targets, mask=mask, adv=adv, logq=logq,
              topk_ids=topk_ids, topk_logq=topk_logq, samp_logq_BTV=samp_logq_BTV)


def _trainer_logp(logits, targets, temperature=1.0):
  lp = _log_softmax(logits / temperature)
  return np.take_along_axis(lp, targets[..., None], -1)[..., 0].astype(np.float32)


# --- Config ---------------------------------------------------------------------------------

def test_config_defaults_are_spec():
  c = from_dict(LossConfig, {}, prefix="loss")
  assert (c.tis_high, c.mis_low, c.mis_high) == (2.0, 0.5, 5.0)
  assert (c.ppo_low, c.ppo_high, c.dapo_low, c.dapo_high) == (0.8, 1.2, 0.8, 1.28)
  assert (c.gspo_low, c.gspo_high, c.topr_high, c.dppo_tv, c.dual_clip) == (
      0.9997, 1.0004, 1.0, 0.2, 3.0)
  assert (c.minirl_eps_low, c.minirl_eps_high, c.minirl_tis_c) == (0.2, 0.27, 5.0)
  assert c.minirl_train_infer_is and c.minirl_clip
  assert (c.topk, c.sc_eps, c.temperature, c.chunk_size) == (128, 1e-6, 1.0, 0)
  # docs/references.md#defaults-of-the-sequence-level-corrections gives each value's source.
  assert (c.seq_tis_c, c.seq_mis_low, c.seq_mis_high) == (2.0, 0.5, 2.0)
  assert (c.geo_mask_low, c.geo_mask_high, c.geo_mask_tis_c) == (0.99, 1.01, 2.0)
  assert (c.opsm_delta, c.opsm_base) == (1e-4, "pg")
  assert (c.decoupled_ppo_low, c.decoupled_ppo_high, c.decoupled_ppo_c) == (0.8, 1.2, 5.0)
  assert (c.is_ratio, c.rejection, c.rejection_reduce, c.rejection_threshold, c.weight_norm) == (
      "current", "none", "mean", 0.01, False)
  assert tuple(METHOD_REGISTRY) == METHODS and METHODS[:11] == TABLE_METHODS
  assert METHODS[11:16] == SEQ_METHODS
  assert hash(c) == hash(LossConfig())  # static jit argument: equal configs share a compile


@pytest.mark.parametrize("section,match", [
    ({"method": "grpo"}, "loss.method"),
    ({"aggregation": "token_mean"}, "loss.aggregation"),
    ({"score_centering": "yes"}, "loss.score_centering"),
    ({"tis_cap": 2.0}, "loss.tis_cap"),
    ({"method": "gspo", "score_centering": "topk"}, "score_centering.*sequence-level"),
    ({"method": "topr", "score_centering": "full"}, "score_centering.*sequence-level"),
    ({"method": "dppo", "score_centering": "topk"}, "score_centering.*total variation"),
    ({"method": "minirl", "score_centering": "topk"}, "score_centering.*p_old"),
    ({"method": "pg", "minirl_clip": False}, "minirl_clip"),
    ({"method": "tis", "minirl_train_infer_is": False}, "minirl_train_infer_is"),
    ({"ppo_low": 1.1}, "ppo_low"),
    ({"mis_low": 5.0, "mis_high": 0.5}, "mis_high"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"topk": 0}, "topk"),
    ({"temperature": 0.0}, "temperature"),
    *[({"method": m, "score_centering": "topk"}, "score_centering.*whole sequence")
      for m in ("seq_tis", "seq_mis", "geo_mask", "opsm")],
    ({"method": "decoupled_ppo", "score_centering": "full"}, "score_centering.*p_old"),
    ({"is_ratio": "old"}, "loss.is_ratio"),
    ({"method": "gspo", "is_ratio": "p_old"}, "is_ratio.*gspo.*geometric-mean"),
    ({"method": "dppo", "is_ratio": "p_old"}, "is_ratio.*dppo.*total variation"),
    ({"method": "tis", "is_ratio": "p_old", "score_centering": "topk"}, "is_ratio.*head id"),
    ({"method": "minirl", "is_ratio": "p_old", "minirl_train_infer_is": False}, "is_ratio.*choose one"),
    ({"rejection": "kl"}, "loss.rejection"),
    ({"rejection_reduce": "min"}, "loss.rejection_reduce"),
    ({"rejection_threshold": math.nan}, "rejection_threshold.*NaN"),
    ({"weight_norm": "batch"}, "loss.weight_norm"),
    ({"seq_tis_c": 0.0}, "seq_tis_c"),
    ({"seq_mis_low": 1.5}, "seq_mis_low"),
    ({"seq_mis_high": 0.9}, "seq_mis_high"),
    ({"geo_mask_low": 1.0, "geo_mask_high": 1.0}, "geo_mask_high"),
    ({"geo_mask_tis_c": -1.0}, "geo_mask_tis_c"),
    ({"opsm_delta": -1e-3}, "opsm_delta"),
    ({"opsm_base": "gspo"}, "opsm_base"),
    ({"opsm_base": "opsm"}, "opsm_base"),
    ({"decoupled_ppo_low": 1.2}, "decoupled_ppo_low"),
    ({"decoupled_ppo_c": 0.0}, "decoupled_ppo_c"),
])
def test_config_rejects(section, match):
  with pytest.raises(ConfigError, match=match):
    from_dict(LossConfig, section, prefix="loss")


def test_sc_composability_matches_registry():
  for m in METHODS:
    composable = METHOD_REGISTRY[m].weight_fn is not None
    assert composable == (m in SC_METHODS)
    if m in TABLE_METHODS:
      assert composable == (m in TABLE_SC_METHODS)
    if composable:
      LossConfig(method=m, score_centering="topk")
    else:
      with pytest.raises(ConfigError):
        LossConfig(method=m, score_centering="topk")


def test_runtime_errors():
  r = _rollout(v=9, k=3)
  args = (r["logits"], r["targets"], r["mask"], r["adv"], r["logq"])
  # All of these fail while tracing, before anything compiles.
  with pytest.raises(ValueError, match="logp_old_BT"):
    rl_loss(*args, LossConfig(method="minirl"))
  with pytest.raises(ValueError, match="logp_old_BT"):
    rl_loss(*args, LossConfig(method="minirl", minirl_clip=False, minirl_train_infer_is=False))
  with pytest.raises(ValueError, match="top-k ids"):
    rl_loss(*args, LossConfig(score_centering="topk", topk=3))
  kw = dict(topk_ids_BTK=r["topk_ids"], topk_logq_BTK=r["topk_logq"])
  with pytest.raises(ValueError, match="larger than the vocabulary"):
    rl_loss(*args, LossConfig(score_centering="topk", topk=10), **kw)
  with pytest.raises(ValueError, match="recorded only K = 3"):
    rl_loss(*args, LossConfig(score_centering="topk", topk=4), **kw)
  with pytest.raises(ValueError, match="full distribution"):
    rl_loss(*args, LossConfig(score_centering="full"), **kw)
  with pytest.raises(ValueError, match="adv_B"):
    rl_loss(r["logits"], r["targets"], r["mask"], r["adv"][:2], r["logq"], LossConfig())
  with pytest.raises(TypeError, match="LossConfig"):
    rl_loss(*args, {"method": "pg"})
  # MiniRL without its mask and with train-infer IS reads only p / q: no p_old needed.
  loss, _ = rl_loss(*args, LossConfig(method="minirl", minirl_clip=False))
  assert np.isfinite(loss)


# --- Log-probs ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,temperature", [(jnp.float32, 0.7), (jnp.bfloat16, 1.3)])
def test_gather_logprobs_matches_log_softmax(dtype, temperature):
  rng = np.random.default_rng(1)
  logits = jnp.asarray(3.0 * rng.normal(size=(2, 3, 17)), dtype)
  ids = rng.integers(0, 17, (2, 3, 5))
  ids[..., 0] = ids[..., 1]  # a repeated id must collect both cotangents
  c_lp = rng.normal(size=(2, 3, 5)).astype(np.float32)
  c_ent = rng.normal(size=(2, 3)).astype(np.float32)

  def ref(x):
    lp = jax.nn.log_softmax(x.astype(jnp.float32) / temperature)
    return jnp.take_along_axis(lp, ids, -1), -jnp.sum(jnp.exp(lp) * lp, -1)

  def mine(x):
    return gather_logprobs(x, ids, temperature)

  @jax.jit
  def both(x):
    obj = lambda fn: lambda y: jnp.sum(fn(y)[0] * c_lp) + jnp.sum(fn(y)[1] * c_ent)
    return mine(x), ref(x), jax.grad(obj(mine))(x), jax.grad(obj(ref))(x)

  (lp, ent), (lp_ref, ent_ref), g_mine, g_ref = both(logits)
  assert lp.dtype == ent.dtype == jnp.float32 and g_mine.dtype == dtype
  np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ent_ref, rtol=1e-5, atol=1e-5)
  # bf16 output: both gradients are rounded to bf16, so they may differ by one ulp (2^-7).
  tol = 1e-5 if dtype == jnp.float32 else 2.0**-7
  np.testing.assert_allclose(g_mine.astype(jnp.float32), g_ref.astype(jnp.float32), rtol=tol,
                             atol=1e-6)


def test_masked_vocabulary_slot_and_entropy_gradient():
  """A -inf logit is a token of probability 0: finite values, zero gradient, and the entropy
  gradient (alone, so the log-prob cotangent is a symbolic zero) equals the 3-token one."""
  logits = jnp.array([[0.0, 1.0, -jnp.inf, 2.0]])
  ids = jnp.array([[3, 0]])
  finite = jnp.array([[0.0, 1.0, 2.0]])

  def ref_entropy(y):
    lp = jax.nn.log_softmax(y)
    return -jnp.sum(jnp.exp(lp) * lp)

  @jax.jit
  def run(x):
    both = lambda y: jnp.sum(gather_logprobs(y, ids)[0]) + jnp.sum(gather_logprobs(y, ids)[1])
    ent_only = lambda y: jnp.sum(gather_logprobs(y, ids)[1])
    return (gather_logprobs(x, ids), jax.grad(both)(x), jax.grad(ent_only)(x),
            jax.grad(ref_entropy)(finite))

  (lp, ent), g, g_ent, g_ent_ref = run(logits)
  p = np.exp(_log_softmax(np.array([0.0, 1.0, 2.0])))
  np.testing.assert_allclose(lp[0], np.log(p[[2, 0]]), rtol=1e-6)
  np.testing.assert_allclose(ent[0], -np.sum(p * np.log(p)), rtol=1e-6)
  assert np.isfinite(g).all() and g[0, 2] == 0.0
  np.testing.assert_allclose(g_ent[0, [0, 1, 3]], g_ent_ref[0], rtol=1e-5, atol=1e-7)
  assert g_ent[0, 2] == 0.0


# --- On-policy: every method is PG -----------------------------------------------------------

def test_on_policy_every_method_equals_pg():
  """p == q == p_old: every rule's weight is 1 and every centering term has zero gradient."""
  r = _rollout(seed=3, v=9, k=3)
  lp_BTV = _log_softmax(r["logits"]).astype(np.float32)
  logq = _trainer_logp(r["logits"], r["targets"])  # q == p (and p_old == p)
  order = np.argsort(-lp_BTV, -1, kind="stable")
  head = dict(topk_ids_BTK=order[..., :3],
              topk_logq_BTK=np.take_along_axis(lp_BTV, order[..., :3], -1))
  full = dict(topk_ids_BTK=order, topk_logq_BTK=np.take_along_axis(lp_BTV, order, -1))
  variants = [(LossConfig(method=m), {}) for m in METHODS]
  variants += [(LossConfig(method=m, score_centering="topk", topk=3), head) for m in SC_METHODS]
  variants += [(LossConfig(method=m, score_centering="full"), full) for m in ("pg", "tis", "mis")]
  # A sampler that recorded more than cfg.topk (sorted): its first cfg.topk entries are used.
  variants += [(LossConfig(method="tis", score_centering="topk", topk=3), full)]
  # Centering composes with the rejection switch and weight normalization
  # (docs/math.md#sequence-level-corrections; bit for bit without centering in the test below).
  variants += [(LossConfig(method="tis", score_centering="topk", topk=3, rejection="k3",
                           weight_norm=True), head)]
  args = (r["targets"], r["mask"], r["adv"], logq)

  @jax.jit
  def grads(x):
    g = lambda cfg, kw: jax.grad(lambda y: rl_loss(y, *args, cfg, logp_old_BT=logq, **kw)[0])(x)
    return g(LossConfig(), {}), [g(cfg, kw) for cfg, kw in variants]

  g_pg, gs = grads(r["logits"])
  assert np.abs(g_pg).max() > 1e-3
  for (cfg, _), g in zip(variants, gs):
    np.testing.assert_allclose(g, g_pg, rtol=1e-5, atol=1e-7,
                               err_msg=f"{cfg.method} sc={cfg.score_centering}")
  tis_head = [g for (c, kw), g in zip(variants, gs)
              if c.method == "tis" and c.score_centering == "topk"]
  np.testing.assert_array_equal(tis_head[0], tis_head[1])


def test_vanilla_sc_equals_pg_exactly_when_p_equals_q():
  """p == q: the top-k coefficients q_v - rho p_v vanish, so loss and gradient are PG's."""
  lp = np.log(np.array([[[0.5, 0.25, 0.125, 0.125]]], np.float32))  # exact in binary
  ids = np.array([[[0, 1]]])
  rest = (np.array([[1]]), np.ones((1, 1), np.float32), np.array([0.75], np.float32), lp[..., 1])
  kw = dict(topk_ids_BTK=ids, topk_logq_BTK=np.take_along_axis(lp, ids, -1))
  sc_cfg = LossConfig(score_centering="topk", topk=2)

  @jax.jit
  def run(x):
    pg = jax.value_and_grad(lambda y: rl_loss(y, *rest, LossConfig())[0])(x)
    sc = jax.value_and_grad(lambda y: rl_loss(y, *rest, sc_cfg, **kw)[0])(x)
    return pg, sc

  (l_pg, g_pg), (l_sc, g_sc) = run(lp)
  assert float(l_pg) == float(l_sc)
  np.testing.assert_array_equal(g_sc, g_pg)


# --- Weight rules on hand-built ratios (docs/math.md#correction-methods) ------------------

RATIOS = np.array([0.3, 0.6, 0.85, 1.0, 1.1, 1.25, 1.5, 2.5, 4.0, 6.0], np.float32)
ADVS = np.array([1.0, -0.5], np.float32)


def _ratio_batch(ratios=RATIOS, advs=ADVS, q=0.1):
  logq = np.full((len(advs), len(ratios)), np.log(q), np.float32)
  logp = (logq + np.log(ratios)[None]).astype(np.float32)
  return logp, logq, np.asarray(advs, np.float32)


def _rules(cfgs, logp, logq, adv, mask=None, metrics=True, **kw):
  """(loss, metrics, w) per config, w_t recovered from d loss / d log p; one compile for all.

  batch_tokens: loss = -(1/N) sum_t J_t and dJ_t / dlog p_t = w_t A, so w = -grad N / A.
  `metrics=False` returns {} for the metrics: the diagnostics are then dead code, and the
  programs compile in about half the time.
  """
  mask = np.ones_like(logp) if mask is None else mask

  def loss(y, c):
    out = rl_loss_from_logprobs(y, mask, adv, logq, c, **kw)
    return out if metrics else (out[0], {})

  @jax.jit
  def run(lp):
    return [jax.value_and_grad(lambda y, c=c: loss(y, c), has_aux=True)(lp) for c in cfgs]

  n = float(mask.sum())
  return [(float(l), m, -np.asarray(g) * n / adv[:, None]) for (l, m), g in run(logp)]


def _ppo_expected(r, a, lo, hi, dual=3.0):
  j = np.minimum(r * a, np.clip(r, lo, hi) * a)
  if a < 0:
    j = np.maximum(j, dual * a)
  w = np.where((a > 0) & (r > hi) | (a < 0) & ((r < lo) | (r > dual)), 0.0, r)
  return j, w


def test_token_ratio_rules():
  methods = ["pg", "naive_is", "tis", "cispo", "mis", "ppo", "dapo"]
  logp, logq, adv = _ratio_batch()
  r = RATIOS
  for method, (loss, m, w) in zip(methods, _rules([LossConfig(method=x) for x in methods],
                                                  logp, logq, adv)):
    js, ws, clipped, dropped = [], [], 0, 0
    for i, a in enumerate(ADVS):
      if method in ("ppo", "dapo"):
        lo, hi = (0.8, 1.2) if method == "ppo" else (0.8, 1.28)
        j, wi = _ppo_expected(r, a, lo, hi)
        dropped += np.sum((wi == 0) & ~((a < 0) & (r > 3.0)))  # dual clip is counted apart
      else:
        wi = {"pg": np.ones_like(r), "naive_is": r, "tis": np.minimum(r, 2.0),
              "cispo": np.minimum(r, 1.28),
              "mis": np.where((r >= 0.5) & (r <= 5.0), r, 0.0)}[method]
        j = wi * a * logp[i]  # stop-gradient weight times A log p
        clipped += {"tis": np.sum(r > 2.0), "cispo": np.sum(r > 1.28)}.get(method, 0)
        dropped += np.sum(wi == 0)
      js.append(j)
      ws.append(wi)
    np.testing.assert_allclose(w, np.stack(ws), rtol=1e-5, atol=1e-6, err_msg=method)
    np.testing.assert_allclose(loss, -np.sum(js) / logp.size, rtol=1e-5, err_msg=method)
    np.testing.assert_allclose(m["frac_clipped"], clipped / logp.size, atol=1e-7, err_msg=method)
    np.testing.assert_allclose(m["frac_dropped"], dropped / logp.size, atol=1e-7, err_msg=method)


def test_ppo_dual_clip_at_3():
  """A < 0 and r > 3: the term is capped at -3A, no gradient; r in (1.2, 3] keeps gradient r."""
  r = np.array([2.9, 3.0, 3.1, 6.0], np.float32)
  logp, logq, adv = _ratio_batch(r, np.array([-2.0], np.float32))
  cfgs = [LossConfig(method="ppo"), LossConfig(method="dapo"),
          LossConfig(method="ppo", dual_clip=5.0)]
  (l_ppo, m_ppo, w_ppo), (l_dapo, m_dapo, w_dapo), (_, _, w5) = _rules(cfgs, logp, logq, adv)
  for loss, m, w in ((l_ppo, m_ppo, w_ppo), (l_dapo, m_dapo, w_dapo)):
    np.testing.assert_allclose(w[0], [2.9, 3.0, 0.0, 0.0], rtol=1e-5)
    np.testing.assert_allclose(loss, -np.mean([2.9 * -2, 3.0 * -2, 3 * -2, 3 * -2]), rtol=1e-5)
    np.testing.assert_allclose(m["frac_dual_clipped"], 0.5)
  np.testing.assert_allclose(w5[0], [2.9, 3.0, 3.1, 0.0], rtol=1e-5)


def test_gspo_geometric_mean_whole_response():
  # Per-token log-ratios; each row's mean decides the whole response.
  rows = [
      # mean 1e-4 -> s inside the band, although every token ratio and even their
      # arithmetic mean (1.0009) lie outside it: the statistic is the geometric mean.
      ([5e-2, -5e-2, 3e-4], 1.0),
      ([2e-3, 0.0, 1e-3], 1.0),      # mean 1e-3 > log 1.0004, A > 0 -> dropped
      ([-2e-3, 0.0, -1e-3], -1.0),   # mean -1e-3 < log 0.9997, A < 0 -> dropped
      ([2e-3, 0.0, 1e-3], -1.0),     # above the band but A < 0 -> kept (pessimistic)
      ([-2e-3, 0.0, -1e-3], 1.0),    # below the band but A > 0 -> kept
      ([np.log(4.0)] * 3, -1.0),     # s = 4 > 3, A < 0 -> dual clip
  ]
  logr = np.array([r for r, _ in rows], np.float32)
  adv = np.array([a for _, a in rows], np.float32)
  logq = np.full(logr.shape, np.log(0.05), np.float32)
  # A padded 4th position with garbage logq must not enter the geometric mean.
  logq = np.concatenate([logq, np.full((len(rows), 1), -1e9, np.float32)], 1)
  logp = np.concatenate([logq[:, :3] + logr, np.full((len(rows), 1), -1.0, np.float32)], 1)
  mask = (np.arange(4)[None] < 3).astype(np.float32).repeat(len(rows), 0)
  [(loss, m, w)] = _rules([LossConfig(method="gspo")], logp, logq, adv, mask=mask)
  s = np.exp(logr.mean(1))
  kept = np.array([1, 0, 0, 1, 1, 0], bool)
  want_w = np.where(kept, s, 0.0)[:, None] * np.array([1, 1, 1, 0])[None]
  np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-7)
  j = [_ppo_expected(np.float32(si), a, 0.9997, 1.0004)[0] for si, a in zip(s, adv)]
  np.testing.assert_allclose(loss, -np.sum(np.array(j) * 3) / 18, rtol=1e-5)
  np.testing.assert_allclose(m["frac_dropped"], 2 / 6)
  np.testing.assert_allclose(m["frac_dual_clipped"], 1 / 6)


def test_topr_only_weights_negative_advantages():
  rows = [([np.log(3.0), 0.0], 1.0),             # A > 0: weight 1 whatever the ratio
          ([np.log(0.25), np.log(2.0)], -1.0),   # product 0.5 -> weight 0.5
          ([np.log(2.0), 0.0], -1.0),            # product 2 -> clipped at 1
          ([np.log(0.1), 0.0], 0.5)]             # A > 0, tiny ratio: still 1
  logr = np.array([r for r, _ in rows], np.float32)
  adv = np.array([a for _, a in rows], np.float32)
  logq = np.full(logr.shape, np.log(0.1), np.float32)
  logp = logq + logr
  [(loss, m, w)] = _rules([LossConfig(method="topr")], logp, logq, adv)
  want = np.array([1.0, 0.5, 1.0, 1.0])[:, None].repeat(2, 1)
  np.testing.assert_allclose(w, want, rtol=1e-5)
  np.testing.assert_allclose(loss, -np.sum(want * adv[:, None] * logp) / 8, rtol=1e-5)
  np.testing.assert_allclose(m["frac_clipped"], 2 / 8)


def test_dppo_total_variation_band():
  p = np.array([0.5, 0.1, 0.3, 0.9, 0.05], np.float32)
  q = np.array([0.2, 0.4, 0.2, 0.05, 0.9], np.float32)
  logp, logq = np.log(p)[None].repeat(2, 0), np.log(q)[None].repeat(2, 0)
  adv = np.array([1.0, -1.0], np.float32)
  [(loss, m, w)] = _rules([LossConfig(method="dppo")], logp, logq, adv)
  r = p / q
  keep_pos = ~(p - q > 0.2)           # tokens 0 and 3 pushed up too far
  keep_neg = ~(q - p > 0.2)           # tokens 1 and 4 pushed down too far
  np.testing.assert_array_equal(keep_pos, [0, 1, 1, 0, 1])
  np.testing.assert_array_equal(keep_neg, [1, 0, 1, 1, 0])
  want = np.stack([np.where(keep_pos, r, 0), np.where(keep_neg, r, 0)])
  np.testing.assert_allclose(w, want, rtol=1e-5)  # r = 18 kept: no ratio clipping at all
  np.testing.assert_allclose(loss, -(want * np.array([[1.0], [-1.0]])).sum() / 10, rtol=1e-5)
  np.testing.assert_allclose(m["frac_dropped"], 4 / 10)


# --- MiniRL ([MiniRL], Eq. 7) ---------------------------------------------------------------------

def test_minirl_mask_weight_and_ablations():
  s_stale = np.array([1.3, 1.25, 0.75, 0.85, 0.5, 1.5], np.float32)  # p / p_old
  r_is = np.array([1.0, 7.0, 2.0, 0.5, 5.5, 1.0], np.float32)        # p / q
  logp = np.full((2, 6), np.log(0.1), np.float32)
  logq, logp_old = logp - np.log(r_is), logp - np.log(s_stale)
  adv = np.array([1.0, -2.0], np.float32)
  flags = [(True, True), (False, True), (True, False), (False, False)]
  cfgs = [LossConfig(method="minirl", minirl_train_infer_is=a, minirl_clip=b) for a, b in flags]
  outs = _rules(cfgs, logp, logq, adv, logp_old_BT=logp_old)
  for (train_infer_is, clip), (loss, m, w) in zip(flags, outs):
    ratio = r_is if train_infer_is else s_stale
    keep = np.ones((2, 6), bool)
    if clip:  # eps_high = 0.27 for A > 0, eps_low = 0.2 for A < 0
      keep[0] = ~(s_stale > 1.27)
      keep[1] = ~(s_stale < 0.8)
      np.testing.assert_array_equal(keep, [[0, 1, 1, 1, 1, 0], [1, 1, 0, 1, 0, 1]])
    want = np.where(keep, np.minimum(ratio, 5.0)[None], 0.0)
    # Stop-gradient on the weight: the gradient is exactly w A, even where min(r, C) binds.
    np.testing.assert_allclose(w, want, rtol=1e-5)
    np.testing.assert_allclose(loss, -np.sum(want * adv[:, None] * np.log(0.1)) / 12, rtol=1e-5)
    np.testing.assert_allclose(m["frac_masked"], (~keep).mean())
    np.testing.assert_allclose(m["frac_clipped"], (ratio > 5.0).mean())


def test_minirl_on_policy_reduces_to_tis_on_pold_over_q():
  """theta == theta_old: loss = -(1/(B L_max)) sum sg(min(p_old/q, 5)) A log p (constant agg)."""
  r = _rollout(seed=5, noise=1.5)
  logp_old = _trainer_logp(r["logits"], r["targets"])
  r["logq"][0, 1] = logp_old[0, 1] - np.log(7.0)  # a token the sampler under-weighted 7x
  cfg = LossConfig(method="minirl", aggregation="constant")
  args = (r["targets"], r["mask"], r["adv"], r["logq"], cfg)

  def want_fn(x):
    logp = jnp.take_along_axis(jax.nn.log_softmax(x), r["targets"][..., None], -1)[..., 0]
    w = jnp.minimum(jnp.exp(logp_old - r["logq"]), 5.0)  # a constant: p_old, q are data
    return -jnp.sum(r["mask"] * w * r["adv"][:, None] * logp) / r["mask"].size

  @jax.jit
  def run(x):
    return (jax.value_and_grad(lambda y: rl_loss(y, *args, logp_old_BT=logp_old)[0])(x),
            jax.value_and_grad(want_fn)(x))

  assert np.max(np.exp(logp_old - r["logq"]) * r["mask"]) > 5.0  # the cap binds somewhere
  (loss, g), (want, g_want) = run(r["logits"])
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-7)


# --- The field's sequence-level corrections and switches (docs/math.md#sequence-level-corrections)

# Four responses (the third has 2 tokens) with their token ratios r = p / q written out; q = 0.2.
SEQ_R = np.array([[2.0, 1.5, 1.0], [0.5, 0.5, 1.0], [1.01, 0.995, 1.0], [1.25, 0.85, 1.1]],
                 np.float32)
SEQ_MASK = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], np.float32)
SEQ_ADV = np.array([1.0, -1.0, 0.5, -2.0], np.float32)
# Per response: the sequence ratio exp(S_i) = prod_t r_t; the geometric means G_i = exp(S_i / L_i)
# are 1.442, 0.630, 1.0025, 1.053 (only the third is inside geo_mask's [0.99, 1.01]).
SEQ_PROD = np.array([2.0 * 1.5 * 1.0, 0.5 * 0.5 * 1.0, 1.01 * 0.995, 1.25 * 0.85 * 1.1])
N_SEQ_TOKENS = 11


def _seq_batch():
  """(log p, log q, A) of the four responses: log p = log q + log r."""
  logq = np.full(SEQ_R.shape, np.log(0.2), np.float32)
  return (logq + np.log(SEQ_R)).astype(np.float32), logq, SEQ_ADV


def _rows(w_B):
  """A weight per response, on each of its tokens (0 on padding)."""
  return np.asarray(w_B, np.float64)[:, None] * SEQ_MASK


def _ess(w):
  """(sum w)^2 / (n sum w^2) over the response tokens, a dropped token counting with weight 0."""
  w = w[SEQ_MASK > 0]
  return w.sum() ** 2 / (w.size * np.sum(w ** 2)) if np.any(w) else 0.0


def test_on_policy_corrections_and_switches_are_pg_bit_for_bit():
  """q = p = p_old (one array): every sequence method, the decoupled ratio, the rejection switch
  and weight normalization have weight 1 and drop nothing, so loss and gradient are PG's bit for
  bit (a ratio surrogate's value is sum_t A / N, PPO's, its gradient PG's)."""
  logp, _, adv = _seq_batch()
  cfgs = [LossConfig(method=m) for m in SEQ_METHODS]
  # Each switch and each rejection estimator at least once.
  cfgs += [LossConfig(method="opsm", opsm_base="ppo", is_ratio="p_old", rejection="k3"),
           LossConfig(method="tis", is_ratio="p_old", rejection="k2", rejection_reduce="sum",
                      weight_norm=True),
           LossConfig(method="ppo", is_ratio="p_old", rejection="k1", rejection_reduce="max",
                      weight_norm=True)]

  @jax.jit
  def run(lp):
    f = lambda c: jax.value_and_grad(lambda y: rl_loss_from_logprobs(
        y, SEQ_MASK, adv, lp, c, logp_old_BT=lp)[0])(lp)
    return f(LossConfig()), f(LossConfig(method="ppo")), [f(c) for c in cfgs]

  (l_pg, g_pg), (l_ppo, _), outs = run(logp)
  assert np.abs(g_pg).max() > 0
  for cfg, (loss, g) in zip(cfgs, outs):
    surrogate = cfg.method in ("ppo", "decoupled_ppo") or (cfg.method, cfg.opsm_base) == ("opsm", "ppo")
    assert float(loss) == float(l_ppo if surrogate else l_pg), cfg
    np.testing.assert_array_equal(g, g_pg, err_msg=str(cfg))


def test_sequence_methods_by_hand():
  """seq_tis, seq_mis, geo_mask and opsm on the four responses, at their defaults, at overrides and
  with each threshold at +-inf (the unmasked forms: exp(S_i), token TIS, plain PG; the rejection
  switch's: the method alone)."""
  logp, logq, adv = _seq_batch()
  r = SEQ_R.astype(np.float64)
  inf = math.inf
  only_2 = np.array([[0], [0], [1], [0]])
  # (config, weights, tokens clipped, responses dropped); every response dropped whole here.
  # The defaults' diagnostics are checked; the overrides' weights and losses only (faster).
  cases = [
      # min(exp(S_i), 2): response 0's 3.0 is capped.
      (LossConfig(method="seq_tis"), _rows([2.0, SEQ_PROD[1], SEQ_PROD[2], SEQ_PROD[3]]), 3, []),
      (LossConfig(method="seq_tis", seq_tis_c=inf), _rows(SEQ_PROD), 0, []),
      # exp(S_i) inside [0.5, 2]: responses 0 (3.0) and 1 (0.25) are dropped.
      (LossConfig(method="seq_mis"), _rows([0.0, 0.0, SEQ_PROD[2], SEQ_PROD[3]]), 0, [0, 1]),
      (LossConfig(method="seq_mis", seq_mis_low=0.0, seq_mis_high=inf), _rows(SEQ_PROD), 0, []),
      # G_i inside [0.99, 1.01]: only response 2, with token weights min(r, 2).
      (LossConfig(method="geo_mask"), only_2 * np.minimum(r, 2.0) * SEQ_MASK, 0, [0, 1, 3]),
      # A wide band keeps all; cap 1: r = 2, 1.5, 1.01, 1.25, 1.1 are capped.
      (LossConfig(method="geo_mask", geo_mask_low=0.5, geo_mask_high=2.0, geo_mask_tis_c=1.0),
       np.minimum(r, 1.0) * SEQ_MASK, 5, []),
      (LossConfig(method="geo_mask", geo_mask_low=0.0, geo_mask_high=inf),
       np.minimum(r, 2.0) * SEQ_MASK, 0, []),
      # A_1 < 0 and mean_t (log q - log p) = log(4) / 3 > 1e-4: dropped; response 3 has A < 0 but
      # a negative statistic (p above q): kept.
      (LossConfig(method="opsm"), _rows([1.0, 0.0, 1.0, 1.0]), 0, [1]),
      (LossConfig(method="opsm", opsm_delta=inf), _rows([1.0, 1.0, 1.0, 1.0]), 0, []),
      # The rejection switch at threshold inf rejects nothing: TIS as it is.
      (LossConfig(method="tis", rejection="k3", rejection_reduce="max", rejection_threshold=inf),
       np.minimum(r, 2.0) * SEQ_MASK, 0, []),
  ]
  # OPSM over PPO: response 0 (A > 0) loses its r > 1.2 tokens to PPO's band, response 1 to OPSM.
  ppo_cfg = LossConfig(method="opsm", opsm_base="ppo")
  defaults = [c for c, *_ in cases if c in [LossConfig(method=m) for m in SEQ_METHODS]] + [ppo_cfg]
  outs = dict(zip(defaults, _rules(defaults, logp, logq, adv, mask=SEQ_MASK)))
  others = [c for c, *_ in cases if c not in outs]
  outs.update(zip(others, _rules(others, logp, logq, adv, mask=SEQ_MASK, metrics=False)))
  for cfg, want, clipped, dropped in cases:
    loss, m, w = outs[cfg]
    err = str(cfg)
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-7, err_msg=err)
    np.testing.assert_allclose(loss, -np.sum(want * adv[:, None] * logp) / N_SEQ_TOKENS,
                               rtol=1e-5, err_msg=err)
    if not m:
      continue
    np.testing.assert_allclose(m["frac_clipped"], clipped / N_SEQ_TOKENS, atol=1e-7, err_msg=err)
    np.testing.assert_allclose(m["frac_dropped"], SEQ_MASK[dropped].sum() / N_SEQ_TOKENS,
                               atol=1e-7, err_msg=err)
    np.testing.assert_allclose(m["seq_frac_dropped"], len(dropped) / 4, atol=1e-7, err_msg=err)
    np.testing.assert_allclose(m["weight_ess"], _ess(want), rtol=1e-5, err_msg=err)
  loss, m, w = outs[ppo_cfg]
  js, ws = zip(*[_ppo_expected(r[i], adv[i], 0.8, 1.2) for i in range(4)])
  want_w = np.stack(ws) * SEQ_MASK * np.array([[1], [0], [1], [1]])
  np.testing.assert_array_equal(want_w[0], [0.0, 0.0, 1.0])
  np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-7)
  want_j = np.stack(js) * SEQ_MASK * np.array([[1], [0], [1], [1]])
  np.testing.assert_allclose(loss, -want_j.sum() / N_SEQ_TOKENS, rtol=1e-5)
  np.testing.assert_allclose(m["frac_dropped"], 5 / N_SEQ_TOKENS, atol=1e-7)  # 2 by PPO, 3 by OPSM
  np.testing.assert_allclose(m["seq_frac_dropped"], 1 / 4, atol=1e-7)


def test_decoupled_ratio_and_decoupled_ppo_by_hand():
  """is_ratio='p_old': an IS weight reads p_old / q, PPO's band the staleness ratio s = p / p_old;
  decoupled_ppo is that PPO with the behaviour weight capped at 5 (at cap inf, exactly it)."""
  s = np.array([1.3, 1.1, 0.7, 0.9, 1.0, 4.0])    # p / p_old
  b = np.array([1.0, 7.0, 2.0, 0.5, 5.5, 1.0])    # p_old / q
  logp = np.full((2, 6), np.log(0.1), np.float32)
  logp_old = (logp - np.log(s)).astype(np.float32)
  logq = (logp_old - np.log(b)).astype(np.float32)
  adv = np.array([1.0, -2.0], np.float32)
  cfgs = [LossConfig(method="decoupled_ppo"), LossConfig(method="minirl", is_ratio="p_old"),
          LossConfig(method="ppo", is_ratio="p_old"),
          LossConfig(method="decoupled_ppo", decoupled_ppo_c=math.inf),
          LossConfig(method="tis", is_ratio="p_old"),
          LossConfig(method="seq_tis", is_ratio="p_old", seq_tis_c=math.inf)]
  # Diagnostics of the first two (the others': weights and losses only, faster).
  outs = (_rules(cfgs[:2], logp, logq, adv, logp_old_BT=logp_old)
          + _rules(cfgs[2:], logp, logq, adv, logp_old_BT=logp_old, metrics=False))
  # PPO on s: A > 0 drops s = 1.3 and 4.0 (> 1.2); A < 0 drops s = 0.7 (< 0.8), dual-clips 4.0 (> 3).
  js, ws = zip(*[_ppo_expected(s, a, 0.8, 1.2) for a in adv])
  j_ppo, w_ppo = np.stack(js), np.stack(ws)
  np.testing.assert_array_equal(w_ppo == 0, [[1, 0, 0, 0, 0, 1], [0, 0, 1, 0, 0, 1]])
  for cap, (loss, m, w) in zip((5.0, math.inf), (outs[0], outs[2])):
    bw = np.minimum(b, cap)[None]
    np.testing.assert_allclose(w, bw * w_ppo, rtol=1e-5, err_msg=str(cap))
    np.testing.assert_allclose(loss, -np.sum(bw * j_ppo) / 12, rtol=1e-5, err_msg=str(cap))
  m = outs[0][1]
  np.testing.assert_allclose(m["frac_clipped"], np.mean(b > 5.0), atol=1e-7)   # 7.0 and 5.5
  np.testing.assert_allclose(m["frac_dual_clipped"], 1 / 12, atol=1e-7)
  assert outs[2][0] == outs[3][0]   # decoupled_ppo at cap inf is PPO under is_ratio='p_old'
  np.testing.assert_array_equal(outs[2][2], outs[3][2])
  # TIS reads min(p_old / q, 2), whatever p / p_old is.
  loss, _, w = outs[4]
  want = np.minimum(b, 2.0)[None].repeat(2, 0)
  np.testing.assert_allclose(w, want, rtol=1e-5)
  np.testing.assert_allclose(loss, -np.sum(want * adv[:, None] * logp) / 12, rtol=1e-5)
  # MiniRL: its mask on s (A > 0: s > 1.27; A < 0: s < 0.8), its weight min(p_old / q, 5).
  loss, m, w = outs[1]
  keep = np.array([[0, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1]])
  want = keep * np.minimum(b, 5.0)[None]
  np.testing.assert_allclose(w, want, rtol=1e-5)
  np.testing.assert_allclose(loss, -np.sum(want * adv[:, None] * logp) / 12, rtol=1e-5)
  np.testing.assert_allclose(m["frac_masked"], 3 / 12, atol=1e-7)
  # A sequence statistic reads p_old too: exp(S_i) = prod_t p_old / q = 38.5 (prod_t p / q = 138.7).
  w = outs[5][2]
  np.testing.assert_allclose(w, np.full((2, 6), 1.0 * 7.0 * 2.0 * 0.5 * 5.5 * 1.0), rtol=1e-5)


def test_rejection_statistic_by_hand():
  """k1 = -l, k2 = l^2 / 2, k3 = r - 1 - l per token (l = log r), by mean, sum and max over each
  response's tokens (padding left out)."""
  l = np.log(SEQ_R.astype(np.float64))
  per_token = {"k1": -l, "k2": l * l / 2, "k3": SEQ_R - 1.0 - l}
  on = SEQ_MASK > 0
  all_nine = jax.jit(lambda l_BT, m_BT: [losses.rejection_statistic(l_BT, m_BT, e, red)
                                         for e, red in REJECTIONS])
  got = all_nine(jnp.asarray(l * SEQ_MASK, jnp.float32), jnp.asarray(SEQ_MASK))
  for (estimator, reduce), got_B in zip(REJECTIONS, got):
    k = per_token[estimator]
    want = {"mean": np.where(on, k, 0).sum(1) / on.sum(1), "sum": np.where(on, k, 0).sum(1),
            "max": np.where(on, k, -np.inf).max(1)}[reduce]
    np.testing.assert_allclose(got_B, want, rtol=1e-5, atol=1e-8, err_msg=f"{estimator} {reduce}")


def test_rejection_and_weight_normalization_by_hand():
  """The rejection switch zeroes whole responses before the method and logs its statistic; weight
  normalization divides the weights by their mean over the kept tokens; with centering on, the whole
  loss and gradient scale by that one constant (the centering coefficients are linear in f)."""
  logp, logq, adv = _seq_batch()
  r = SEQ_R.astype(np.float64)
  # k1 means -log(3)/3, log(4)/3, -log(1.00495)/2, -log(1.16875)/3 = -0.366, 0.462, -0.0025, -0.052:
  # above -0.02, responses 1 and 2 are rejected.
  k1_mean = np.array([-np.log(SEQ_PROD[0]) / 3, -np.log(SEQ_PROD[1]) / 3, -np.log(SEQ_PROD[2]) / 2,
                      -np.log(SEQ_PROD[3]) / 3])
  rej = dict(rejection="k1", rejection_threshold=-0.02)
  cfgs = [LossConfig(method="tis", **rej), LossConfig(method="tis", weight_norm=True, **rej),
          LossConfig(method="ppo", weight_norm=True), LossConfig(method="seq_mis", weight_norm=True)]
  # Diagnostics of the two rejection configs (the others': weights and losses only, faster).
  outs = (_rules(cfgs[:2], logp, logq, adv, mask=SEQ_MASK)
          + _rules(cfgs[2:], logp, logq, adv, mask=SEQ_MASK, metrics=False))
  tis_w = np.minimum(r, 2.0) * SEQ_MASK
  kept_rows = np.array([[1], [0], [0], [1]])
  m_rej = (2.0 + 1.5 + 1.0 + 1.25 + 0.85 + 1.1) / 6          # min(r, 2) over responses 0 and 3
  js, ws = zip(*[_ppo_expected(r[i], adv[i], 0.8, 1.2) for i in range(4)])
  ppo_w, ppo_j = np.stack(ws) * SEQ_MASK, np.stack(js) * SEQ_MASK
  m_ppo = (1.0 + 1.0 + 1.01 + 0.995 + 1.25 + 0.85 + 1.1) / 7  # PPO's kept (not dropped) tokens
  m_mis = (2 * SEQ_PROD[2] + 3 * SEQ_PROD[3]) / 5             # seq_mis keeps responses 2 and 3
  seq_mis_w = _rows([0.0, 0.0, SEQ_PROD[2], SEQ_PROD[3]])
  cases = [(kept_rows * tis_w, None, 1.0), (kept_rows * tis_w / m_rej, None, m_rej),
           (ppo_w / m_ppo, ppo_j / m_ppo, m_ppo), (seq_mis_w / m_mis, None, m_mis)]
  for cfg, (want, want_j, divisor), (loss, m, w) in zip(cfgs, cases, outs):
    err = str(cfg)
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-7, err_msg=err)
    if want_j is None:
      want_j = want * adv[:, None] * logp
    np.testing.assert_allclose(loss, -want_j.sum() / N_SEQ_TOKENS, rtol=1e-5, err_msg=err)
    if not m:
      continue
    np.testing.assert_allclose(m["weight_mean"], want.sum() / N_SEQ_TOKENS, rtol=1e-5, err_msg=err)
    if cfg.weight_norm:
      np.testing.assert_allclose(m["weight_norm_divisor"], divisor, rtol=1e-6, err_msg=err)
    if cfg.rejection != "none":
      np.testing.assert_allclose(m["frac_rejected"], 5 / N_SEQ_TOKENS, atol=1e-7)
      np.testing.assert_allclose(m["seq_frac_rejected"], 2 / 4, atol=1e-7)
      np.testing.assert_allclose(m["rejection_stat_mean"], k1_mean.mean(), rtol=1e-5)
      np.testing.assert_allclose(m["rejection_stat_max"], k1_mean.max(), rtol=1e-5)
      np.testing.assert_allclose(m["frac_dropped"], 0.0)   # rejected, not dropped by the method
  assert "weight_norm_divisor" not in outs[0][1]

  # Centering with TIS: with weight normalization, loss and gradient (sampled token and head)
  # are the unnormalized ones over the mean TIS weight.
  head_logq = np.log(np.broadcast_to([0.5, 0.2], SEQ_R.shape + (2,))).astype(np.float32)
  head_logp = np.log(np.broadcast_to([0.45, 0.25], SEQ_R.shape + (2,))).astype(np.float32)
  sc = [LossConfig(method="tis", score_centering="topk", topk=2, weight_norm=wn) for wn in (False, True)]

  @jax.jit
  def run(lp, hp):
    return [jax.value_and_grad(lambda y, h, c=c: rl_loss_from_logprobs(
        y, SEQ_MASK, adv, logq, c, head_logp_BTK=h, topk_logq_BTK=head_logq)[0], (0, 1))(lp, hp)
            for c in sc]

  (l0, (g0, gh0)), (l1, (g1, gh1)) = run(logp, head_logp)
  m_tis = tis_w.sum() / N_SEQ_TOKENS
  assert np.abs(gh0).max() > 0
  np.testing.assert_allclose(l1 * m_tis, l0, rtol=1e-6)
  np.testing.assert_allclose(g1 * m_tis, g0, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(gh1 * m_tis, gh0, rtol=1e-6, atol=1e-9)


def test_a_dropped_sequence_contributes_exactly_zero_gradient():
  """Response 0 (A < 0, the sampler e times likelier than the trainer at each token) is dropped by
  geo_mask, opsm and the rejection switch (with centering and weight normalization on; seq_mis
  drops through the same code as geo_mask):
  its log-probs and its head's get exactly 0 gradient, and moving them leaves the loss unchanged
  bit for bit. PG, the control, does both."""
  r = _rollout(seed=13, b=3, t=6, v=9, k=3)
  logp = _trainer_logp(r["logits"], r["targets"])
  head = np.take_along_axis(_log_softmax(r["logits"]), r["topk_ids"], -1).astype(np.float32)
  logq = r["logq"].copy()
  logq[0] = logp[0] + 1.0
  adv = r["adv"].copy()
  adv[0] = -1.0
  cfgs = [LossConfig(), LossConfig(method="geo_mask"), LossConfig(method="opsm", opsm_base="ppo"),
          LossConfig(method="tis", score_centering="topk", topk=3, rejection="k2",
                     rejection_reduce="max", weight_norm=True)]

  @jax.jit
  def run(lp, hp):
    return [jax.value_and_grad(lambda y, h, c=c: rl_loss_from_logprobs(
        y, r["mask"], adv, logq, c, head_logp_BTK=h, topk_logq_BTK=r["topk_logq"])[0], (0, 1))(lp, hp)
            for c in cfgs]

  moved, moved_head = logp.copy(), head.copy()
  moved[0] += 0.05            # still dropped: l_t = -0.95
  moved_head[0] -= 0.1
  for cfg, (loss, (g, gh)), (loss_moved, _) in zip(cfgs, run(logp, head), run(moved, moved_head)):
    if cfg.method == "pg":
      assert np.abs(g[0]).max() > 0 and float(loss) != float(loss_moved)
      continue
    np.testing.assert_array_equal(g[0], 0.0, err_msg=str(cfg))
    np.testing.assert_array_equal(gh[0], 0.0, err_msg=str(cfg))
    assert float(loss) == float(loss_moved), cfg


# --- Aggregation -----------------------------------------------------------------------------

def test_aggregation_closed_forms():
  r = _rollout(seed=7, b=4, t=5)
  lp = _trainer_logp(r["logits"], r["targets"])
  mask, adv = r["mask"], r["adv"]
  b, t = mask.shape
  n = float(mask.sum())
  len_B = mask.sum(1)
  aggs = ("batch_tokens", "constant", "seq_mean")
  outs = _rules([LossConfig(method="tis", aggregation=a) for a in aggs], lp, r["logq"], adv,
                mask=mask)
  (l_bt, _, w_bt), (l_c, _, w_c), (_, _, w_s) = outs  # w_* = -grad * N / A
  # batch_tokens closed form: d loss / d log p_it = -min(r, 2) A_i m_it / N.
  np.testing.assert_allclose(w_bt, np.minimum(np.exp(lp - r["logq"]), 2.0) * mask, rtol=1e-5)
  # constant vs batch_tokens: one scalar, N / (B * L_max), for loss and gradient alike.
  np.testing.assert_allclose(l_c, l_bt * n / (b * t), rtol=1e-6)
  np.testing.assert_allclose(w_c, w_bt * n / (b * t), rtol=1e-6)
  # Length normalization: response i's tokens scaled by N / (B L_i), not by one scalar.
  np.testing.assert_allclose(w_s, w_bt * n / (b * len_B[:, None]), rtol=1e-6, atol=1e-9)
  assert len(set(np.round(n / (b * len_B), 6))) > 1


# --- Diagnostics -----------------------------------------------------------------------------

def test_diagnostics_closed_forms():
  logp = np.log(np.array([[0.5, 0.2, 0.3], [0.4, 0.9, 0.1]], np.float32))
  logq = np.log(np.array([[0.4, 0.25, 0.3], [0.5, 0.8, 0.7]], np.float32))
  logp_old = np.log(np.array([[0.45, 0.2, 0.3], [0.4, 0.85, 0.1]], np.float32))
  mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
  topk_logq = np.log(np.array([[[0.4, 0.3]] * 3, [[0.5, 0.2]] * 3], np.float32))
  _, m = rl_loss_from_logprobs(logp, mask, np.array([1.0, -1.0], np.float32), logq,
                               LossConfig(method="tis"), logp_old_BT=logp_old,
                               topk_logq_BTK=topk_logq)
  on = mask > 0
  r = np.exp(logp - logq)[on]
  want = {
      "num_tokens": 5.0, "response_len_mean": 2.5,
      # Against the current p_theta (the sampler vs theta_old is the trainer's mismatch/*).
      "kl_k1_vs_current": np.mean((logq - logp)[on]),
      "kl_k3_vs_current": np.mean(r - 1 - np.log(r)),
      "is_ratio_mean": r.mean(), "is_ratio_max": r.max(), "is_ratio_min": r.min(),
      "is_ess": r.sum() ** 2 / (r.size * np.sum(r ** 2)),
      "staleness_ratio_max": np.exp(logp - logp_old)[on].max(),
      "head_mass_mean": 0.7, "head_mass_min": 0.7,
      "prob_diff_vs_current_mean": np.abs(np.exp(logp) - np.exp(logq))[on].mean(),
      "prob_diff_vs_current_max": np.abs(np.exp(logp) - np.exp(logq))[on].max(),
      "log_ppl_diff_vs_current": np.mean([np.mean((logp - logq)[0]), np.mean((logp - logq)[1, :2])]),
      "weight_mean": np.minimum(r, 2.0).mean(),
  }
  for k, v in want.items():
    np.testing.assert_allclose(m[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
  assert "entropy" not in m  # no vocabulary axis seen


def test_entropy_and_temperature_semantics():
  """Sampler logq at temperature tau, trainer with cfg.temperature = tau: exactly on-policy."""
  tau = 0.6
  r = _rollout(seed=2, noise=0.0, temperature=tau)
  args = (r["logits"], r["targets"], r["mask"], r["adv"], r["logq"])
  run = jax.jit(lambda *a: (rl_loss(*a, LossConfig(temperature=tau))[1],
                            rl_loss(*a, LossConfig(temperature=1.0))[1]))
  m, m1 = run(*args)
  np.testing.assert_allclose(m["is_ratio_mean"], 1.0, rtol=1e-5)
  np.testing.assert_allclose(m["kl_k1_vs_current"], 0.0, atol=1e-6)
  lp = _log_softmax(r["logits"] / tau)
  ent = -np.sum(np.exp(lp) * lp, -1)
  np.testing.assert_allclose(m["entropy"], np.sum(ent * r["mask"]) / r["mask"].sum(), rtol=1e-5)
  assert abs(float(m1["kl_k1_vs_current"])) > 1e-2  # forgetting the temperature: a bookkeeping mismatch


def test_padding_garbage_is_harmless():
  r = _rollout(seed=4, k=3)
  pad = r["mask"] == 0
  assert pad.any()
  clean = dict(logq=r["logq"], topk_logq=r["topk_logq"], logp_old=r["logq"])
  dirty = dict(logq=np.where(pad, np.nan, r["logq"]),
               topk_logq=np.where(pad[..., None], -np.inf, r["topk_logq"]),
               logp_old=np.where(pad, np.inf, r["logq"]))
  cfgs = [LossConfig(method=m, score_centering=sc, topk=3)
          for m, sc in (("tis", "topk"), ("gspo", "none"), ("minirl", "none"), ("dppo", "none"))]

  @jax.jit
  def run(x, d):
    fn = lambda y, c: rl_loss(y, r["targets"], r["mask"], r["adv"], d["logq"], c,
                              logp_old_BT=d["logp_old"], topk_ids_BTK=r["topk_ids"],
                              topk_logq_BTK=d["topk_logq"])
    return [jax.value_and_grad(fn, has_aux=True)(x, c) for c in cfgs]

  for cfg, a, b in zip(cfgs, run(r["logits"], clean), run(r["logits"], dirty)):
    (l1, m1), g1 = b
    assert np.isfinite(l1) and np.isfinite(g1).all(), cfg.method
    assert all(np.isfinite(v) for v in m1.values()), cfg.method
    np.testing.assert_array_equal(a[0][0], l1)
    np.testing.assert_array_equal(a[1], g1)


# --- Jit once, chunked == unchunked, memory -------------------------------------------------

def test_jits_once_per_shape(monkeypatch):
  traces = []
  real = losses._loss_core
  monkeypatch.setattr(losses, "_loss_core", lambda *a: (traces.append(1), real(*a))[1])
  cfg = LossConfig(method="tis", score_centering="topk", topk=2)
  before = rl_loss._cache_size()
  for seed in range(3):  # new values, same shapes (a shape no other test uses)
    r = _rollout(seed=seed, b=3, t=11, v=13, k=2)
    rl_loss(r["logits"], r["targets"], r["mask"], r["adv"], r["logq"],
            dataclasses.replace(cfg), topk_ids_BTK=r["topk_ids"], topk_logq_BTK=r["topk_logq"])
  assert len(traces) == 1 and rl_loss._cache_size() == before + 1
  r = _rollout(seed=0, b=3, t=12, v=13, k=2)
  rl_loss(r["logits"], r["targets"], r["mask"], r["adv"], r["logq"], cfg,
          topk_ids_BTK=r["topk_ids"], topk_logq_BTK=r["topk_logq"])
  assert len(traces) == 2 and rl_loss._cache_size() == before + 2


def test_chunked_equals_unchunked():
  b, t, d, v = 2, 7, 5, 11
  rng = np.random.default_rng(9)
  hidden = rng.normal(size=(b, t, d)).astype(np.float32)
  w = rng.normal(size=(d, v)).astype(np.float32)
  r = _rollout(seed=9, b=b, t=t, v=v, k=3)
  kw = dict(topk_ids_BTK=r["topk_ids"], topk_logq_BTK=r["topk_logq"])
  rest = (r["targets"], r["mask"], r["adv"], r["logq"])
  # T = 7 in chunks of 3 exercises the padded last chunk; GSPO needs whole-response means.
  # chunk_size=None reads cfg.chunk_size.
  cases = [(LossConfig(method="tis", score_centering="topk", topk=3), (3,)),
           (LossConfig(method="gspo", chunk_size=3), (None,))]

  @jax.jit
  def run(h, w_):
    out = []
    for cfg, chunks in cases:
      via_logits = lambda h, w_: rl_loss(jnp.einsum("btd,dv->btv", h, w_), *rest, cfg, **kw)
      fns = [via_logits] + [
          lambda h, w_, c=c: rl_loss_from_hidden(h, w_, *rest, cfg, chunk_size=c, **kw)
          for c in chunks]
      out.append([jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w_) for f in fns])
    return out

  for (cfg, _), results in zip(cases, run(hidden, w)):
    (l0, m0), g0 = results[0]
    for (l, m), g in results[1:]:
      np.testing.assert_allclose(l, l0, rtol=1e-6, err_msg=cfg.method)
      for k in m0:
        np.testing.assert_allclose(m[k], m0[k], rtol=1e-5, atol=1e-7, err_msg=k)
      for a, bb in zip(g, g0):
        np.testing.assert_allclose(a, bb, rtol=1e-5, atol=1e-6, err_msg=cfg.method)


def test_memory_one_btv_tensor_and_chunking_bounds_it():
  b, t, d, v, chunk = 2, 32, 8, 1024, 4
  btv_bytes = b * t * v * 4
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(b, t, d)).astype(np.float32)
  w = rng.normal(size=(d, v)).astype(np.float32)
  logits = np.einsum("btd,dv->btv", hidden, w)
  tg = rng.integers(0, v, (b, t))
  ids = np.argsort(-logits, -1)[..., :4]
  rest = (tg, np.ones((b, t), np.float32), np.ones((b,), np.float32),
          np.full((b, t), -1.0, np.float32))
  cfg = LossConfig(method="tis", score_centering="topk", topk=4)
  kw = dict(topk_ids_BTK=ids, topk_logq_BTK=np.full(ids.shape, -3.0, np.float32))
  temp = lambda fn, *a: jax.jit(fn).lower(*a).compile().memory_analysis().temp_size_in_bytes
  g_hidden = lambda c: jax.grad(
      lambda h, w_: rl_loss_from_hidden(h, w_, *rest, cfg, chunk_size=c, **kw)[0], (0, 1))
  jax.config.update("jax_disable_most_optimizations", False)  # measure what training runs
  try:
    # float32 logits: the gradient output is the one [B, T, V] float32 tensor; temporaries
    # stay below one more. bf16 logits: the float32 gradient before its cast is the one.
    g_logits = jax.value_and_grad(lambda x: rl_loss(x, *rest, cfg, **kw), has_aux=True)
    assert temp(g_logits, logits) < btv_bytes
    assert temp(g_logits, logits.astype(jnp.bfloat16)) < 1.25 * btv_bytes
    full = temp(g_hidden(0), hidden, w)
    chunked = temp(g_hidden(chunk), hidden, w)
  finally:
    jax.config.update("jax_disable_most_optimizations", True)
  assert full >= btv_bytes  # the unchunked path holds whole logits
  assert chunked < btv_bytes / 2, (chunked, btv_bytes)
