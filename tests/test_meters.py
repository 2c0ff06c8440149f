"""Drift meters: total variation (exact and top-k head + tail) and score centering's share of the update."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.rl import meters
from rl_jax.rl import step as step_lib
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.rl.loss.losses import rl_loss

pytestmark = pytest.mark.usefixtures("fast_compile")


def _log(x):
  return np.log(np.asarray(x, np.float32))


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_tv_closed_forms_on_a_tiny_vocabulary():
  q, p = [0.5, 0.3, 0.2], [0.2, 0.3, 0.5]
  # 1/2 (0.3 + 0 + 0.3)
  np.testing.assert_allclose(meters.exact_tv(_log(p), _log(q)), 0.3, rtol=1e-6)
  # Whole vocabulary as the head (sampler's order): exact.
  np.testing.assert_allclose(meters.topk_tv(_log(p), _log(q)), 0.3, rtol=1e-6)
  # Head {0}: 1/2 (|0.5 - 0.2| + |0.5 - 0.8|) = 0.3 (here the bound is tight).
  np.testing.assert_allclose(meters.topk_tv(_log(p[:1]), _log(q[:1])), 0.3, rtol=1e-6)
  # A strict lower bound: equal heads and tail masses, different tails.
  q2, p2 = [0.5, 0.3, 0.2], [0.5, 0.2, 0.3]
  np.testing.assert_allclose(meters.exact_tv(_log(p2), _log(q2)), 0.1, rtol=1e-6)
  np.testing.assert_allclose(meters.topk_tv(_log(p2[:1]), _log(q2[:1])), 0.0, atol=1e-7)
  # p == q: zero, full and top-k.
  assert float(meters.exact_tv(_log(q), _log(q))) == 0.0
  np.testing.assert_allclose(meters.topk_tv(_log(q[:2]), _log(q[:2])), 0.0, atol=1e-7)


def test_topk_tv_is_a_lower_bound_growing_to_the_exact_tv():
  rng = np.random.default_rng(0)
  v = 7
  logq = _log_softmax(2.0 * rng.normal(size=(50, v))).astype(np.float32)
  logp = _log_softmax(2.0 * rng.normal(size=(50, v))).astype(np.float32)
  order = np.argsort(-logq, -1)   # the sampler's top-k order
  head_q = np.take_along_axis(logq, order, -1)
  head_p = np.take_along_axis(logp, order, -1)
  exact = np.asarray(meters.exact_tv(logp, logq))
  tvs = np.asarray(jax.jit(lambda hp, hq: jnp.stack(
      [meters.topk_tv(hp[:, :k], hq[:, :k]) for k in range(1, v + 1)]))(head_p, head_q))
  assert (tvs <= exact[None] + 1e-6).all()
  assert (np.diff(tvs, axis=0) >= -1e-6).all()   # splitting the tail never lowers the bound
  np.testing.assert_allclose(tvs[-1], exact, atol=1e-6)
  assert (tvs[0] < exact - 1e-3).any()            # and at small k it is a strict bound


def _grad_sq_norms_by_autodiff(z_NV, y_N, w_N, a_N, c_NK, ids_NK):
  """||d ell / dz||^2 of ell = -w A log p_y + A sum_H c log p_v, and of its centering term."""
  def ell(z, with_rule):
    lp = jax.nn.log_softmax(z)
    rule = -w_N * a_N * jnp.take_along_axis(lp, y_N[:, None], -1)[:, 0]
    sc = a_N * jnp.sum(c_NK * jnp.take_along_axis(lp, ids_NK, -1), -1)
    return jnp.sum(sc + rule * with_rule)
  grad = jax.jit(jax.grad(ell))  # one program for both (eagerly every op compiles its own)
  g = grad(z_NV, 1.0)
  g_sc = grad(z_NV, 0.0)
  return np.sum(np.square(g), -1), np.sum(np.square(g_sc), -1)


@pytest.mark.parametrize("k", [6, 3])
def test_sc_logit_grad_norms_match_autodiff(k):
  rng = np.random.default_rng(1)
  n, v = 8, 6
  z = rng.normal(size=(n, v)).astype(np.float32)
  ids = np.argsort(-rng.normal(size=(n, v)), -1)[:, :k]
  y = rng.integers(0, v, n)
  w, a = rng.uniform(0.2, 2.0, n).astype(np.float32), rng.normal(size=n).astype(np.float32)
  c = rng.normal(size=(n, k)).astype(np.float32)
  p = np.exp(_log_softmax(z))
  total, sc = jax.jit(meters.sc_logit_grad_sq_norms)(
      weight_X=w, adv_X=a, c_XK=c, head_p_XK=np.take_along_axis(p, ids, -1),
      p_y_X=p[np.arange(n), y], y_in_head_XK=(ids == y[:, None]).astype(np.float32))
  want_total, want_sc = _grad_sq_norms_by_autodiff(z, y, w, a, c, ids)
  # Documented omission: s^2 sum of p_v^2 outside H and y (zero when H is the vocabulary).
  rest = np.ones((n, v), bool)
  rest[np.arange(n)[:, None], ids] = False
  rest[np.arange(n), y] = False
  p_rest_sq = np.sum(np.where(rest, p * p, 0.0), -1)
  s_total, s_sc = a * (c.sum(-1) - w), a * c.sum(-1)
  np.testing.assert_allclose(total, want_total - s_total ** 2 * p_rest_sq, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(sc, want_sc - s_sc ** 2 * p_rest_sq, rtol=1e-4, atol=1e-6)
  if k == v:
    assert not rest.any()


def _batch(seed=0, b=3, t=5, v=6):
  rng = np.random.default_rng(seed)
  logits = (1.5 * rng.normal(size=(b, t, v))).astype(np.float32)
  samp = _log_softmax(logits + 0.8 * rng.normal(size=(b, t, v))).astype(np.float32)
  targets = rng.integers(0, v, (b, t))
  logq = np.take_along_axis(samp, targets[..., None], -1)[..., 0]
  ids = np.argsort(-samp, -1, kind="stable")
  mask = (np.arange(t)[None] < np.array([t, 3, 1])[:, None]).astype(np.float32)
  adv = np.array([1.0, -0.5, 0.7], np.float32)
  return logits, targets, mask, adv, logq, ids, np.take_along_axis(samp, ids, -1), samp


def test_loss_logs_drift_whenever_the_head_is_given():
  logits, targets, mask, adv, logq, ids, ids_logq, samp = _batch()
  v = logits.shape[-1]
  trainer = _log_softmax(logits)
  on = mask > 0
  exact = np.asarray(meters.exact_tv(trainer, samp))
  cfg = LossConfig(method="tis")

  @jax.jit
  def run(logits):
    return [rl_loss(logits, targets, mask, adv, logq, cfg)[1],
            rl_loss(logits, targets, mask, adv, logq, cfg, topk_ids_BTK=ids,
                    topk_logq_BTK=ids_logq)[1],
            rl_loss(logits, targets, mask, adv, logq, cfg, topk_ids_BTK=ids[..., :2],
                    topk_logq_BTK=ids_logq[..., :2])[1],
            rl_loss(logits, targets, mask, adv, logq,
                    LossConfig(method="tis", score_centering="topk", topk=2),
                    topk_ids_BTK=ids[..., :4], topk_logq_BTK=ids_logq[..., :4])[1]]
  none, full, top2, sc_top2_of_4 = run(logits)
  assert not any(k.startswith("drift/") for k in none)   # only the sampled token: no TV
  assert "drift/sc_share" not in full
  # Full recorded distribution: the exact TV, mean and max over response tokens.
  np.testing.assert_allclose(full["drift/tv_mean"], exact[on].mean(), rtol=1e-5)
  np.testing.assert_allclose(full["drift/tv_max"], exact[on].max(), rtol=1e-5)
  # Top-2 head: the head + tail estimate, below the exact TV.
  head_p = np.take_along_axis(trainer, ids[..., :2], -1)
  est = np.asarray(meters.topk_tv(head_p, ids_logq[..., :2]))
  np.testing.assert_allclose(top2["drift/tv_mean"], est[on].mean(), rtol=1e-5)
  assert float(top2["drift/tv_mean"]) < float(full["drift/tv_mean"])
  # The meter reads the whole recorded head even when centering uses a prefix of it.
  est4 = np.asarray(meters.topk_tv(np.take_along_axis(trainer, ids[..., :4], -1),
                                   ids_logq[..., :4]))
  np.testing.assert_allclose(sc_top2_of_4["drift/tv_mean"], est4[on].mean(), rtol=1e-5)
  assert ids.shape[-1] == v


def test_sc_share_matches_the_gradients_it_describes():
  """Full centering: ||grad(SC loss) - grad(plain loss)|| / ||grad(SC loss)|| over the logits."""
  logits, targets, mask, adv, logq, ids, ids_logq, _ = _batch(seed=3)
  kw = dict(topk_ids_BTK=ids, topk_logq_BTK=ids_logq)
  sc_cfg = LossConfig(method="tis", score_centering="full")
  plain = LossConfig(method="tis")

  @jax.jit
  def run(logits):
    (_, m), g_sc = jax.value_and_grad(
        lambda z: rl_loss(z, targets, mask, adv, logq, sc_cfg, **kw), has_aux=True)(logits)
    g_plain = jax.grad(lambda z: rl_loss(z, targets, mask, adv, logq, plain, **kw)[0])(logits)
    return m, g_sc, g_plain
  m, g_sc, g_plain = run(logits)
  # batch_tokens: every token's logit gradient carries the same 1 / n, which cancels.
  want = np.linalg.norm(g_sc - g_plain) / np.linalg.norm(g_sc)
  np.testing.assert_allclose(m["drift/sc_share"], want, rtol=1e-4)
  assert want > 0.01   # the meter sees a non-trivial share
  # Identical distributions: the centering term is zero in expectation and here exactly
  # (c_v = q_v w(1) = q_v = p_v cancels against sum c = 1 times p): no share.
  same = _log_softmax(logits)
  logq_same = np.take_along_axis(same, targets[..., None], -1)[..., 0]
  m_same = rl_loss(logits, targets, mask, adv, logq_same, LossConfig(score_centering="full"),
                   topk_ids_BTK=ids, topk_logq_BTK=np.take_along_axis(same, ids, -1))[1]
  np.testing.assert_allclose(m_same["drift/sc_share"], 0.0, atol=1e-3)
  np.testing.assert_allclose(m_same["drift/tv_max"], 0.0, atol=1e-6)


# --- First-order-approximation meter ------------------------------------------------------

def test_seq_surrogate_has_the_gradient_of_the_sequence_objective():
  """grad S = grad J_seq, J_seq = (1/Z) sum_i A_i exp(sum_t m (log p - log q)) by autodiff."""
  rng = np.random.default_rng(1)
  logp = jnp.asarray(rng.normal(-1.0, 0.3, size=(3, 4)), jnp.float32)
  logq = jnp.asarray(rng.normal(-1.0, 0.3, size=(3, 4)), jnp.float32)
  mask = jnp.asarray([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], jnp.float32)
  adv = jnp.asarray([0.7, -1.2, 0.4], jnp.float32)
  z = meters.seq_normalizer(mask, "batch_tokens")
  assert float(z) == 7.0 and float(meters.seq_normalizer(mask, "constant")) == 12.0

  def j_seq(lp):
    return jnp.sum(adv * jnp.exp(jnp.sum(mask * (lp - logq), axis=1))) / z
  # Jitted: eagerly every op compiles its own XLA program.
  g_ref = jax.jit(jax.grad(j_seq))(logp)
  sur_grad = jax.jit(jax.grad(lambda *a: meters.seq_objective_surrogate(*a)[0]))
  g_sur = sur_grad(logp, logq, adv, mask, z)
  np.testing.assert_allclose(g_sur, g_ref, rtol=1e-5, atol=1e-7)
  # Padding may hold anything the sampler wrote: it must not leak into w_i or the gradient.
  bad_q = jnp.where(mask > 0, logq, -jnp.inf)
  g_bad = sur_grad(logp, bad_q, adv, mask, z)
  np.testing.assert_allclose(g_bad, g_ref, rtol=1e-5, atol=1e-7)


def test_grad_alignment_closed_forms():
  g = {"a": jnp.asarray([3.0, 0.0]), "b": jnp.asarray([[4.0]])}
  same = meters.grad_alignment(g, g)
  np.testing.assert_allclose([same["cosine"], same["norm_ratio"]], [1.0, 1.0], rtol=1e-6)
  # Orthogonal halves: cos = 3*0 + 0*... ; here g2 = (0, 5 | 0): <g, g2> = 0, ||g2|| = 5.
  g2 = {"a": jnp.asarray([0.0, 5.0]), "b": jnp.asarray([[0.0]])}
  out = meters.grad_alignment(g, g2)
  np.testing.assert_allclose([out["cosine"], out["norm_ratio"]], [0.0, 1.0], atol=1e-7)
  # Scaled and flipped: cos = -1, ratio = 1/2.
  out = meters.grad_alignment(jax.tree.map(lambda x: -0.5 * x, g), g)
  np.testing.assert_allclose([out["cosine"], out["norm_ratio"]], [-1.0, 0.5], rtol=1e-6)
  zero = jax.tree.map(jnp.zeros_like, g)
  out = meters.grad_alignment(zero, g)
  assert float(out["cosine"]) == 0.0 and float(out["norm_ratio"]) == 0.0


@pytest.fixture(scope="module")
def tiny_policy():
  from rl_jax import train_state  # pylint: disable=g-import-not-at-top
  from rl_jax.models import ModelConfig  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                    d_ff=32, init_std=0.5)
  return train_state.init_params(cfg, 0)


def _train_batch(rng, lengths, prompt_len=3, t=5, v=32):
  b = len(lengths)
  tokens = rng.integers(0, v, size=(b, prompt_len + t)).astype(np.int32)
  resp_mask = (np.arange(t)[None] < np.asarray(lengths)[:, None])
  valid = np.concatenate([np.ones((b, prompt_len), bool), resp_mask], axis=1)
  pos = np.broadcast_to(np.arange(prompt_len + t, dtype=np.int32), tokens.shape)
  return step_lib.TrainBatch(prompt_len=prompt_len, tokens_BS=jnp.asarray(tokens), positions_BS=jnp.asarray(pos),
                    valid_BS=jnp.asarray(valid), response_BT=jnp.asarray(tokens[:, prompt_len:]),
                    response_mask_BT=jnp.asarray(resp_mask), logq_BT=jnp.zeros((b, t), jnp.float32),
                    adv_B=jnp.asarray([1.0, -0.6, 0.3, -0.7][:b], jnp.float32))


_OLD_FORWARD = jax.jit(step_lib.old_forward, static_argnames=("graphdef", "loss_cfg"))


def _on_policy(graphdef, params, batch):
  """q := the trainer's own p (zero mismatch); one compiled forward for every test."""
  logp, _, _ = _OLD_FORWARD(params, batch, graphdef=graphdef, loss_cfg=LossConfig())
  return batch.replace(logq_BT=logp, logp_old_BT=logp)


def test_first_order_on_policy_identity_and_its_breaking(tiny_policy):
  """On-policy, zero mismatch, PG: g_tok = g_seq (cos 1, ratio 1); mismatch breaks the identity."""
  graphdef, params = tiny_policy
  # 'batch_tokens' divides by sum_i L_i, the sequence objective's Z (meters.seq_normalizer).
  cfg = LossConfig(method="pg", aggregation="batch_tokens")
  batch = _on_policy(graphdef, params, _train_batch(np.random.default_rng(0), [5, 3, 4, 2]))
  fo = step_lib.first_order_jit(params, batch, graphdef=graphdef, loss_cfg=cfg)
  np.testing.assert_allclose(float(fo["cosine"]), 1.0, atol=1e-5)
  np.testing.assert_allclose(float(fo["norm_ratio"]), 1.0, atol=1e-5)
  # Mismatch: q != p makes the sequence weights w_i differ from 1 (and from each other).
  noise = jnp.asarray(np.random.default_rng(1).normal(0.0, 0.5, batch.logq_BT.shape), jnp.float32)
  off = batch.replace(logq_BT=batch.logq_BT + noise)
  fo = step_lib.first_order_jit(params, off, graphdef=graphdef, loss_cfg=cfg)
  assert float(fo["cosine"]) < 0.999, fo
  assert abs(float(fo["norm_ratio"]) - 1.0) > 1e-3, fo


def test_first_order_length_normalization_breaks_the_identity(tiny_policy):
  """seq_mean weighs response i by 1/L_i: with unequal lengths the directions differ on-policy;
  with equal lengths it is batch_tokens again (cos 1, ratio 1)."""
  graphdef, params = tiny_policy
  cfg = LossConfig(method="pg", aggregation="seq_mean")
  unequal = _on_policy(graphdef, params, _train_batch(np.random.default_rng(0), [5, 1, 4, 2]))
  fo = step_lib.first_order_jit(params, unequal, graphdef=graphdef, loss_cfg=cfg)
  assert float(fo["cosine"]) < 0.999, fo
  equal = _on_policy(graphdef, params, _train_batch(np.random.default_rng(0), [4, 4, 4, 4]))
  fo = step_lib.first_order_jit(params, equal, graphdef=graphdef, loss_cfg=cfg)
  np.testing.assert_allclose([float(fo["cosine"]), float(fo["norm_ratio"])], [1.0, 1.0], atol=1e-5)
