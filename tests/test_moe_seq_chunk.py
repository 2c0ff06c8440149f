"""model.moe_seq_chunk: the MoE dispatch over sequence chunks equals the whole sequence's (values and
gradients, within float32 rounding of the same sums) and holds one chunk's buffers."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tolerances as tol
from rl_jax.config_utils import ConfigError
from rl_jax.models import moe as moe_lib
from rl_jax.models.config import ModelConfig

_E, _D, _F, _K = 8, 16, 12, 2


def _case(b, s, seed=0, f=_F):
  ks = jax.random.split(jax.random.key(seed), 5)
  ws = tuple(0.3 * jax.random.normal(k, shape) for k, shape in
             zip(ks[:3], ((_E, _D, f), (_E, _D, f), (_E, f, _D))))
  x = jax.random.normal(ks[3], (b, s, _D))
  ids, gates, _, _ = moe_lib.route(jax.random.normal(ks[4], (b * s, _E)), _K, True)
  return x, ids.reshape(b, s, _K), gates.reshape(b, s, _K), ws


def _experts(ws):
  def run(x_BSD, ids_BSK, gates_BSK):
    b, s, d = x_BSD.shape
    y = moe_lib.dropless_experts(x_BSD.reshape(b * s, d), ids_BSK.reshape(b * s, -1),
                                 gates_BSK.reshape(b * s, -1), *ws, _E)
    return y.reshape(b, s, d), jnp.zeros((), jnp.float32)
  return run


@pytest.mark.parametrize("chunk", [4, 5])  # divides S; pads the tail
def test_chunked_equals_whole_values_and_grads(chunk):
  b, s = 2, 12
  x, ids, gates, ws = _case(b, s)
  head = jnp.arange(b * s * _D).reshape(b, s, _D) / (b * s * _D)

  def run(chunked):
    def loss(x, g, *w):
      f = _experts(w)
      y, _ = moe_lib.seq_chunked(f, x, ids, g, chunk, _E) if chunked else f(x, ids, g)
      return jnp.sum(jnp.sin(y) * head), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, gates, *ws)

  (_, y1), g1 = run(True)
  (_, y0), g0 = run(False)
  flat = lambda a: a.reshape(b * s, -1)
  bounds = tol.swiglu_experts_bounds(flat(x), flat(ids), flat(gates), *ws, flat(head), head="sin")
  tol.assert_rounding_close(flat(y1), flat(y0), bounds["y"], f"chunk {chunk}: y")
  for name, u, v in zip(("x", "gates"), g1[:2], g0[:2]):
    tol.assert_rounding_close(flat(u), flat(v), bounds[name], f"chunk {chunk}: d loss / d {name}")
  for name, u, v in zip(("w_gate", "w_up", "w_down"), g1[2:], g0[2:]):
    tol.assert_rounding_close(u, v, bounds[name], f"chunk {chunk}: d loss / d {name}")


def test_the_block_routes_the_same_and_only_the_dispatch_is_chunked():
  """The MoE block under moe_seq_chunk: the same expert ids bit for bit (routing runs on the whole
  sequence), the same output within the experts' rounding, the same aux loss."""
  cfg = ModelConfig(d_model=_D, n_experts=_E, n_experts_per_tok=_K, moe_d_ff=_F, router_aux_loss_coef=1e-2)
  block = moe_lib.MoE(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 11, _D))
  valid = jnp.ones((2, 11), bool)
  y0, ids0, logits0, aux0, _ = block(x, valid)
  block.cfg = dataclasses.replace(cfg, moe_seq_chunk=3)
  y1, ids1, logits1, aux1, _ = block(x, valid)
  np.testing.assert_array_equal(np.asarray(ids1), np.asarray(ids0))
  np.testing.assert_array_equal(np.asarray(logits1), np.asarray(logits0))
  np.testing.assert_array_equal(np.asarray(aux1), np.asarray(aux0))
  probs = jax.nn.softmax(np.asarray(logits0, np.float64).reshape(-1, _E), -1)
  top = np.take_along_axis(probs, np.asarray(ids0).reshape(-1, _K), -1)
  gates = top / top.sum(-1, keepdims=True)
  ws = (block.w_gate.get_value(), block.w_up.get_value(), block.w_down.get_value())
  bounds = tol.swiglu_experts_bounds(np.asarray(x).reshape(-1, _D), np.asarray(ids0).reshape(-1, _K),
                                     gates, *ws, np.zeros((22, _D)))
  tol.assert_rounding_close(np.asarray(y1).reshape(-1, _D), np.asarray(y0).reshape(-1, _D), bounds["y"],
                            "block y", paths=4)  # both programs' gates also round (softmax, division)


def test_chunked_backward_holds_one_chunks_buffers():
  """The compiled forward + backward's temporaries (XLA memory stats, not timing): chunks of 32
  positions hold the same buffers at S = 256 and 512, where the whole sequence's double. The
  experts' hidden width (256) dominates d_model as in real MoEs (the [rows, F] activations are the
  dispatch's buffers; the [B, S, D] input, output and gradients are the sequence's either way)."""
  b, f = 1, 256

  def temp_bytes(s, chunk):
    x, ids, gates, ws = _case(b, s, f=f)

    def loss(x, g, *w):
      fn = _experts(w)
      y, _ = moe_lib.seq_chunked(fn, x, ids, g, chunk, _E) if chunk else fn(x, ids, g)
      return jnp.sum(y * y)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    return grad.lower(x, gates, *ws).compile().memory_analysis().temp_size_in_bytes

  whole = {s: temp_bytes(s, 0) for s in (256, 512)}
  chunked = {s: temp_bytes(s, 32) for s in (256, 512)}
  assert whole[512] > 1.8 * whole[256], whole
  assert chunked[512] < 1.25 * chunked[256], chunked
  assert chunked[512] < whole[512] / 2, (chunked, whole)


def test_negative_chunk_is_a_config_error():
  with pytest.raises(ConfigError, match="model.moe_seq_chunk"):
    ModelConfig(moe_seq_chunk=-1)
