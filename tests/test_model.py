"""Model properties: KV cache == recompute, dropless MoE == naive loop, expert matmuls agree, replay, remat, sharding."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax import sharding as sh
from rl_jax.config_utils import ConfigError
from rl_jax.models import ModelConfig, Transformer, init_cache
from rl_jax.models import moe as moe_lib
import tolerances as tol
from jitted_model import jitted

# float32 tolerance for results computed with different reduction orders / layouts.
F32_ATOL = 2e-5

MOE = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, n_experts=8, n_experts_per_tok=2, moe_d_ff=16, mlp_only_layers=(1,),
                  tie_embeddings=False, router_aux_loss_coef=0.01, init_std=0.2)
DENSE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=64, init_std=0.2)
# The other families' switches (models/families): Llama 3 (no q/k norm, llama3 RoPE over a short
# original context, so scaled frequencies show at these positions) and Qwen2-MoE (q/k/v biases, a
# sigmoid-gated shared expert beside the routed ones, no top-k renormalization).
LLAMA3 = dataclasses.replace(DENSE, family="llama3", qk_norm=False, rope_scaling="llama3", rope_factor=4.0,
                             rope_original_max_positions=16, rope_theta=10_000.0)
QWEN2_MOE = dataclasses.replace(MOE, family="qwen2_moe", qk_norm=False, qkv_bias=True, shared_expert_d_ff=24,
                                norm_topk_prob=False)
FAMILY_CASES = dict(argvalues=[DENSE, MOE, LLAMA3, QWEN2_MOE], ids=["dense", "moe", "llama3", "qwen2_moe"])


def _tokens(b=4, t=7, seed=0, vocab=64):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def test_moe_layer_map_follows_qwen3_rule():
  cfg = ModelConfig(n_layers=6, n_experts=4, decoder_sparse_step=2, mlp_only_layers=(3,))
  assert cfg.moe_layers == (1, 5)
  assert cfg.moe_index == {1: 0, 5: 1}


def test_config_errors_name_the_key():
  with pytest.raises(ConfigError, match="model.n_kv_heads"):
    ModelConfig(n_heads=4, n_kv_heads=3)
  with pytest.raises(ConfigError, match="model.n_experts_per_tok"):
    ModelConfig(n_experts=4, n_experts_per_tok=5)
  with pytest.raises(ConfigError, match=r"model\.expert_matmul.*auto, slab, ragged_dot, grouped.*'gmm'"):
    ModelConfig(expert_matmul="gmm")
  with pytest.raises(ConfigError, match="model.expert_matmul.*batch_invariant"):
    ModelConfig(expert_matmul="grouped", batch_invariant=True)


def test_expert_matmul_auto_resolves_by_backend():
  resolve = moe_lib.resolve_expert_matmul
  assert [resolve("auto", b) for b in ("gpu", "tpu", "cpu")] == ["grouped", "ragged_dot", "slab"]
  # float32 compute on a GPU: the slab (the kernel's exact f32 products ran 15x slower on an H200).
  assert [resolve("auto", b, "float32") for b in ("gpu", "tpu")] == ["slab", "ragged_dot"]
  assert resolve("auto", "gpu", "float16") == "grouped"
  assert resolve("auto") == "slab"  # this CPU run: today's path, the default
  assert [resolve(c, "gpu") for c in ("slab", "ragged_dot", "grouped")] == ["slab", "ragged_dot", "grouped"]
  from rl_jax.ops import batch_invariant  # pylint: disable=g-import-not-at-top
  with batch_invariant.scope(True):
    assert resolve("auto", "gpu") == "slab"  # the zero-mismatch mode's products are the slab's
  with pytest.raises(ConfigError, match="model.expert_matmul"):
    resolve("dense", "gpu")


@pytest.mark.parametrize("cfg", **FAMILY_CASES)
def test_kv_cache_decode_equals_full_recompute(cfg):
  model = jitted(Transformer(cfg, rngs=nnx.Rngs(0)))
  tok = _tokens(2, 9)
  full = model(tok)
  cache = init_cache(cfg, 2, 12)
  out = model(tok[:, :5], cache=cache, cache_index=0)
  np.testing.assert_allclose(out.logits_BSV, full.logits_BSV[:, :5], atol=F32_ATOL)
  cache = out.cache
  for i in range(5, 9):
    out = model(tok[:, i:i + 1], cache=cache, cache_index=i)
    cache = out.cache
    np.testing.assert_allclose(out.logits_BSV[:, 0], full.logits_BSV[:, i], atol=F32_ATOL)
    np.testing.assert_array_equal(out.expert_ids_BSLK[:, 0], full.expert_ids_BSLK[:, i])


def test_left_padding_matches_unpadded():
  model = jitted(Transformer(MOE, rngs=nnx.Rngs(1)))
  tok = _tokens(1, 5)
  padded = jnp.concatenate([jnp.zeros((1, 3), tok.dtype), tok], axis=1)
  valid = jnp.array([[False] * 3 + [True] * 5])
  a = model(tok).logits_BSV
  b = model(padded, valid_BS=valid).logits_BSV[:, 3:]
  np.testing.assert_allclose(a, b, atol=F32_ATOL)


def _naive_moe(x_ND, ids_NK, gates_NK, wg, wu, wd):
  """Token by token, slot by slot, in float64 numpy."""
  x_ND, wg, wu, wd = (np.asarray(a, np.float64) for a in (x_ND, wg, wu, wd))
  out = np.zeros_like(x_ND)
  for n in range(x_ND.shape[0]):
    for slot in range(ids_NK.shape[1]):
      e = int(ids_NK[n, slot])
      g = x_ND[n] @ wg[e]
      h = g / (1.0 + np.exp(-g)) * (x_ND[n] @ wu[e])
      out[n] += gates_NK[n, slot] * (h @ wd[e])
  return out


def test_ragged_dot_experts_equal_naive_loop():
  key = jax.random.key(3)
  n, d, f, e, k = 11, 8, 6, 5, 2
  ks = jax.random.split(key, 5)
  x = jax.random.normal(ks[0], (n, d))
  wg, wu = jax.random.normal(ks[1], (e, d, f)), jax.random.normal(ks[2], (e, d, f))
  wd = jax.random.normal(ks[3], (e, f, d))
  ids, gates, _, _ = moe_lib.route(jax.random.normal(ks[4], (n, e)), k, True)
  got = jax.jit(moe_lib.dropless_experts, static_argnums=6)(x, ids, gates, wg, wu, wd, e)
  want = _naive_moe(np.asarray(x), np.asarray(ids), np.asarray(gates), wg, wu, wd)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_no_token_dropped_under_maximally_skewed_router():
  # Every token prefers expert 0 (then 1): a capacity-limited MoE would drop most.
  n, d, f, e, k = 64, 8, 4, 8, 2
  x = jax.random.normal(jax.random.key(0), (n, d))
  logits = jnp.tile(jnp.array([10.0, 5.0] + [0.0] * (e - 2)), (n, 1))
  ids, gates, _, _ = moe_lib.route(logits, k, True)
  assert set(np.unique(np.asarray(ids))) == {0, 1}
  ks = jax.random.split(jax.random.key(1), 3)
  wg, wu = jax.random.normal(ks[0], (e, d, f)), jax.random.normal(ks[1], (e, d, f))
  wd = jax.random.normal(ks[2], (e, f, d))
  got = np.asarray(jax.jit(moe_lib.dropless_experts, static_argnums=6)(x, ids, gates, wg, wu, wd, e))
  want = _naive_moe(np.asarray(x), np.asarray(ids), np.asarray(gates), wg, wu, wd)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  assert np.all(np.abs(got).sum(-1) > 0), "a token got no expert output"


# Expert matmuls of the MoE block (model.expert_matmul): slab (CPU's auto), the Pallas grouped
# matmul (interpret mode here) and ragged_dot, on E=8 experts of D=16, F=12, top-2 over 40 tokens.
_XE, _XD, _XF, _XN = 8, 16, 12, 40


def _expert_case(routing):
  ks = jax.random.split(jax.random.key(7), 4)
  ws = (0.3 * jax.random.normal(ks[0], (_XE, _XD, _XF)), 0.3 * jax.random.normal(ks[1], (_XE, _XD, _XF)),
        0.3 * jax.random.normal(ks[2], (_XE, _XF, _XD)))
  x = jax.random.normal(ks[3], (_XN, _XD))
  rng = np.random.default_rng(0)
  if routing == "random":  # experts 0-6 only: expert 7 gets no row
    ids = np.stack([rng.permutation(_XE - 1)[:2] for _ in range(_XN)])
  else:  # every token on experts 3 and 5: 40 rows each, past the last slab tier (rounds)
    ids = np.tile([3, 5], (_XN, 1))
  g = rng.uniform(0.1, 1.0, (_XN, 2))
  return x, jnp.asarray(ids, jnp.int32), jnp.asarray(g / g.sum(-1, keepdims=True), jnp.float32), ws


@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_expert_matmuls_agree_values_and_grads(routing):
  """y and the gradients w.r.t. x, the gates and every expert weight under expert_matmul grouped,
  slab and ragged_dot: pairwise within float32 rounding of the same sums (tests/tolerances.py)."""
  x, ids, gates, ws = _expert_case(routing)
  loads = np.bincount(np.asarray(ids).ravel(), minlength=_XE)
  tiers = moe_lib.capacity_tiers(_XN * 2, _XE)
  assert loads.min() == 0  # an expert with no row
  assert (loads.max() > tiers[-1]) == (routing == "skewed"), (loads, tiers)  # slab rounds when skewed
  head = jnp.arange(_XN * _XD).reshape(_XN, _XD) / (_XN * _XD)

  def run(matmul):
    def loss(x, g, *w):
      y = moe_lib.dropless_experts(x, ids, g, *w, _XE, matmul=matmul)
      return jnp.sum(jnp.sin(y) * head), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, gates, *ws)

  out = {m: run(m) for m in ("slab", "grouped", "ragged_dot")}
  bounds = tol.swiglu_experts_bounds(x, ids, gates, *ws, head, head="sin")
  names = ("x", "gates", "w_gate", "w_up", "w_down")
  for a, b in (("grouped", "slab"), ("grouped", "ragged_dot"), ("slab", "ragged_dot")):
    (_, ya), ga = out[a]
    (_, yb), gb = out[b]
    tol.assert_rounding_close(ya, yb, bounds["y"], f"{a} vs {b}: y")
    for name, u, v in zip(names, ga, gb):
      tol.assert_rounding_close(u, v, bounds[name], f"{a} vs {b}: d loss / d {name}")
  # The empty expert's weights get exactly zero gradient on every path.
  for m in out:
    for gw in out[m][1][2:]:
      np.testing.assert_array_equal(np.asarray(gw)[loads == 0], 0.0)


def test_grouped_expert_matmul_is_the_pallas_kernel_without_dense_rows():
  """The wired path really runs grouped_matmul's Pallas kernels (forward, dx, dw) and never holds
  a [rows, E * F] value, forward or backward; the slab holds no Pallas call."""
  x, ids, gates, ws = _expert_case("random")
  def grad_text(matmul):
    loss = lambda x, *w: jnp.sum(moe_lib.dropless_experts(x, ids, gates, *w, _XE, matmul=matmul))
    return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, *ws))
  text = grad_text("grouped")
  # Three grouped products forward, then dx and dw of each backward.
  assert text.count("name=grouped_matmul_dw") == 3, text
  assert len(re.findall(r"name=grouped_matmul\b", text)) == 6, text
  rows = _XN * 2
  for bad in (f"[{rows},{_XE * _XF}]", f"[{rows},{_XE},{_XF}]", f"[{rows},{_XE * _XD}]"):
    assert bad not in text, bad
  assert "pallas_call" not in grad_text("slab")


@pytest.mark.parametrize("cfg", [MOE, QWEN2_MOE, dataclasses.replace(MOE, expert_matmul="grouped")],
                         ids=["moe", "qwen2_moe", "moe-grouped"])
def test_replay_with_natural_ids_reproduces_forward_exactly(cfg):
  """Replaying a forward's own ids reproduces it; the record holds the routed experts only (one
  entry per MoE layer, top-k wide: a shared expert never enters it)."""
  model = jitted(Transformer(cfg, rngs=nnx.Rngs(2)))
  tok = _tokens()
  nat = model(tok)
  assert nat.expert_ids_BSLK.shape == (*tok.shape, cfg.n_moe_layers, cfg.n_experts_per_tok)
  rep = model(tok, replay_ids_BSLK=nat.expert_ids_BSLK)
  np.testing.assert_array_equal(rep.logits_BSV, nat.logits_BSV)
  np.testing.assert_array_equal(rep.expert_ids_BSLK, nat.expert_ids_BSLK)


def test_replay_other_ids_changes_output_and_router_gets_gradient():
  module = Transformer(MOE, rngs=nnx.Rngs(2))
  model = jitted(module)
  tok = _tokens()
  nat = model(tok)
  other = (nat.expert_ids_BSLK + 3) % MOE.n_experts  # distinct slots, all differ from natural
  mask = jnp.ones(tok.shape, bool).at[:, -1].set(False)  # last position falls back to top-k
  rep = model(tok, replay_ids_BSLK=other, replay_mask_BS=mask, return_router_logits=True)
  assert np.abs(np.asarray(rep.logits_BSV - nat.logits_BSV)).max() > 1e-3
  np.testing.assert_array_equal(rep.expert_ids_BSLK[:, :-1], other[:, :-1])
  # Unmasked position: the trainer's own top-k of its (replay-perturbed) router scores.
  _, own_top = jax.lax.top_k(rep.router_logits_BSLE[:, -1], MOE.n_experts_per_tok)
  np.testing.assert_array_equal(rep.expert_ids_BSLK[:, -1], own_top)

  graphdef, state = nnx.split(module)
  def loss(state):
    return jnp.mean(nnx.merge(graphdef, state)(tok, replay_ids_BSLK=other, replay_mask_BS=mask)
                    .logits_BSV ** 2)
  g = jax.jit(jax.grad(loss))(state)
  for layer in MOE.moe_layers:
    assert np.abs(np.asarray(g["layers"][layer]["ffn"]["w_router"][...])).max() > 0


def _loss_fn(graphdef, tok):
  def loss(state):
    out = nnx.merge(graphdef, state)(tok)
    logp = jax.nn.log_softmax(out.logits_BSV[:, :-1])
    nll = -jnp.take_along_axis(logp, tok[:, 1:, None], -1).mean()
    return nll + 0.01 * out.aux_loss
  return loss


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_remat_gives_identical_loss_and_grads(cfg):
  import dataclasses
  tok = _tokens()
  a_graph, a_state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  b_graph, b_state = nnx.split(Transformer(dataclasses.replace(cfg, remat=True), rngs=nnx.Rngs(0)))
  la, ga = jax.jit(jax.value_and_grad(_loss_fn(a_graph, tok)))(a_state)
  lb, gb = jax.jit(jax.value_and_grad(_loss_fn(b_graph, tok)))(b_state)
  assert float(la) == float(lb)  # the forward is bit-identical
  # The backward recomputes activations inside a separately fused XLA program, so
  # gradients may differ by float32 reassociation only (a few ulp).
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), ga, gb)


@pytest.mark.parametrize("cfg,mesh_cfg", [
    (DENSE, sh.MeshConfig(data=2, fsdp=2, expert=1, tensor=2)),
    (MOE, sh.MeshConfig(data=1, fsdp=2, expert=2, tensor=2)),
    (QWEN2_MOE, sh.MeshConfig(data=1, fsdp=2, expert=2, tensor=2)),
], ids=["dense", "moe", "qwen2_moe"])
def test_sharded_equals_single_device(cfg, mesh_cfg):
  assert jax.device_count() == 8, "tests/conftest.py forces 8 host devices"
  mesh = sh.make_mesh(mesh_cfg)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tok = _tokens(8, 6)
  loss = _loss_fn(graphdef, tok)
  l1, g1 = jax.jit(jax.value_and_grad(loss))(state)
  sstate = sh.shard_state(state, mesh)
  shardings = sh.state_shardings(state, mesh)
  # Shardings really split the weights (not all replicated).
  specs = [s.spec for s in jax.tree.leaves(shardings)]
  assert any(any(a is not None for a in spec) for spec in specs)
  stok = jax.device_put(tok, sh.batch_sharding(mesh))
  def sloss(state, tok):
    return jax.value_and_grad(_loss_fn(graphdef, tok))(state)
  l8, g8 = jax.jit(sloss, in_shardings=(shardings, sh.batch_sharding(mesh)),
                   out_shardings=(sh.replicated(mesh), shardings))(sstate, stok)
  np.testing.assert_allclose(l8, l1, rtol=1e-6)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=F32_ATOL), g8, g1)
  logits1 = jax.jit(lambda s: nnx.merge(graphdef, s)(tok).logits_BSV)(state)
  logits8 = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits_BSV)(sstate, stok)
  np.testing.assert_allclose(logits8, logits1, atol=F32_ATOL)
