"""Score centering by exact enumeration: drift of PG under q != p, zero expected SC update ([SC], Eqs. 3-12)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.rl.loss.loss_config import LossConfig, sc_composable_methods
from rl_jax.rl.loss.losses import rl_loss, score_centering_coeffs

V, T, K = 4, 3, 2            # vocabulary, response length, top-k head size
SC_METHODS = tuple(sc_composable_methods())   # every method centering composes with


pytestmark = pytest.mark.usefixtures("fast_compile")


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


class TinyModel:
  """A tabular policy: one row of logits per prefix of a length-T response over V tokens.

  Row of prefix (y_0..y_{t-1}) = offset_t + sum_j y_j V^(t-1-j), offset_t = sum_{j<t} V^j,
  so d log p(v | h) / d theta[h] = e_v - p(.|h) and every prefix has its own parameters:
  the gradient at row h is exactly the update at prefix h.
  """

  def __init__(self, seed, mismatch=1.5):
    rng = np.random.default_rng(seed)
    self.offsets = np.cumsum([0] + [V ** t for t in range(T - 1)])
    self.n_rows = int(self.offsets[-1] + V ** (T - 1))
    self.theta = rng.normal(size=(self.n_rows, V)).astype(np.float32)
    self.p = _softmax(self.theta.astype(np.float64))
    q0 = _softmax(self.theta + mismatch * rng.normal(size=self.theta.shape))
    # The recorded head H = top-K of q0; q = q-hat of [SC] Eq. 7: q0 on H, rho * p on the tail.
    # Sampling from q-hat makes "expected update under the reconstructed sampler" the true
    # expectation over this sampler's rollouts.
    self.head = np.argsort(-q0, -1, kind="stable")[:, :K]
    in_head = np.zeros_like(q0, bool)
    np.put_along_axis(in_head, self.head, True, -1)
    rho = (1 - (q0 * in_head).sum(-1, keepdims=True)) / (1 - (self.p * in_head).sum(-1,
                                                                                 keepdims=True))
    self.q = np.where(in_head, q0, rho * self.p)
    assert np.allclose(self.q.sum(-1), 1.0) and not np.allclose(self.q, self.p)
    self.seqs = np.array(list(itertools.product(range(V), repeat=T)))       # [N, T]
    self.rows = np.stack([self.row(y) for y in self.seqs])                   # [N, T]
    self.logq_NT = np.log(np.take_along_axis(self.q[self.rows], self.seqs[..., None], -1)[..., 0])
    self.q_seq = np.exp(self.logq_NT.sum(-1))                                # q(y)
    assert np.isclose(self.q_seq.sum(), 1.0)

  def row(self, y):
    return np.array([self.offsets[t] + sum(y[j] * V ** (t - 1 - j) for j in range(t))
                     for t in range(T)])

  def reach_prob(self):
    """P_q(prefix h) for every row h."""
    out = np.zeros(self.n_rows)
    for y, rows, lq in zip(self.seqs, self.rows, self.logq_NT):
      for t in range(T):
        out[rows[t]] = np.exp(lq[:t].sum())
    return out

  def sampler_log(self, k):
    """The sampler's logged top-k (ids, logprobs) at every position of every sequence."""
    if k == V:
      ids = np.argsort(-self.q, -1, kind="stable")
    else:
      ids = self.head
    ids_NTK = ids[self.rows]
    return ids_NTK, np.log(np.take_along_axis(self.q[self.rows], ids_NTK, -1)).astype(np.float32)


def _per_sequence_grads(model, variants, rewards):
  """d loss(y) / d theta for every continuation y (B = 1 each), per (cfg, k) variant and reward.

  One compile for all variants and rewards; k = 0 means no top-k is passed.
  """
  rows = jnp.asarray(model.rows)
  n = len(model.seqs)
  logs = {k: model.sampler_log(k) for _, k in variants if k}
  none = (np.zeros((n, T, 1), np.int32), np.zeros((n, T, 1), np.float32))

  @jax.jit
  def run(theta, adv):
    out = []
    for cfg, k in variants:
      def loss(th, r, y, lq, i, tl, cfg=cfg, k=k):
        kw = dict(topk_ids_BTK=i[None], topk_logq_BTK=tl[None]) if k else {}
        return rl_loss(th[r][None], y[None], jnp.ones((1, T)), adv, lq[None], cfg,
                       logp_old_BT=lq[None], **kw)[0]
      out.append(jax.vmap(jax.grad(loss), (None, 0, 0, 0, 0, 0))(
          theta, rows, model.seqs, model.logq_NT.astype(np.float32), *logs.get(k, none)))
    return out

  return [[np.asarray(g, np.float64) for g in run(jnp.asarray(model.theta),
                                                  jnp.full((1,), r, jnp.float32))]
          for r in rewards]


def _expect(model, g_N):
  return np.einsum("n,n...->...", model.q_seq, g_N)


def test_drift_and_score_centering_by_enumeration():
  model = TinyModel(0)
  variants = [(LossConfig(method="pg"), 0), (LossConfig(method="naive_is"), 0),
              (LossConfig(method="tis"), 0), (LossConfig(method="mis"), 0)]
  variants += [(LossConfig(method=m, score_centering="full"), V) for m in SC_METHODS]
  variants += [(LossConfig(method=m, score_centering="topk", topk=K), K) for m in SC_METHODS]
  # The ratios p/q must reach into TIS's clip and MIS's drop region, or SC+TIS / SC+MIS
  # would be tested only where they equal plain SC.
  r_head = np.take_along_axis(model.p / model.q, model.head, -1)
  assert (r_head > 2.0).any() and ((r_head > 5.0) | (r_head < 0.5)).any()
  reach = model.reach_prob()[:, None]
  rewards = (1.0, -1.0)  # constant reward; A < 0 exercises PPO's other branch
  for reward, gs in zip(rewards, _per_sequence_grads(model, variants, rewards)):
    grads = dict(zip([(c.method, c.score_centering) for c, _ in variants], gs))
    e = {key: _expect(model, g) for key, g in grads.items()}
    # Drift ([SC], Eq. 3; docs/math.md#drift): E_q[-R grad log p(y_t)] / T at row h
    # = -(R/T) P_q(h) (q_h - p_h).
    drift = -(reward / T) * reach * (model.q - model.p)
    np.testing.assert_allclose(e[("pg", "none")], drift, rtol=1e-5, atol=1e-8)
    assert np.abs(drift).max() > 1e-2
    # Exact IS has no drift; clipped / masked IS reintroduces it ([SC], Sec. 4).
    np.testing.assert_allclose(e[("naive_is", "none")], 0.0, atol=1e-6)
    assert np.abs(e[("tis", "none")]).max() > 1e-3
    assert np.abs(e[("mis", "none")]).max() > 1e-3
    # Score centering: zero expected update at every prefix, for any composed weight.
    for m in SC_METHODS:
      for sc in ("full", "topk"):
        np.testing.assert_allclose(e[(m, sc)], 0.0, atol=1e-6, err_msg=f"{m}+sc {sc} R={reward}")


def test_topk_with_k_equal_v_is_full_sc():
  model = TinyModel(2)
  methods = ("pg", "tis", "mis")
  variants = [(LossConfig(method=m, score_centering="full"), V) for m in methods]
  variants += [(LossConfig(method=m, score_centering="topk", topk=V), V) for m in methods]
  [g] = _per_sequence_grads(model, variants, [0.7])
  for i, m in enumerate(methods):  # per continuation, not only in expectation
    np.testing.assert_allclose(g[i + len(methods)], g[i], rtol=1e-5, atol=1e-7, err_msg=m)


def test_identity_weight_centering_term_vanishes():
  """f(r) = r: q_v w_v = p_v and alpha = rho (1/rho) = 1, so top-k c_v = p_v - p_v = 0."""
  model = TinyModel(3)
  ids_NTK, tlq_NTK = model.sampler_log(K)
  head_logp = np.log(np.take_along_axis(model.p[model.rows], ids_NTK, -1)).astype(np.float32)
  c, stats = score_centering_coeffs(
      jnp.asarray(head_logp), jnp.asarray(tlq_NTK), jnp.ones(model.rows.shape),
      LossConfig(method="naive_is", score_centering="topk", topk=K))
  np.testing.assert_allclose(c, 0.0, atol=1e-6)
  assert np.abs(np.exp(tlq_NTK) - np.exp(head_logp)).max() > 1e-2  # q != p on the head
  # ... and rho is the tail-mass ratio of [SC], Eq. 7.
  q_head = np.exp(tlq_NTK).sum(-1)
  np.testing.assert_allclose(stats["sc_rho_mean"], (1 - q_head) / (1 - np.exp(head_logp).sum(-1)),
                             rtol=1e-4)
  variants = [(LossConfig(method="naive_is"), 0),
              (LossConfig(method="naive_is", score_centering="topk", topk=K), K),
              (LossConfig(method="naive_is", score_centering="full"), V)]
  [(g_is, g_topk, g_full)] = _per_sequence_grads(model, variants, [1.0])
  np.testing.assert_allclose(g_topk, g_is, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(g_full, g_is, rtol=1e-5, atol=1e-7)


def test_sc_expected_update_is_covariance_under_q():
  """One step (T = 1), reward R_y: E_q[R (w_y s_y - E_q[w s])] in closed form ([SC], Eqs. 5, 9).

  With u = q * w (u = q for vanilla SC) and d loss / d z = -(that), the expectation is
  sum_y q_y R_y w_y (e_y - p) - E_q[R] (u - sum(u) p) = R*u - (R.u) p - (q.R)(u - sum(u) p).
  """
  rng = np.random.default_rng(5)
  z = rng.normal(size=V).astype(np.float32)
  p = _softmax(z.astype(np.float64))
  q = _softmax(z + 1.5 * rng.normal(size=V))
  reward = rng.normal(size=V)
  ids = np.arange(V)
  cfgs = [LossConfig(method=m, score_centering=s)
          for m, s in (("pg", "none"), ("pg", "full"), ("tis", "full"))]

  @jax.jit
  def run(zz):
    def loss(z_, y, r, cfg):
      return rl_loss(z_[None, None], y[None, None], jnp.ones((1, 1)), r[None],
                     jnp.log(q.astype(np.float32))[y][None, None], cfg,
                     topk_ids_BTK=ids[None, None],
                     topk_logq_BTK=np.log(q).astype(np.float32)[None, None])[0]
    return [jax.vmap(jax.grad(loss), (None, 0, 0, None))(zz, ids, reward.astype(np.float32), c)
            for c in cfgs]

  g_pg, g_sc, g_tis = [np.einsum("y,yv->v", q, np.asarray(g, np.float64)) for g in run(z)]
  eye = np.eye(V)
  np.testing.assert_allclose(g_pg, -(q * reward) @ (eye - p), rtol=1e-5, atol=1e-7)
  w = np.minimum(p / q, 2.0)
  assert (p / q > 2.0).any()
  for g, u in ((g_sc, q), (g_tis, q * w)):
    want = -((reward * u) - (reward @ u) * p - (q @ reward) * (u - u.sum() * p))
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
  # Vanilla SC is PG minus the drift E_q[R] (q - p): the covariance under q.
  np.testing.assert_allclose(g_sc, g_pg + (q @ reward) * (q - p), rtol=1e-5, atol=1e-7)
