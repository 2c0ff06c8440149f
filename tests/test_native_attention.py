"""The native attention handlers (rl_jax/ops/native_attention.py: decode; native_causal_attention.py: training) equal the references they replace on CPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.models import layers
from rl_jax.ops import native_attention


def _reference(monkeypatch, *args):
  """`layers._decode_attention` through XLA's dots (the handler switched off while it traces)."""
  with monkeypatch.context() as m:
    m.setattr(native_attention, "usable_for", lambda *a: False)
    return jax.jit(lambda *a: layers._decode_attention(*a))(*args)  # pylint: disable=protected-access


def _operands(b, g, r, d, c, seed=0, p_valid=0.7):
  ks = jax.random.split(jax.random.key(seed), 4)
  q_BGRD = 2 * jax.random.normal(ks[0], (b, g, r, d))
  kT_BGDC = jax.random.normal(ks[1], (b, g, d, c))
  v_BGCD = jax.random.normal(ks[2], (b, g, c, d))
  mask_BC = jax.random.uniform(ks[3], (b, c)) < p_valid
  return q_BGRD, kT_BGDC, v_BGCD, mask_BC.at[0].set(False)  # row 0 masked whole: uniform weights


@pytest.mark.parametrize("b,g,r,d,c", [(3, 2, 3, 8, 7), (4, 2, 2, 32, 96), (2, 1, 1, 128, 33)])
def test_native_decode_attention_equals_the_reference(monkeypatch, b, g, r, d, c):
  """Odd sizes (no vector multiple), a grouped query (R > 1), a fully masked row; float32 rounding
  apart (the sums run in another order, exp is a polynomial), the same output."""
  assert native_attention.available(), "the native decode attention did not build (see the warning above)"
  args = _operands(b, g, r, d, c)
  got = jax.jit(layers._decode_attention)(*args)  # pylint: disable=protected-access
  want = _reference(monkeypatch, *args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
  # Large logits: the softmax's shift by the row maximum, not exp overflow.
  big = (30 * args[0],) + args[1:]
  np.testing.assert_allclose(np.asarray(jax.jit(layers._decode_attention)(*big)),  # pylint: disable=protected-access
                             np.asarray(_reference(monkeypatch, *big)), rtol=2e-5, atol=2e-5)


def test_native_decode_attention_under_vmap_and_in_the_program(monkeypatch):
  """A vmapped call folds the mapped axis into the rows (each slice equals its own call); the
  decode program holds the handler's custom call on CPU and XLA's dots without it."""
  args = _operands(3, 2, 2, 16, 20, seed=1)
  one = jax.jit(layers._decode_attention)(*args)  # pylint: disable=protected-access
  two = jax.jit(jax.vmap(layers._decode_attention))(*(jnp.stack([x, x]) for x in args))  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(two[1]), np.asarray(one))
  # A new function object per lowering: jax reuses a function's trace across jit objects.
  lowered = lambda: jax.jit(lambda *a: layers._decode_attention(*a)).lower(*args).as_text()  # pylint: disable=protected-access
  assert native_attention.TARGET in lowered()
  monkeypatch.setattr(native_attention, "usable_for", lambda *a: False)
  assert native_attention.TARGET not in lowered()


def test_native_decode_attention_names_a_bad_shape():
  q, kT, v, mask = _operands(2, 2, 1, 8, 5)
  with pytest.raises(ValueError, match=r"v_BGCD has shape \(2, 2, 8, 5\), want \(2, 2, 5, 8\)"):
    native_attention.decode_attention(q, kT, jnp.swapaxes(v, -1, -2), mask, 0.5)


def test_programs_for_several_devices_keep_xla_s_dots():
  """`per_mesh`: traced for a mesh of several devices the attention stays XLA's (which partitions
  along the batch; the custom call would gather each layer's cache); for one device, or none,
  the handler serves."""
  args = _operands(8, 2, 2, 8, 12, seed=2)

  @native_attention.per_mesh
  def program(*a, mesh):
    del mesh
    return layers._decode_attention(*a)  # pylint: disable=protected-access

  def lowered(mesh):  # a new function object per lowering (jax reuses a function's trace)
    return jax.jit(lambda *a: program(*a, mesh=mesh)).lower(*args).as_text()
  devices = np.array(jax.devices())
  assert devices.size > 1, "tests/conftest.py forces 8 host devices"
  assert native_attention.TARGET not in lowered(jax.sharding.Mesh(devices, ("data",)))
  assert native_attention.TARGET in lowered(jax.sharding.Mesh(devices[:1], ("data",)))
  assert native_attention.TARGET in lowered(None)


def test_the_update_and_p_old_programs_hold_the_native_training_attention(monkeypatch):
  """On CPU at float32 the trainer's programs (`step.update`: forward and backward; `step.old_forward`)
  attend through the native handlers by default (model.attention='auto'), and through XLA's dots with
  model.attention='xla' or without the handlers. Lowered only (no compile)."""
  from rl_jax.models.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from rl_jax.optim import OptimConfig, make_optimizer  # pylint: disable=g-import-not-at-top
  from rl_jax.ops import native_causal_attention as nca  # pylint: disable=g-import-not-at-top
  from rl_jax.rl import step as step_lib  # pylint: disable=g-import-not-at-top
  from rl_jax.rl.loss.loss_config import LossConfig  # pylint: disable=g-import-not-at-top
  from rl_jax.train_state import init_params  # pylint: disable=g-import-not-at-top
  b, p, t = 4, 5, 6
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 32, (b, p + t)), jnp.int32)
  batch = step_lib.TrainBatch(
      prompt_len=p, tokens_BS=tokens, positions_BS=jnp.broadcast_to(jnp.arange(p + t, dtype=jnp.int32), (b, p + t)),
      valid_BS=jnp.ones((b, p + t), bool), response_BT=tokens[:, p:], response_mask_BT=jnp.ones((b, t), bool),
      logq_BT=jnp.full((b, t), -3.0), adv_B=jnp.ones((b,)), logp_old_BT=jnp.full((b, t), -3.0))
  optimizer = make_optimizer(OptimConfig(name="adamw", lr=1e-3))
  loss = LossConfig(method="pg", score_centering="none")

  def lowered(attention: str) -> tuple[str, str]:
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                      dtype="float32", param_dtype="float32", attention=attention)
    graphdef, params = init_params(cfg, 0)
    upd = jax.jit(lambda pr, o, bt: step_lib.update(pr, o, bt, graphdef=graphdef, optimizer=optimizer,
                                                    loss_cfg=loss, aux_coef=0.0))
    old = jax.jit(lambda pr, bt: step_lib.old_forward(pr, bt, graphdef=graphdef, loss_cfg=loss)[0])
    return (upd.lower(params, optimizer.init(params), batch).as_text(), old.lower(params, batch).as_text())

  update, p_old = lowered("auto")
  assert nca.FWD_TARGET in update and nca.BWD_TARGET in update
  assert nca.FWD_TARGET in p_old and nca.BWD_TARGET not in p_old
  assert not any(nca.FWD_TARGET in x for x in lowered("xla"))
  monkeypatch.setattr(nca, "usable_for", lambda *a: False)
  assert not any(nca.FWD_TARGET in x for x in lowered("auto"))


def test_native_training_attention_names_a_bad_shape():
  from rl_jax.ops import native_causal_attention as nca  # pylint: disable=g-import-not-at-top
  q, k = jnp.zeros((2, 5, 2, 2, 8)), jnp.zeros((2, 5, 2, 8))
  with pytest.raises(ValueError, match=r"k \(2, 5, 8, 2\) and v \(2, 5, 2, 8\) must be \(2, 5, 2, 8\)"):
    nca.attention(q, jnp.swapaxes(k, -1, -2), k)
  with pytest.raises(ValueError, match=r"valid_BS must be bool \(2, 5\), got int32 \(2, 5\)"):
    nca.attention(q, k, k, jnp.ones((2, 5), jnp.int32))
