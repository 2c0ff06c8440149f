"""Float32 comparison tolerances derived from the magnitudes of what is summed, not from the result.

Two programs computing the same math in different orders (sorted rows vs capacity slabs, sums
split over devices) differ by rounding alone. A relative tolerance on the result fails where a
sum cancels (a loss of 1e-2 made of terms of 1e+2 carries the terms' rounding, not its own), an
absolute one is arbitrary. The bounds here follow the standard first-order error analysis
(Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., ch. 3-4): with unit roundoff
u = 2^-24 (float32, round to nearest),

  sum of n terms t_i, any order or tree:  |fl - exact| <= (n - 1) u sum_i |t_i| + sum_i err(t_i)
  product a b:                            err <= |a| err(b) + |b| err(a) + u |a b|
  smooth f(a) (silu, sin):                err <= |f'(a)| err(a) + c_f u |f(a)|

to first order in u, each program's error from the exact result is below u E, E the bound
propagated through the computation in float64 (`Bounded`); two programs then differ by at most
2 u E. A failure past that is a bug, not rounding.

The worst case (n - 1) u of a long sum needs every rounding error to have the same sign. With
independent, mean-zero rounding errors (Higham & Mary, "A new approach to probabilistic rounding
error analysis", SIAM J. Sci. Comput. 41(5), 2019, thm. 3.1) the factor is lambda sqrt(n) u,
exceeded with probability at most 2 n exp(-lambda^2 / 2) (with lambda = 7: 5e-8 for n = 2048);
each sum here uses min(n, lambda sqrt(n)).
"""
from __future__ import annotations

import dataclasses

import numpy as np

F32_U = 2.0 ** -24  # unit roundoff of float32 (half its machine epsilon 2^-23)
F64_U = 2.0 ** -53  # and of float64
# Rounding of one library evaluation of exp / sin / division, in units of u: XLA's float32
# polynomial approximations are accurate to a few ulp (1 ulp = 2 u).
_FN_ULPS = 4.0
LAMBDA = 7.0  # probabilistic bound's confidence parameter (module docstring)


def growth(n: int) -> float:
  """Error growth of a sum of n terms in units of u sum|t|: the smaller of the worst case and
  the probabilistic bound."""
  return float(min(n, LAMBDA * np.sqrt(n)))


@dataclasses.dataclass
class Bounded:
  """A float64 value and its first-order float32 error bound in units of u (err >= 0)."""
  v: np.ndarray
  err: np.ndarray

  @staticmethod
  def exact(a) -> "Bounded":
    a = np.asarray(a, np.float64)
    return Bounded(a, np.zeros_like(a))


def matmul(a: Bounded, b: Bounded) -> Bounded:
  """a @ b (batched over leading axes as np.matmul): a sum of n = a.shape[-1] products."""
  n = a.v.shape[-1]
  mag = np.abs(a.v) @ np.abs(b.v)  # sum of the products' magnitudes
  # Each product rounds once (u |t|) and the n - 1 additions add (n - 1) u sum|t|: n u sum|t|
  # at worst (`growth`).
  return Bounded(a.v @ b.v, np.abs(a.v) @ b.err + a.err @ np.abs(b.v) + growth(n) * mag)


def mul(a: Bounded, b: Bounded) -> Bounded:
  v = a.v * b.v
  return Bounded(v, np.abs(a.v) * b.err + a.err * np.abs(b.v) + np.abs(v))


def fn(a: Bounded, f, df) -> Bounded:
  v = f(a.v)
  return Bounded(v, np.abs(df(a.v)) * a.err + _FN_ULPS * 2 * np.abs(v))


def total(a: Bounded, axis) -> Bounded:
  """Sum over `axis` (terms already rounded: only the additions' growth(n - 1) u sum|t| is new)."""
  n = int(np.prod([a.v.shape[i] for i in np.atleast_1d(axis)]))
  return Bounded(a.v.sum(axis), a.err.sum(axis) + growth(n - 1) * np.abs(a.v).sum(axis))


def _sigmoid(a):
  return 1 / (1 + np.exp(-a))


def _silu(a):
  return a * _sigmoid(a)


def _dsilu(a):
  s = _sigmoid(a)
  return s * (1 + a * (1 - s))


def _d2silu(a):
  s = _sigmoid(a)
  return s * (1 - s) * (2 + a * (1 - 2 * s))


def swiglu_experts_bounds(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, c_ND, head: str = "linear"):
  """Bounds (Bounded) of the MoE experts' y_ND, the loss sum(phi(y) c) and its gradients.

  The math of `moe.ragged_experts` per (token, slot) row r of expert e_r: a = x W_gate[e],
  b = x W_up[e], h = silu(a) b, o = h W_down[e], y = sum_k g o; loss = sum phi(y) c with phi
  the identity ("linear") or sin ("sin"); and its reverse-mode gradient written out as the
  programs compute it (each sum one node; a program that splits a sum over devices or merges
  the k slots into one scatter-add reorders within these sums). Returns a dict of Bounded:
  y, loss, and the gradients x, gates, w_gate, w_up, w_down.
  """
  x, g = np.asarray(x_ND, np.float64), np.asarray(gates_NK, np.float64)
  ids = np.asarray(ids_NK)
  wg, wu, wd = (np.asarray(w, np.float64) for w in (w_gate, w_up, w_down))
  c = np.asarray(c_ND, np.float64)
  n, k = ids.shape
  e_r = ids.reshape(-1)
  X = Bounded.exact(x[np.repeat(np.arange(n), k)][:, None, :])  # [R, 1, D] rows
  G = Bounded.exact(g.reshape(-1)[:, None, None])  # [R, 1, 1]
  Wg, Wu, Wd = Bounded.exact(wg[e_r]), Bounded.exact(wu[e_r]), Bounded.exact(wd[e_r])
  a = matmul(X, Wg)  # [R, 1, F]
  b = matmul(X, Wu)
  s = fn(a, _silu, _dsilu)
  h = mul(s, b)
  o = matmul(h, Wd)  # [R, 1, D]
  go = mul(G, o)
  y = total(Bounded(go.v.reshape(n, k, -1), go.err.reshape(n, k, -1)), 1)  # [N, D]
  C = Bounded.exact(c)
  if head == "linear":
    phi, dy = y, C
  elif head == "sin":
    phi = fn(y, np.sin, np.cos)
    dy = mul(fn(y, np.cos, lambda t: -np.sin(t)), C)
  else:
    raise ValueError(head)
  loss = total(mul(phi, C), (0, 1))
  # Backward, per row r = (t, k).
  dy_r = Bounded(np.repeat(dy.v, k, 0)[:, None, :], np.repeat(dy.err, k, 0)[:, None, :])
  do = mul(G, dy_r)  # [R, 1, D]
  d_gates = matmul(o, Bounded(np.swapaxes(dy_r.v, 1, 2), np.swapaxes(dy_r.err, 1, 2)))  # [R, 1, 1]
  t = lambda B: Bounded(np.swapaxes(B.v, -1, -2), np.swapaxes(B.err, -1, -2))
  dh = matmul(do, t(Wd))  # [R, 1, F]
  ds, db = mul(dh, b), mul(dh, s)
  da = mul(ds, fn(a, _dsilu, _d2silu))
  dX = matmul(da, t(Wg))
  dXu = matmul(db, t(Wu))
  dX = Bounded(dX.v + dXu.v, dX.err + dXu.err + np.abs(dX.v) + np.abs(dXu.v))  # one more addition
  dx = total(Bounded(dX.v.reshape(n, k, -1), dX.err.reshape(n, k, -1)), 1)

  def per_expert(lhs: Bounded, rhs: Bounded, shape):
    """sum over expert e's rows of lhs_r^T rhs_r: one sum of (rows of e) products per entry."""
    out_v, out_e = np.zeros(shape), np.zeros(shape)
    for e in range(shape[0]):
      rows = np.flatnonzero(e_r == e)
      if rows.size:
        L = Bounded(lhs.v[rows, 0].T, lhs.err[rows, 0].T)  # [A, rows]
        Rt = Bounded(rhs.v[rows, 0], rhs.err[rows, 0])  # [rows, B]
        m = matmul(L, Rt)
        out_v[e], out_e[e] = m.v, m.err
    return Bounded(out_v, out_e)

  return {
      "y": y, "loss": loss, "x": dx,
      "gates": Bounded(d_gates.v.reshape(n, k), d_gates.err.reshape(n, k)),
      "w_gate": per_expert(X, da, wg.shape), "w_up": per_expert(X, db, wu.shape),
      "w_down": per_expert(h, do, wd.shape),
  }


def assert_rounding_close(got, want, bound: Bounded, what: str = "", paths: int = 2, u: float = F32_U):
  """|got - want| <= paths u err elementwise (two programs each within u err of exact; `u` the
  unit roundoff of their dtype)."""
  got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
  atol = paths * u * bound.err
  excess = np.abs(got64 - want64) - atol
  if np.any(excess > 0):
    i = np.unravel_index(np.argmax(excess), excess.shape) if excess.ndim else ()
    raise AssertionError(
        f"{what}: |got - want| = {abs(got64[i] - want64[i]):.3g} at {i} exceeds the float32 rounding "
        f"bound {atol[i]:.3g} (got {got64[i]!r}, want {want64[i]!r})")


def sum_atol(terms, paths: int = 2) -> float:
  """Tolerance of a float32 sum of (exactly known) `terms` added in another order: each order is
  within growth(n - 1) u sum|t| of the exact sum."""
  t = np.abs(np.asarray(terms, np.float64))
  return paths * F32_U * growth(max(t.size - 1, 1)) * float(t.sum())


def array_scale_atol(b, n_terms: int, paths: int = 2) -> float:
  """Tolerance for an array whose entries are sums of at most `n_terms` terms, each no larger
  than the array's largest entry: paths x growth(n_terms) u max|b|. An assumption (no
  cancellation past the array's own scale), for where the terms are not tracked."""
  return paths * F32_U * growth(n_terms) * max(float(np.abs(np.asarray(b)).max()), np.finfo(np.float32).tiny)

