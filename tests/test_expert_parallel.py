"""shard_map expert-parallel MoE dispatch == GSPMD path (loss, grads; skewed, replay, quantized); byte model."""
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax import sharding as sh
from rl_jax.config_utils import ConfigError
from rl_jax.models import ModelConfig, Transformer
from rl_jax.models import expert_parallel as ep_lib
from rl_jax.models import moe as moe_lib
from rl_jax.quant import ops
from rl_jax.quant.config import WeightSpec

F32_ATOL = 2e-5  # same-math float32 results summed in a different order / over devices

# Tiny programs: compiling dominates, so XLA's backend optimizations are skipped (IEEE either way).
pytestmark = pytest.mark.usefixtures("fast_compile")

# Two MoE layers (so replay ids are per layer) and no dense layer: the cheapest model that
# exercises the dispatch in every place the trainer uses it.
MOE = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                  d_ff=32, n_experts=8, n_experts_per_tok=2, moe_d_ff=8,
                  tie_embeddings=False, router_aux_loss_coef=0.01, init_std=0.2)
EP = dataclasses.replace(MOE, moe_dispatch="shard_map")
# expert=2 with tensor=2 exercises the F split; expert=4 the wider gather / scatter.
MESHES = {"e2t2": sh.MeshConfig(data=1, fsdp=2, expert=2, tensor=2),
          "e4": sh.MeshConfig(data=2, fsdp=1, expert=4, tensor=1)}


def _experts(seed, n_experts=8, d=8, f=4):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (n_experts, d, f)), jax.random.normal(ks[1], (n_experts, d, f)),
          jax.random.normal(ks[2], (n_experts, f, d)))


def _routes(logits_NE, k=2):
  ids, gates, _, _ = moe_lib.route(logits_NE, k, True)
  return ids, gates


@pytest.mark.parametrize("skewed", [False, True], ids=["normal", "skewed"])
def test_dispatch_equals_dropless_values_and_grads(skewed):
  mesh = sh.make_mesh(MESHES["e4"])
  n, d, e = 32, 8, 8
  x = jax.random.normal(jax.random.key(0), (n, d))
  if skewed:  # every token picks experts 0 and 1: all on one device of four
    logits = jnp.tile(jnp.array([10.0, 5.0] + [0.0] * (e - 2)), (n, 1))
  else:
    logits = jax.random.normal(jax.random.key(1), (n, e))
  ids, gates = _routes(logits)
  if skewed:
    assert set(np.unique(np.asarray(ids))) == {0, 1}
  ws = _experts(2)

  # A fixed random projection: linear in the outputs, so the float32 rounding of the two
  # summation orders stays ~1e-7 relative. (sin(y) with |y| up to ~85 in the skewed case turned
  # y's last-bit differences into 1e-3 gradient differences: an ill-conditioned comparison.)
  proj = jax.random.normal(jax.random.key(9), (n, d))

  def loss(fn):
    return lambda x, g, *w: jnp.sum(fn(x, ids, g, *w, e) * proj)
  want, gw = jax.value_and_grad(loss(moe_lib.dropless_experts), argnums=(0, 1, 2, 3, 4))(x, gates, *ws)
  with jax.set_mesh(mesh):
    got, gg = jax.jit(jax.value_and_grad(loss(ep_lib.shard_map_experts), argnums=(0, 1, 2, 3, 4)))(
        x, gates, *ws)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(gg, gw):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
  y = np.asarray(jax.jit(ep_lib.shard_map_experts, static_argnums=6, static_argnames="mesh")(
      x, ids, gates, *ws, e, mesh=mesh))
  assert np.all(np.abs(y).sum(-1) > 0), "a token got no expert output"


def test_dispatch_with_tokens_not_divisible_by_batch_axes():
  mesh = sh.make_mesh(MESHES["e4"])
  x = jax.random.normal(jax.random.key(0), (7, 8))  # 7 tokens over 8 batch shards: replicated
  ids, gates = _routes(jax.random.normal(jax.random.key(1), (7, 8)))
  ws = _experts(3)
  want = moe_lib.dropless_experts(x, ids, gates, *ws, 8)
  with jax.set_mesh(mesh):
    got = jax.jit(ep_lib.shard_map_experts, static_argnums=6)(x, ids, gates, *ws, 8)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_quantized_experts_equal_dropless():
  mesh = sh.make_mesh(MESHES["e4"])
  x = jax.random.normal(jax.random.key(0), (16, 8))
  ids, gates = _routes(jax.random.normal(jax.random.key(1), (16, 8)))
  qs = [ops.quantize_weight(w, WeightSpec("int8"), backend="xla") for w in _experts(4)]
  want = moe_lib.dropless_experts(x, ids, gates, *qs, 8)
  with jax.set_mesh(mesh):
    got = jax.jit(ep_lib.shard_map_experts, static_argnums=6)(x, ids, gates, *qs, 8)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _tokens(b=8, t=6, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, MOE.vocab_size)


def _loss(graphdef, tok, replay_BSLK=None, mask_BS=None):
  def loss(state):
    out = nnx.merge(graphdef, state)(tok, replay_ids_BSLK=replay_BSLK, replay_mask_BS=mask_BS)
    logp = jax.nn.log_softmax(out.logits_BSV[:, :-1])
    nll = -jnp.take_along_axis(logp, tok[:, 1:, None], -1).mean()
    return nll + 0.01 * out.aux_loss, out.expert_ids_BSLK
  return loss


def _sharded_loss_and_grads(cfg, state, mesh, tok, replay_BSLK=None, mask_BS=None):
  graphdef = nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0)))
  shardings = sh.state_shardings(state, mesh)
  bs = sh.batch_sharding(mesh)
  args = [jax.device_put(a, sh.batch_sharding(mesh, a.ndim)) if a is not None else None
          for a in (tok, replay_BSLK, mask_BS)]
  def f(state, tok, rep, mask):
    return jax.value_and_grad(_loss(graphdef, tok, rep, mask), has_aux=True)(state)
  with jax.set_mesh(mesh):
    (l, ids), g = jax.jit(f, in_shardings=(shardings, bs, None, None),
                          out_shardings=((sh.replicated(mesh), bs), shardings))(
                              sh.shard_state(state, mesh), *args)
  return l, ids, g


@pytest.mark.parametrize("mesh_name,routing", [
    ("e2t2", "replay"), ("e4", "skewed"),
    # Normal routing is also covered, with gradients, at the dispatch level above.
    pytest.param("e4", "normal", marks=pytest.mark.slow)])
def test_model_loss_and_grads_equal_gspmd(mesh_name, routing):
  mesh = sh.make_mesh(MESHES[mesh_name])
  _, state = nnx.split(Transformer(MOE, rngs=nnx.Rngs(0)))
  tok = _tokens()
  replay = mask = None
  if routing == "skewed":
    # A zero router gives a uniform softmax; top-k breaks the tie by lowest index, so every
    # token of every MoE layer picks experts 0 and 1 (both on the first expert shard).
    for layer in MOE.moe_layers:
      w = state["layers"][layer]["ffn"]["w_router"]
      w.set_value(jnp.zeros_like(w.get_value()))
  elif routing == "replay":
    b, t = tok.shape
    replay = jax.random.randint(jax.random.key(5), (b, t, MOE.n_moe_layers, 1), 0, MOE.n_experts)
    replay = (replay + jnp.arange(MOE.n_experts_per_tok)) % MOE.n_experts  # distinct per token
    mask = jnp.ones((b, t), bool).at[:, -1].set(False)
  lg, ids_g, gg = _sharded_loss_and_grads(MOE, state, mesh, tok, replay, mask)
  le, ids_e, ge = _sharded_loss_and_grads(EP, state, mesh, tok, replay, mask)
  if routing == "skewed":
    assert set(np.unique(np.asarray(ids_e))) == {0, 1}
  if routing == "replay":
    np.testing.assert_array_equal(np.asarray(ids_e)[:, :-1], np.asarray(replay)[:, :-1])
  np.testing.assert_array_equal(ids_e, ids_g)
  np.testing.assert_allclose(le, lg, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=F32_ATOL), ge, gg)


def test_missing_mesh_and_bad_config_name_the_key():
  layer = moe_lib.MoE(EP, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="model.moe_dispatch"):
    layer(jnp.ones((2, 3, EP.d_model)), jnp.ones((2, 3), bool))
  with pytest.raises(ConfigError, match="model.moe_dispatch"):
    dataclasses.replace(MOE, moe_dispatch="all_to_all")
  mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=1, expert=8, tensor=1))
  ws = _experts(0, n_experts=4)
  x = jnp.ones((8, 8))
  ids, gates = _routes(jnp.ones((8, 4)))
  with pytest.raises(ConfigError, match="n_experts=4 is not divisible"):
    ep_lib.shard_map_experts(x, ids, gates, *ws, 4, mesh=mesh)


def test_comm_bytes_closed_forms():
  kw = dict(tokens=1024, d_model=2048, n_experts=128, top_k=8, expert_axis=8, act_bytes=2)
  sm = ep_lib.dispatch_comm_bytes("shard_map", **kw)
  assert sm["all_gather"] == 7 * 1024 * (2048 * 2 + 8 * 8)
  assert sm["reduce_scatter"] == 7 * 1024 * 2048 * 2
  assert sm["total"] == sm["all_gather"] + sm["reduce_scatter"]
  # Balanced all-to-all moves k (ep-1)/ep of the pairs each way.
  assert sm["all_to_all_balanced"] == 2 * 1024 * 8 * 7 / 8 * 4096 + 1024 * 8 * 7 / 8 * 4
  assert sm["all_to_all_skewed"] == 7 * 1024 * 8 * (4096 + 4)
  gs = ep_lib.dispatch_comm_bytes("gspmd", batch_shards=16, **kw)
  assert gs["total"] == 2 * 15 / 16 * (16 * 1024) * 8 * 4096
  # One device: nothing moves.
  one = ep_lib.dispatch_comm_bytes("shard_map", **dict(kw, expert_axis=1))
  assert one["total"] == 0 and one["all_to_all_balanced"] == 0
  with pytest.raises(ConfigError, match="model.moe_dispatch"):
    ep_lib.dispatch_comm_bytes("all_to_all", **kw)


def test_comm_bytes_match_compiled_shard_map_collectives():
  # data=2 x expert=4, no fsdp / tensor split: every collective in the program is the dispatch's.
  mesh = sh.make_mesh(MESHES["e4"])
  n_global, d, e, k = 64, 8, 8, 2
  x = jnp.ones((n_global, d))
  ids, gates = _routes(jax.random.normal(jax.random.key(0), (n_global, e)), k)
  with jax.set_mesh(mesh):
    hlo = jax.jit(ep_lib.shard_map_experts, static_argnums=6).lower(
        x, ids, gates, *_experts(0, e, d), e).compile().as_text()
  ep = mesh.shape["expert"]
  received = 0
  for dtype, dims, op in re.findall(r"= (f32|s32)\[([\d,]*)\]\{[^}]*\} (all-gather|reduce-scatter)\(", hlo):
    nbytes = 4 * math.prod(int(x) for x in dims.split(","))
    # A gathered output holds ep parts, (ep-1) of them from other devices; a scattered output is
    # one part of the ep-1 partial sums each other device sent.
    received += nbytes * (ep - 1) / ep if op == "all-gather" else nbytes * (ep - 1)
  want = ep_lib.dispatch_comm_bytes("shard_map", tokens=n_global // sh.batch_divisor(mesh), d_model=d,
                                    n_experts=e, top_k=k, expert_axis=ep, act_bytes=4)["total"]
  assert received == want


@pytest.mark.slow
def test_sft_job_runs_with_the_shard_map_dispatch(tmp_path):
  """The jobs enter the mesh context the shard_map dispatch needs (sharding.mesh_context):
  an SFT run on an expert=2 mesh trains with `model.moe_dispatch=shard_map` and ends finite."""
  from configs import sft_countdown_tiny  # pylint: disable=g-import-not-at-top
  from rl_jax import sft  # pylint: disable=g-import-not-at-top
  cfg = sft_countdown_tiny.get_config("test")
  cfg.model.moe_dispatch = "shard_map"
  cfg.mesh.expert = 2
  cfg.sft.steps = cfg.sft.eval_every = cfg.sft.checkpoint_every = 2
  out = sft.run(cfg, str(tmp_path / "sft"))
  floats = {k: v for k, v in out.items() if isinstance(v, float)}
  assert floats and all(np.isfinite(v) for v in floats.values()), out


def _sample(cfg, mesh, quant, scan=False):
  """The sampler's generate (prefill + KV-cache decode) of `cfg`'s model on `mesh`, in its context."""
  from rl_jax.sampler import generate as gen  # pylint: disable=g-import-not-at-top
  from rl_jax.sampler import weights as W  # pylint: disable=g-import-not-at-top
  from rl_jax.sampler.config import SamplerConfig  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(cfg, scan_layers=scan)
  scfg = SamplerConfig(max_prompt_len=5, max_new_tokens=5, temperature=0.8, record_topk=4, eos_id=1,
                       quant=quant)
  rng = np.random.default_rng(0)
  toks = rng.integers(2, 64, (8, 5)).astype(np.int32)
  valid = np.arange(5)[None, :] < np.array([3, 5, 1, 4, 2, 5, 5, 3])[:, None]
  state = nnx.state(Transformer(dataclasses.replace(cfg, moe_dispatch="gspmd"), rngs=nnx.Rngs(0)))
  sstate = W.sync_weights(sh.shard_state(state, mesh), None, scfg.quant, scfg.dtype)
  with sh.mesh_context(mesh):
    return gen.generate(W.sampler_graphdef(cfg, scfg.dtype), sstate, toks, valid, jax.random.key(3), scfg,
                        mesh=mesh)


# The sampler path: prefill (8 x 4 tokens) and decode steps (8 tokens, split over data x expert).
@pytest.mark.parametrize("mesh_name,quant,scan", [
    pytest.param("e4", "none", False, marks=pytest.mark.slow),  # ~15 s
    ("e2t2", "fp8_wa_fp8_kv", True),  # QTensor experts and a scanned layer stack inside the dispatch
], ids=["e4-fp32", "e2t2-fp8-scanned"])
def test_sampler_generate_with_shard_map_equals_gspmd(mesh_name, quant, scan):
  mesh = sh.make_mesh(MESHES[mesh_name])
  a = _sample(MOE, mesh, quant, scan)
  b = _sample(EP, mesh, quant, scan)
  np.testing.assert_array_equal(b.tokens_BS, a.tokens_BS)
  np.testing.assert_array_equal(b.expert_ids_BSLK, a.expert_ids_BSLK)
  np.testing.assert_array_equal(b.topk_ids_BTK, a.topk_ids_BTK)
  np.testing.assert_allclose(b.logq_BT, a.logq_BT, atol=F32_ATOL)
  np.testing.assert_allclose(b.topk_logq_BTK, a.topk_logq_BTK, atol=F32_ATOL)
  assert int(np.sum(b.response_mask_BS)) > 8  # decoding really ran past the first token
