"""Sampler: zero-mismatch logq / top-k / experts, KV cache == recompute, batching, no recompiles."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax import rollout as rollout_lib
from rl_jax.config_utils import ConfigError, from_dict
from rl_jax.logprobs import next_token_logq
from rl_jax.models.config import ModelConfig
from rl_jax.models.decode import greedy_reference
from rl_jax.models.transformer import Transformer
from rl_jax.quant.config import QuantConfig
from rl_jax.sampler import decode
from rl_jax.sampler import generate as gen
from rl_jax.sampler.config import SamplerConfig, sampler_config

V = 64
P = 8  # max_prompt_len
T = 10  # max_new_tokens
# Float tolerance of the zero-mismatch check: the sampler's T=1 cached decode and the
# trainer's full teacher-forced forward sum the same terms in a different order
# (observed max |diff| ~ 3e-6 on log-probs of magnitude ~1-5 in float32).
LOGQ_ATOL = 2e-5


# The other families' switches (models/families), on the same shapes.
FAMILY_SWITCHES = {
    "llama3": dict(family="llama3", qk_norm=False, rope_scaling="llama3", rope_factor=4.0,
                   rope_original_max_positions=16, rope_theta=10_000.0),
    "qwen2_moe": dict(family="qwen2_moe", qk_norm=False, qkv_bias=True, shared_expert_d_ff=24,
                      norm_topk_prob=False),
}


def _model(moe: bool, family: str = "qwen3") -> Transformer:
  # init_std 0.2 and untied embeddings give peaked, non-repetitive next-token
  # distributions, so greedy argmaxes are far from ties.
  cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                    n_experts=4 if moe else 0, n_experts_per_tok=2, moe_d_ff=32, init_std=0.2,
                    tie_embeddings=False, **FAMILY_SWITCHES.get(family, {}))
  return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
  return _model(request.param == "moe")


def _prompts(lengths, width=P, seed=0, right=True):
  """Right- (or left-) padded prompts of the given lengths, ids in [2, V)."""
  rng = np.random.default_rng(seed)
  toks = np.zeros((len(lengths), width), np.int32)
  valid = np.zeros((len(lengths), width), bool)
  for i, n in enumerate(lengths):
    sl = slice(0, n) if right else slice(width - n, width)
    toks[i, sl] = rng.integers(2, V, n)
    valid[i, sl] = True
  return toks, valid


# ------------------------------------------------------------------------------ config


def test_config_from_dict_and_errors():
  cfg = sampler_config(dict(max_prompt_len=16, max_new_tokens=8, temperature=0.7, quant="int8_wa_int8_kv"))
  assert cfg.quant == QuantConfig.preset("int8_wa_int8_kv") and cfg.max_len == 24
  assert SamplerConfig().quant == QuantConfig.preset("none")
  nested = from_dict(SamplerConfig, dict(quant=dict(weights=dict(format="int4"))), prefix="sampler")
  assert nested.quant.weights.format == "int4"
  hash(nested)  # static argument of the jitted program
  with pytest.raises(ConfigError, match="sampler.noise"):
    sampler_config(dict(noise="gaussian"))
  with pytest.raises(ConfigError, match="sampler.dtype"):
    sampler_config(dict(dtype="float16"))
  with pytest.raises(ConfigError, match="sampler.top_p"):
    sampler_config(dict(top_p=0.0))
  with pytest.raises(ConfigError, match="sampler.noise_sigma"):
    sampler_config(dict(noise="relative"))
  with pytest.raises(ConfigError, match="sampler.bogus"):
    sampler_config(dict(bogus=1))
  with pytest.raises(ConfigError, match="sampler.quant"):
    sampler_config(dict(quant="int3"))
  with pytest.raises(ConfigError, match="sampler.record_topk"):
    SamplerConfig(record_topk=V + 1).check_vocab(V)
  SamplerConfig(record_topk=V).check_vocab(V)  # k = V: the full distribution


def test_prompt_longer_than_limit_is_an_error():
  cfg = SamplerConfig(max_prompt_len=4, max_new_tokens=2)
  toks, valid = _prompts([3, 5], width=6)
  with pytest.raises(ValueError, match=r"prompt row 1 has 5 tokens > sampler.max_prompt_len=4"):
    gen.check_prompts(toks, valid, cfg)
  with pytest.raises(ValueError, match="row 0 is empty"):
    gen.check_prompts(toks, np.zeros_like(valid), cfg)
  # A wide buffer is fine as long as every row fits: padding is not truncation.
  gen.check_prompts(*_prompts([3, 4], width=6), cfg)


# ------------------------------------------------------------------- zero mismatch


def _count_traces(monkeypatch):
  """Makes the generation program raise if it is traced (hence compiled) more than once."""
  chex.clear_trace_counter()
  once = jax.jit(chex.assert_max_traces(gen.generate_program, n=1),
                 static_argnames=gen._STATIC_ARGNAMES)  # pylint: disable=protected-access
  monkeypatch.setattr(gen, "_generate", once)


def test_zero_mismatch_logq_topk_experts(model, monkeypatch):
  """fp32, no quantization, no noise: logq == trainer log p, top-k == lax.top_k, experts equal."""
  is_moe = model.cfg.is_moe
  k = V if is_moe else 16  # k = V (full distribution) on one model, a strict head on the other
  cfg = SamplerConfig(max_prompt_len=P, max_new_tokens=T, temperature=0.7, top_p=0.9,
                      top_k=0 if is_moe else 40, record_topk=k, eos_id=1)
  graphdef, state = nnx.split(model)
  toks, valid = _prompts([3, 8, 5, 1], seed=1)  # right-padded, variable length
  _count_traces(monkeypatch)
  r = gen.generate(graphdef, state, toks, valid, jax.random.key(0), cfg)

  @jax.jit  # the trainer's side as one program: eagerly every op compiles its own XLA program
  def teacher_forcing(state, r):
    out = nnx.merge(graphdef, state)(r.tokens_BS, r.positions_BS, r.valid_BS)
    # The lower-level helpers too: targets at logits slot s = token s+1.
    targets_BS, tmask_BS = rollout_lib.trainer_targets(r)
    logp_BSV = next_token_logq(out.logits_BSV, cfg.temperature)
    logp_BS = jnp.take_along_axis(logp_BSV, targets_BS[..., None], -1)[..., 0]
    return (out, rollout_lib.trainer_logprobs(out.logits_BSV, r, cfg.temperature),
            rollout_lib.response_slice(tmask_BS, r), rollout_lib.response_slice(logp_BS, r),
            rollout_lib.response_slice(logp_BSV, r))

  out, (logp_BT, logp_topk_BTK), tmask_BT, logp_BS_BT, logp_BTV = teacher_forcing(state, r)
  mask = np.asarray(r.response_mask_BT)
  assert mask[:, 0].all()
  err = np.abs(np.where(mask, np.asarray(logp_BT) - np.asarray(r.logq_BT), 0.0))
  assert err.max() < LOGQ_ATOL, err.max()
  # The same numbers through the lower-level helpers.
  np.testing.assert_array_equal(tmask_BT, mask)
  np.testing.assert_allclose(np.where(mask, logp_BS_BT, 0), logp_BT, atol=1e-6)
  if cfg.top_k:  # sampled tokens lie in the top-k of q (= p here)
    kth = np.asarray(jax.lax.top_k(logp_BTV, cfg.top_k)[0][..., -1])
    assert np.all((np.asarray(r.logq_BT) >= kth - LOGQ_ATOL)[mask])
  top_logp, top_ids = jax.lax.top_k(logp_BTV, k)
  m3 = mask[..., None]
  np.testing.assert_array_equal(np.where(m3, top_ids, 0), r.topk_ids_BTK)
  assert np.abs(np.where(m3, top_logp - r.topk_logq_BTK, 0)).max() < LOGQ_ATOL
  assert np.abs(np.where(m3, logp_topk_BTK - r.topk_logq_BTK, 0)).max() < LOGQ_ATOL
  head = np.where(mask, np.exp(np.asarray(top_logp)).sum(-1), 0)
  np.testing.assert_allclose(r.head_mass_BT, head, atol=1e-5)
  if k == V:
    np.testing.assert_allclose(np.asarray(r.head_mass_BT)[mask], 1.0, atol=1e-5)
    # Every sampled token lies in the top-p nucleus: the mass strictly above it is < top_p.
    q = np.exp(np.asarray(r.topk_logq_BTK))
    above = np.where(q > np.exp(np.asarray(r.logq_BT))[..., None], q, 0).sum(-1)
    assert np.all(above[mask] < cfg.top_p)
  else:
    assert np.all(np.asarray(r.head_mass_BT)[mask] < 1.0)

  if is_moe:
    ev = np.asarray(r.expert_valid_BS)
    assert r.expert_ids_BSLK.shape == (4, P + T, model.cfg.n_moe_layers, 2)
    np.testing.assert_array_equal(np.where(ev[..., None, None], out.expert_ids_BSLK, 0), r.expert_ids_BSLK)
    # Routes exist for real prompt tokens and every response token but the last one.
    np.testing.assert_array_equal(ev.sum(1), np.asarray(r.prompt_lengths_B) + np.asarray(r.lengths_B) - 1)
  else:
    assert r.expert_ids_BSLK is None

  # Same shapes and config, new prompts and key: no retrace (hence no recompilation).
  toks2, valid2 = _prompts([8, 2, 2, 6], seed=2, right=False)
  gen.generate(graphdef, state, toks2, valid2, jax.random.key(1), cfg)
  r3 = gen.generate(graphdef, state, toks, valid, jax.random.key(0), cfg)
  r4 = gen.generate(graphdef, state, toks, valid, jax.random.key(1), cfg)
  assert gen._generate._cache_size() == 1  # pylint: disable=protected-access
  # Deterministic given the key; different for another key.
  np.testing.assert_array_equal(r3.tokens_BS, r.tokens_BS)
  assert not np.array_equal(r4.tokens_BS, r.tokens_BS)

  # Group sampling: 2 prompts x G=2 (same shape, so still no retrace), sampled rows of
  # a group differ, and the rollout is reproducible from the key.
  gp = rollout_lib.repeat_prompts((toks[:2], valid[:2]), 2)
  np.testing.assert_array_equal(rollout_lib.group_index(2, 2), [0, 0, 1, 1])
  rg = gen.generate(graphdef, state, *gp, jax.random.key(5), cfg)
  rg2 = gen.generate(graphdef, state, *gp, jax.random.key(5), cfg)
  assert gen._generate._cache_size() == 1  # pylint: disable=protected-access
  np.testing.assert_array_equal(rg.tokens_BS, rg2.tokens_BS)
  np.testing.assert_array_equal(rg.tokens_BS[0, :P], rg.tokens_BS[1, :P])
  assert not np.array_equal(rg.response_BT[0], rg.response_BT[1])


# ---------------------------------------------------------- KV cache == recompute


def test_greedy_kv_cache_equals_full_recompute(model):
  """Greedy: cached decode == `greedy_reference` token for token; batch == each prompt alone."""
  _check_greedy(model)


@pytest.mark.parametrize("family,moe", [("llama3", False), ("qwen2_moe", True)])
def test_greedy_kv_cache_equals_full_recompute_other_families(family, moe):
  """The same check on the Llama 3 and Qwen2-MoE switches (biased q/k/v and the shared expert run
  through the sampler's prefill and cached decode)."""
  _check_greedy(_model(moe, family))


def _check_greedy(model):
  graphdef, state = nnx.split(model)
  toks, valid = _prompts([3, 8, 5, 1, 6, 2], seed=3)
  left, lvalid = _prompts([3, 8, 5, 1, 6, 2], seed=3, right=False)  # the same prompts, left-padded
  # An EOS that some rows emit mid-way: picked from the reference's own continuations.
  free = greedy_reference(model, left, lvalid, T, eos_id=-1)
  counts = np.bincount(free[:, 2:].ravel(), minlength=V)
  counts[np.unique(free[:, :2])] = 0  # not in the first two steps of any row
  eos = int(np.argmax(counts))
  assert counts[eos] > 0
  # Three decode phases (caches of 16, 16, 18 slots): rows stop at EOS inside and across them.
  cfg = SamplerConfig(max_prompt_len=P, max_new_tokens=T, greedy=True, record_topk=4, eos_id=eos, pad_id=0,
                      decode_phases=3, min_phase_steps=1)
  assert [c for _, c in cfg.phase_bounds()] == [16, 16, 18]
  r = gen.generate(graphdef, state, toks, valid, jax.random.key(0), cfg)
  ref = greedy_reference(model, left, lvalid, T, eos_id=eos, pad_id=0)
  np.testing.assert_array_equal(r.response_BT, ref)
  np.testing.assert_array_equal(r.tokens_BS[:, :P], left)
  lengths = np.asarray(r.lengths_B)
  assert lengths.min() < T, "no row stopped at EOS; pick another eos"
  resp = np.asarray(r.response_BT)
  for i, n in enumerate(lengths):
    assert np.asarray(r.response_mask_BT)[i].sum() == n and np.asarray(r.response_mask_BT)[i, :n].all()
    assert n == T or resp[i, n - 1] == eos
    assert (resp[i, n:] == 0).all()
  # Each prompt alone (a batch of copies: same shape, no recompilation).
  for i in range(toks.shape[0]):
    alone = gen.generate(graphdef, state, np.repeat(toks[i:i + 1], 6, 0), np.repeat(valid[i:i + 1], 6, 0),
                         jax.random.key(0), cfg)
    np.testing.assert_array_equal(alone.response_BT[0], resp[i])
    np.testing.assert_allclose(alone.logq_BT[0], r.logq_BT[i], atol=LOGQ_ATOL)


@pytest.mark.parametrize("b,v,k", [(4, 1000, 7), (2, 4096, 128)])
def test_exact_top_k_equals_lax_top_k(b, v, k):
  """The two-stage top-k (forced here with min_ratio=0) is lax.top_k bit for bit, ties included."""
  x = jax.random.normal(jax.random.key(v), (b, v))
  fn = jax.jit(lambda x: (decode.exact_top_k(x, k, min_ratio=0), decode.exact_top_k(x, k)))
  for arr in (x, jnp.round(2 * x), jnp.where(x > 0, -jnp.inf, x)):  # plain, many ties, -inf ties
    want = jax.lax.top_k(arr, k)
    for got in fn(arr):
      np.testing.assert_array_equal(got[0], want[0])
      np.testing.assert_array_equal(got[1], want[1])


def test_head_mass_without_topk_is_the_top1_mass(model):
  """record_topk = 0 records no top-k but still the top-1 mass max_v q_v (a head-mass floor)."""
  cfg = SamplerConfig(max_prompt_len=P, max_new_tokens=T, temperature=0.7, record_topk=0, eos_id=1)
  graphdef, state = nnx.split(model)
  toks, valid = _prompts([3, 8, 5, 1], seed=1)
  r = gen.generate(graphdef, state, toks, valid, jax.random.key(0), cfg)
  assert r.topk_ids_BTK is None and r.topk_logq_BTK is None

  @jax.jit  # one program: eagerly every op compiles its own XLA program
  def trainer_logp_BTV(state, r):
    out = nnx.merge(graphdef, state)(r.tokens_BS, r.positions_BS, r.valid_BS)
    return rollout_lib.response_slice(next_token_logq(out.logits_BSV, cfg.temperature), r)
  logp_BTV = trainer_logp_BTV(state, r)
  mask = np.asarray(r.response_mask_BT)
  chex.assert_shape(r.head_mass_BT, mask.shape)
  want = np.where(mask, np.exp(np.max(np.asarray(logp_BTV), axis=-1)), 0.0)
  np.testing.assert_allclose(r.head_mass_BT, want, atol=1e-5)
  assert np.all(np.asarray(r.head_mass_BT)[mask] < 1.0)


def test_alignment_helpers_round_trip():
  b, t = 2, 3
  r = rollout_lib.Rollout(
      tokens_BS=jnp.arange(2 * 7).reshape(2, 7), positions_BS=None, prompt_mask_BS=None,
      response_mask_BS=jnp.array([[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]], bool),
      logq_BT=jnp.zeros((b, t)), topk_ids_BTK=None, topk_logq_BTK=None, head_mass_BT=None,
      expert_ids_BSLK=None, expert_valid_BS=None, lengths_B=None, prompt_lengths_B=None, prompt_len=4)
  x_BT = jnp.arange(1, 7, dtype=jnp.float32).reshape(2, 3)

  @jax.jit  # one program: eagerly every op compiles its own XLA program
  def helpers(r, x_BT):
    targets, mask = rollout_lib.trainer_targets(r)
    back = rollout_lib.response_to_logit_slots(x_BT, r)
    return targets, mask, rollout_lib.response_slice(targets, r), back, rollout_lib.response_slice(back, r)
  targets, mask, targets_BT, back, back_BT = helpers(r, x_BT)
  np.testing.assert_array_equal(targets[0], [1, 2, 3, 4, 5, 6, 0])
  np.testing.assert_array_equal(mask[1], [0, 0, 0, 1, 1, 1, 0])
  # Logits slot 3 (the last prompt token) predicts response token 0 (slot 4).
  np.testing.assert_array_equal(targets_BT, r.tokens_BS[:, 4:])
  assert back.shape == (2, 7)
  np.testing.assert_array_equal(back_BT, x_BT)


# ---------------------------------------------------------------------- sharding


def test_sharded_equals_unsharded():
  """Batch split over the mesh's batch axes (8 host devices, 4-way batch, 2-way tensor): same rollout."""
  from rl_jax.sharding import MeshConfig, batch_sharding, make_mesh, shard_state  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == 8, "tests/conftest.py forces 8 host devices"
  model = _model(moe=True)
  graphdef, state = nnx.split(model)
  # The zero-mismatch test's MoE config and batch shape, in two decode phases (the grown cache
  # keeps its batch / heads sharding).
  cfg = SamplerConfig(max_prompt_len=P, max_new_tokens=T, temperature=0.7, top_p=0.9, record_topk=V, eos_id=1,
                      decode_phases=2, min_phase_steps=1)
  toks, valid = _prompts([3, 8, 5, 1], seed=4)
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, expert=2, tensor=2))
  r = gen.generate(graphdef, state, toks, valid, jax.random.key(3), cfg)
  rs = gen.generate(graphdef, shard_state(state, mesh), toks, valid, jax.random.key(3), cfg, mesh=mesh)
  assert rs.tokens_BS.sharding.is_equivalent_to(batch_sharding(mesh, 2), 2)
  assert rs.expert_ids_BSLK.sharding.is_equivalent_to(batch_sharding(mesh, 4), 4)
  np.testing.assert_array_equal(rs.tokens_BS, r.tokens_BS)
  np.testing.assert_allclose(rs.logq_BT, r.logq_BT, atol=LOGQ_ATOL)
  np.testing.assert_array_equal(rs.expert_ids_BSLK, r.expert_ids_BSLK)
  with pytest.raises(ValueError, match="multiple of the mesh"):
    gen.generate(graphdef, state, toks[:2], valid[:2], jax.random.key(3), cfg, mesh=mesh)


def test_rollout_is_a_pytree():
  r = rollout_lib.Rollout(*([jnp.zeros((1, 2))] * 12), prompt_len=1)
  leaves, treedef = jax.tree.flatten(r)
  assert len(leaves) == 12
  assert jax.tree.unflatten(treedef, leaves).prompt_len == 1
  assert dataclasses.is_dataclass(r)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quantized_kv_cache_follows_the_backend_switch(model, monkeypatch, fmt):
  """QuantConfig.backend reaches the KV-cache kernels; 'pallas' (interpret mode here) == 'xla'."""
  from rl_jax.ops import quantized as ops  # pylint: disable=g-import-not-at-top
  from rl_jax.quant.config import KVSpec  # pylint: disable=g-import-not-at-top
  seen = []
  real = ops.quantize_rows

  def spy(*args, **kwargs):
    seen.append(ops.resolve_backend(args[4] if len(args) > 4 else kwargs.get("backend", "auto")))
    return real(*args, **kwargs)

  monkeypatch.setattr(ops, "quantize_rows", spy)
  graphdef, state = nnx.split(model)
  toks, valid = _prompts([3, 8, 5, 1], seed=5)
  out = {}
  for backend in ("pallas", "xla"):
    cfg = SamplerConfig(max_prompt_len=P, max_new_tokens=T, greedy=True, record_topk=4, eos_id=1,
                        pad_id=0, quant=QuantConfig(kv=KVSpec(fmt), backend=backend))
    seen.clear()
    out[backend] = gen.generate(graphdef, state, toks, valid, jax.random.key(0), cfg)
    # The cache layout comes from an XLA eval_shape; the writes must use the configured kernels.
    assert ("pallas" in seen) == (backend == "pallas"), (backend, seen)
  np.testing.assert_array_equal(out["pallas"].response_BT, out["xla"].response_BT)
  np.testing.assert_array_equal(out["pallas"].logq_BT, out["xla"].logq_BT)


# ---------------------------------------------------------------------- decode phases


def test_phase_bounds_cover_every_step_and_the_slots_it_reads():
  for p, t, n, m in [(8, 10, 3, 1), (32, 128, 4, 32), (64, 100, 4, 32), (8, 10, 4, 32), (5, 7, 10, 1)]:
    cfg = SamplerConfig(max_prompt_len=p, max_new_tokens=t, decode_phases=n, min_phase_steps=m)
    bounds = cfg.phase_bounds()
    assert len(bounds) == max(1, min(n, t // m))
    ends, slots = [e for e, _ in bounds], [c for _, c in bounds]
    assert ends[-1] == t and ends == sorted(set(ends)) and ends[0] >= 1
    # A phase ending before step e feeds slots up to P+e-2, so it needs P+e-1 slots; never more than S.
    assert all(p + e - 1 <= c <= p + t for e, c in bounds), bounds
    assert slots == sorted(slots)
  assert SamplerConfig(max_prompt_len=32, max_new_tokens=128).phase_bounds() == [
      (32, 64), (64, 96), (96, 128), (128, 160)]
  with pytest.raises(ConfigError, match="sampler.decode_phases"):
    SamplerConfig(decode_phases=0)


@pytest.mark.parametrize("kv", ["fp32", "fp4"])
def test_decode_phases_equal_one_phase(model, kv):
  """Phases only drop cache slots that no step of the phase can see: same tokens, top-k ids and
  experts as one loop over the whole cache, log-probs to float tolerance (shorter sums)."""
  from rl_jax.quant.config import KVSpec  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(model)
  toks, valid = _prompts([3, 8, 5, 1], seed=6)
  # fp4 with e8m0 block scales: the grown slots get the unit scales a fresh cache has.
  quant = QuantConfig(kv=KVSpec("fp4", block_size=8)) if kv == "fp4" else "none"
  out = {}
  for n in (1, 3):
    cfg = SamplerConfig(max_prompt_len=P, max_new_tokens=T, temperature=0.7, record_topk=8, eos_id=1,
                        quant=quant, decode_phases=n, min_phase_steps=1)
    assert len(cfg.phase_bounds()) == n
    out[n] = gen.generate(graphdef, state, toks, valid, jax.random.key(3), cfg)
  one, three = out[1], out[3]
  np.testing.assert_array_equal(three.tokens_BS, one.tokens_BS)
  np.testing.assert_array_equal(three.response_mask_BS, one.response_mask_BS)
  np.testing.assert_array_equal(three.topk_ids_BTK, one.topk_ids_BTK)
  np.testing.assert_allclose(three.logq_BT, one.logq_BT, atol=LOGQ_ATOL)
  np.testing.assert_allclose(three.topk_logq_BTK, one.topk_logq_BTK, atol=LOGQ_ATOL)
  if model.cfg.is_moe:
    np.testing.assert_array_equal(three.expert_ids_BSLK, one.expert_ids_BSLK)


# ---------------------------------------------------------------------- waves of rows


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_waves_and_prefill_chunks_equal_one_batch(model, kv):
  """`max_rows_in_flight` / `prefill_rows` only bound memory: every row's tokens, top-k ids and
  experts are those of the one-batch program (row b samples with split(key, B)[b]); its log-probs
  agree to float rounding. Not bitwise: XLA:CPU's dot blocks its reduction by the operand's row
  count, so the same row's logits move by ~1 ulp with the batch around it (measured 9.5e-7 on
  log-probs of ~4, both for waves and for prefill chunks alone)."""
  from rl_jax.quant.config import KVSpec  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(model)
  toks, valid = _prompts([3, 8, 5, 1, 7, 2, 8, 4], seed=7)
  quant = QuantConfig(kv=KVSpec("int8")) if kv == "int8" else "none"
  base = SamplerConfig(max_prompt_len=P, max_new_tokens=T, temperature=0.8, record_topk=8, eos_id=1, quant=quant,
                       decode_phases=2, min_phase_steps=1)
  one = gen.generate(graphdef, state, toks, valid, jax.random.key(4), base)
  split = gen.generate(graphdef, state, toks, valid, jax.random.key(4),
                       dataclasses.replace(base, max_rows_in_flight=2, prefill_rows=1))
  for f in ("tokens_BS", "response_mask_BS", "topk_ids_BTK", "expert_ids_BSLK", "lengths_B"):
    np.testing.assert_array_equal(getattr(split, f), getattr(one, f), err_msg=f)
  for f in ("logq_BT", "topk_logq_BTK", "head_mass_BT"):
    np.testing.assert_allclose(getattr(split, f), getattr(one, f), rtol=0, atol=LOGQ_ATOL, err_msg=f)
  with pytest.raises(ConfigError, match="sampler.max_rows_in_flight"):
    gen.generate(graphdef, state, toks, valid, jax.random.key(4), dataclasses.replace(base, max_rows_in_flight=3))
