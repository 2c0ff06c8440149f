"""Scanned layers (ModelConfig.scan_layers) == the unrolled model: logits, grads, cache, replay, I/O, sharding."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax import sharding as sh
from rl_jax.models import ModelConfig, Transformer, hf, init_cache
from rl_jax.models.kv_cache import unstack_cache
from rl_jax.models.transformer import stack_layers, unstack_layers
from jitted_model import jitted

# float32 tolerance for results computed with different reduction orders / layouts.
F32_ATOL = 2e-5

_BASE = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
             n_experts_per_tok=2, moe_d_ff=16, init_std=0.2, tie_embeddings=False)
DENSE = ModelConfig(n_layers=3, **_BASE)
# All layers MoE (the Qwen3-30B-A3B pattern): one scanned group.
MOE = ModelConfig(n_layers=3, n_experts=8, router_aux_loss_coef=0.01, **_BASE)
# mlp_only_layers: runs of 1 MoE, 2 dense, 2 MoE layers (scan lengths > 1 of both kinds).
RUNS = ModelConfig(n_layers=5, n_experts=8, mlp_only_layers=(1, 2), router_aux_loss_coef=0.01, **_BASE)
# decoder_sparse_step=2: dense / MoE alternate, every group has one layer.
ALT = ModelConfig(n_layers=4, n_experts=8, decoder_sparse_step=2, **_BASE)
CONFIGS = [DENSE, MOE, RUNS, ALT]
IDS = ["dense", "moe", "runs", "alternating"]

# Tiny programs: XLA's backend optimizations cost more than they save here.
pytestmark = pytest.mark.usefixtures("fast_compile")


def _scanned(cfg):
  return dataclasses.replace(cfg, scan_layers=True)


def _pair(cfg, **kw):
  """(unrolled, scanned) models with the same weights: both built from seed 0."""
  return (Transformer(dataclasses.replace(cfg, **kw), rngs=nnx.Rngs(0)),
          Transformer(_scanned(dataclasses.replace(cfg, **kw)), rngs=nnx.Rngs(0)))


def _params(model):
  return nnx.to_pure_dict(nnx.state(model))


def _tokens(b=2, s=7, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, s), 0, 64)


def _assert_trees_equal(a, b, atol=0.0):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol), a, b)


def test_layer_groups_are_the_maximal_same_kind_runs():
  assert DENSE.layer_groups == ((0, 3, False),)
  assert MOE.layer_groups == ((0, 3, True),)
  assert RUNS.layer_groups == ((0, 1, True), (1, 2, False), (3, 2, True))
  assert ALT.layer_groups == ((0, 1, False), (1, 1, True), (2, 1, False), (3, 1, True))
  for cfg in CONFIGS:  # the runs tile the layers and agree with moe_layers
    kinds = [k for _, n, k in cfg.layer_groups for _ in range(n)]
    assert kinds == [i in cfg.moe_layers for i in range(cfg.n_layers)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_layouts_convert_exactly_and_share_the_init(cfg):
  unrolled, scanned = _pair(cfg)
  stacked = stack_layers(_params(unrolled), cfg)
  _assert_trees_equal(stacked, _params(scanned))
  _assert_trees_equal(unstack_layers(stacked, cfg), _params(unrolled))
  # The stacked parameters carry the leading logical 'layers' axis (replicated by the rules).
  wq = nnx.state(scanned)["layer_groups"][0]["attn"]["wq"]
  assert wq.get_metadata()["axes"] == ("layers", "embed", "heads")
  with pytest.raises(ValueError, match="already scanned"):
    stack_layers(stacked, cfg)


def _loss_fn(graphdef, tok):
  def loss(state):
    out = nnx.merge(graphdef, state)(tok)
    logp = jax.nn.log_softmax(out.logits_BSV[:, :-1])
    nll = -jnp.take_along_axis(logp, tok[:, 1:, None], -1).mean()
    return nll + 0.01 * out.aux_loss
  return loss


# The MoE and runs cases cost ~17 s each on 2 cores: slow (dense and alternating stay in the
# default suite; `-m slow` runs the rest).
@pytest.mark.parametrize("cfg,remat", [(DENSE, False),
                                       pytest.param(MOE, True, marks=pytest.mark.slow),
                                       pytest.param(RUNS, False, marks=pytest.mark.slow),
                                       pytest.param(RUNS, True, marks=pytest.mark.slow),
                                       (ALT, False)],
                         ids=["dense", "moe-remat", "runs", "runs-remat", "alternating"])
def test_scanned_equals_unrolled_logits_and_grads(cfg, remat):
  unrolled, scanned = _pair(cfg, remat=remat)
  tok = _tokens()
  a = jitted(unrolled)(tok, return_router_logits=True)
  b = jitted(scanned)(tok, return_router_logits=True)
  np.testing.assert_allclose(b.logits_BSV, a.logits_BSV, atol=F32_ATOL)
  np.testing.assert_array_equal(b.expert_ids_BSLK, a.expert_ids_BSLK)
  assert b.expert_ids_BSLK.shape == (2, 7, cfg.n_moe_layers, 2)
  np.testing.assert_allclose(b.aux_loss, a.aux_loss, rtol=1e-6)
  if cfg.n_moe_layers:
    np.testing.assert_allclose(b.router_logits_BSLE, a.router_logits_BSLE, atol=F32_ATOL)
  ga_graph, ga_state = nnx.split(unrolled)
  gb_graph, gb_state = nnx.split(scanned)
  la, ga = jax.jit(jax.value_and_grad(_loss_fn(ga_graph, tok)))(ga_state)
  lb, gb = jax.jit(jax.value_and_grad(_loss_fn(gb_graph, tok)))(gb_state)
  np.testing.assert_allclose(lb, la, rtol=1e-6)
  _assert_trees_equal(nnx.to_pure_dict(gb), stack_layers(nnx.to_pure_dict(ga), cfg), atol=1e-6)


@pytest.mark.parametrize("cfg", [DENSE, pytest.param(RUNS, marks=pytest.mark.slow)],  # runs: ~20 s
                         ids=["dense", "runs"])
def test_scanned_kv_cache_decode_equals_full_recompute(cfg):
  unrolled, scanned = _pair(cfg)
  scfg = scanned.cfg
  unrolled, scanned = jitted(unrolled), jitted(scanned)
  tok = _tokens(2, 9)
  full = scanned(tok)
  cache = init_cache(scfg, 2, 12)
  assert len(cache) == len(cfg.layer_groups) and all(kv.stacked for kv in cache)
  assert [kv.v.shape for kv in cache] == [(n, 2, 2, 12, 8) for _, n, _ in cfg.layer_groups]  # [L, B, G, C, D]
  assert [kv.k.shape for kv in cache] == [(n, 2, 2, 8, 12) for _, n, _ in cfg.layer_groups]  # keys: [L, B, G, D, C]
  ref_cache = init_cache(cfg, 2, 12)
  out = scanned(tok[:, :5], cache=cache, cache_index=0)
  ref = unrolled(tok[:, :5], cache=ref_cache, cache_index=0)
  np.testing.assert_allclose(out.logits_BSV, full.logits_BSV[:, :5], atol=F32_ATOL)
  cache, ref_cache = out.cache, ref.cache
  for i in range(5, 9):
    out = scanned(tok[:, i:i + 1], cache=cache, cache_index=i)
    ref_cache = unrolled(tok[:, i:i + 1], cache=ref_cache, cache_index=i).cache
    cache = out.cache
    np.testing.assert_allclose(out.logits_BSV[:, 0], full.logits_BSV[:, i], atol=F32_ATOL)
    np.testing.assert_array_equal(out.expert_ids_BSLK[:, 0], full.expert_ids_BSLK[:, i])
  # The stacked cache holds what the unrolled model's per-layer cache holds.
  _assert_trees_equal(unstack_cache(scfg, cache), ref_cache, atol=F32_ATOL)
  with pytest.raises(ValueError, match="model.scan_layers=True needs"):
    scanned(tok[:, :1], cache=ref_cache, cache_index=0)


@pytest.mark.parametrize("cfg", [RUNS, ALT], ids=["runs", "alternating"])
def test_scanned_routing_replay_equals_unrolled(cfg):
  unrolled, scanned = (jitted(m) for m in _pair(cfg))
  tok = _tokens()
  # Replay ids unlike the natural ones (a per-layer shift), on half of the positions.
  natural = unrolled(tok).expert_ids_BSLK
  replay = (natural + 1 + jnp.arange(cfg.n_moe_layers)[None, None, :, None]) % cfg.n_experts
  mask = jnp.arange(7)[None, :] % 2 == 0
  mask = jnp.broadcast_to(mask, (2, 7))
  a = unrolled(tok, replay_ids_BSLK=replay, replay_mask_BS=mask)
  b = scanned(tok, replay_ids_BSLK=replay, replay_mask_BS=mask)
  np.testing.assert_array_equal(b.expert_ids_BSLK, a.expert_ids_BSLK)
  np.testing.assert_array_equal(np.asarray(b.expert_ids_BSLK)[np.asarray(mask)],
                                np.asarray(replay)[np.asarray(mask)])
  np.testing.assert_allclose(b.logits_BSV, a.logits_BSV, atol=F32_ATOL)
  # Replay really changed the forward (else the test could not see a per-layer mix-up).
  assert np.abs(np.asarray(b.logits_BSV) - np.asarray(scanned(tok).logits_BSV)).max() > 1e-3


def test_hf_round_trip_between_layouts(tmp_path):
  unrolled, scanned = _pair(RUNS)
  # Tiny shards: stacked parameters are written layer by layer across files.
  hf.save_hf_checkpoint(scanned, str(tmp_path / "scanned"), max_shard_bytes=20_000)
  hf.save_hf_checkpoint(unrolled, str(tmp_path / "unrolled"))
  back = hf.load_hf_model(str(tmp_path / "scanned"), scan_layers=True)
  assert back.cfg.scan_layers
  _assert_trees_equal(_params(back), _params(scanned))
  # Either layout reads the other's files: the HF format has no layer axis.
  _assert_trees_equal(_params(hf.load_hf_model(str(tmp_path / "scanned"))), _params(unrolled))
  _assert_trees_equal(_params(hf.load_hf_model(str(tmp_path / "unrolled"), scan_layers=True)),
                      _params(scanned))


def test_orbax_restores_scanned_and_layouts_convert(tmp_path):
  from rl_jax.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top
  unrolled, scanned = _pair(MOE)
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, {"params": _params(scanned)}, {"step": 1})
  target = _params(Transformer(_scanned(MOE), rngs=nnx.Rngs(1)))
  items, _, _ = ckpt.restore({"params": target})
  _assert_trees_equal(items["params"], _params(scanned))
  # An unrolled run restores the same checkpoint through the conversion.
  _assert_trees_equal(unstack_layers(items["params"], MOE), _params(unrolled))
  ckpt.close()


@pytest.mark.parametrize("cfg,mesh_cfg", [
    (DENSE, sh.MeshConfig(data=2, fsdp=2, expert=1, tensor=2)),
    pytest.param(RUNS, sh.MeshConfig(data=1, fsdp=2, expert=2, tensor=2), marks=pytest.mark.slow),  # ~16 s
], ids=["dense", "runs"])
def test_scanned_sharded_equals_unrolled_single_device(cfg, mesh_cfg):
  assert jax.device_count() == 8, "tests/conftest.py forces 8 host devices"
  mesh = sh.make_mesh(mesh_cfg)
  unrolled, scanned = _pair(cfg)
  tok = _tokens(8, 6)
  graphdef, state = nnx.split(scanned)
  shardings = sh.state_shardings(state, mesh)
  wq_spec = shardings["layer_groups"][0]["attn"]["wq"].spec
  assert wq_spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  u_graph, u_state = nnx.split(unrolled)
  l1, g1 = jax.jit(jax.value_and_grad(_loss_fn(u_graph, tok)))(u_state)
  stok = jax.device_put(tok, sh.batch_sharding(mesh))
  def sloss(state, tok):
    return jax.value_and_grad(_loss_fn(graphdef, tok))(state)
  l8, g8 = jax.jit(sloss, in_shardings=(shardings, sh.batch_sharding(mesh)),
                   out_shardings=(sh.replicated(mesh), shardings))(sh.shard_state(state, mesh), stok)
  np.testing.assert_allclose(l8, l1, rtol=1e-6)
  _assert_trees_equal(nnx.to_pure_dict(g8), stack_layers(nnx.to_pure_dict(g1), cfg), atol=F32_ATOL)


def test_scanned_sampler_equals_unrolled_sharded():
  """generate() with a stacked cache, on a mesh (the cache constraint skips the layer axis)."""
  from rl_jax.sampler import generate as gen  # pylint: disable=g-import-not-at-top
  from rl_jax.sampler.config import SamplerConfig  # pylint: disable=g-import-not-at-top
  unrolled, scanned = _pair(RUNS)
  cfg = SamplerConfig(max_prompt_len=6, max_new_tokens=5, temperature=0.7, record_topk=4, eos_id=1)
  rng = np.random.default_rng(0)
  toks = rng.integers(2, 64, (4, 6)).astype(np.int32)
  valid = np.arange(6)[None, :] < np.array([3, 6, 1, 4])[:, None]
  mesh = sh.make_mesh(sh.MeshConfig(data=2, fsdp=1, expert=2, tensor=2))
  u_graph, u_state = nnx.split(unrolled)
  s_graph, s_state = nnx.split(scanned)
  r = gen.generate(u_graph, u_state, toks, valid, jax.random.key(3), cfg)
  rs = gen.generate(s_graph, sh.shard_state(s_state, mesh), toks, valid, jax.random.key(3), cfg, mesh=mesh)
  np.testing.assert_array_equal(rs.tokens_BS, r.tokens_BS)
  np.testing.assert_allclose(rs.logq_BT, r.logq_BT, atol=F32_ATOL)
  np.testing.assert_array_equal(rs.expert_ids_BSLK, r.expert_ids_BSLK)
