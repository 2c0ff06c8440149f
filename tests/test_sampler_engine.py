"""The continuous-batching engine (`sampler.engine='continuous'`) against the static one: the same rollout."""
import collections
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from rl_jax.config_utils import ConfigError
from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.quant.config import KVSpec, QuantConfig
from rl_jax.rollout import repeat_prompts
from rl_jax.sampler import continuous
from rl_jax.sampler import generate as gen
from rl_jax.sampler.config import SamplerConfig

V, P, T = 64, 8, 10
# Every recorded field of a Rollout: the trainer reads these, so the engines must agree on all.
FIELDS = ("tokens_BS", "positions_BS", "prompt_mask_BS", "response_mask_BS", "logq_BT", "topk_ids_BTK",
          "topk_logq_BTK", "head_mass_BT", "expert_ids_BSLK", "expert_valid_BS", "lengths_B",
          "prompt_lengths_B", "trunc_thresh_BT", "trunc_logmass_BT", "trunc_size_BT")
EXACT = ("tokens_BS", "positions_BS", "prompt_mask_BS", "response_mask_BS", "topk_ids_BTK", "expert_ids_BSLK",
         "expert_valid_BS", "lengths_B", "prompt_lengths_B", "trunc_size_BT")
# Outside the invariant mode a row's log-probs move by ~1 ulp with the rows decoding beside it
# (XLA:CPU blocks a dot's reduction by its row count; see test_sampler's waves test).
LOGQ_ATOL = 2e-5


def _model(moe: bool, invariant: bool) -> Transformer:
  cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                    n_experts=4 if moe else 0, n_experts_per_tok=2, moe_d_ff=32, init_std=0.2,
                    tie_embeddings=False, batch_invariant=invariant)
  return Transformer(cfg, rngs=nnx.Rngs(0))


def _prompts(lengths, seed):
  """Right-padded prompts of ragged lengths, ids in [2, V), each `repeat_prompts`-ed twice (groups)."""
  rng = np.random.default_rng(seed)
  toks = np.zeros((len(lengths), P), np.int32)
  valid = np.zeros((len(lengths), P), bool)
  for i, n in enumerate(lengths):
    toks[i, :n] = rng.integers(2, V, n)
    valid[i, :n] = True
  return repeat_prompts((toks, valid), 2)


def _frequent_token(graphdef, state, toks, valid, key, cfg) -> int:
  """The response token sampled most often when no EOS can occur: as EOS it ends rows early and
  at different steps, so slots free up and refill at different times."""
  ro = gen.generate(graphdef, state, toks, valid, key, dataclasses.replace(cfg, eos_id=0, pad_id=0))
  counts = collections.Counter(np.asarray(ro.response_BT).ravel().tolist())
  return max((c, tok) for tok, c in counts.items() if tok >= 2)[1]


def _compare(static, cont, exact: bool):
  for f in FIELDS:
    a, b = getattr(static, f), getattr(cont, f)
    assert (a is None) == (b is None), f
    if a is None:
      continue
    if exact or f in EXACT:
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f)
    else:
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=LOGQ_ATOL, err_msg=f)


@pytest.mark.parametrize("moe", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dense", "moe"])
def test_continuous_equals_static_bitwise_in_the_invariant_mode(moe):
  """model.batch_invariant: the continuous rollout is the static one bit for bit, with fewer slots
  than rows (refills), chunked refill prefill, ragged prompts, group sampling and top-k sampling
  (every record, kept sets included): a row's arithmetic and key do not depend on its slot. Both
  engines in decode phases: the continuous engine's phase follows its furthest slot (up when a row
  crosses a bound, down when fresh rows take the slots); the invariant attention adds the masked
  slots a longer cache holds as exact zeros, so the cache length a step reads changes no bit."""
  graphdef, state = nnx.split(_model(moe, invariant=True))
  toks, valid = _prompts([3, 7, 5, 1, 6, 2], seed=7)
  key = jax.random.key(4)
  t = 24  # three phases: cache slots 16, 24 and 32
  base = SamplerConfig(max_prompt_len=P, max_new_tokens=t, temperature=1.5, top_k=24, record_topk=8,
                       decode_phases=3, min_phase_steps=1)
  assert continuous.phase_slots(base) == (16, 24, 32)
  base = dataclasses.replace(base, eos_id=_frequent_token(graphdef, state, toks, valid, key, base))
  # Per-row length limits too (`max_new_B`: what the engine benchmark forces lengths with).
  max_new_B = np.array([t, 3, t, t, 5, t, 1, t, t, 7, t, t], np.int32)
  static = gen.generate(graphdef, state, toks, valid, key, base, max_new_B=max_new_B)
  lengths = np.asarray(static.lengths_B)
  assert lengths.min() < t and len(set(lengths.tolist())) >= 3, lengths  # rows end at different steps
  assert (lengths > 17).sum() >= 2, lengths  # rows reach the last phase (step 17 writes slot 24)
  assert (lengths <= max_new_B).all() and lengths[6] == 1, lengths
  cont = gen.generate(graphdef, state, toks, valid, key,
                      dataclasses.replace(base, engine="continuous", slots=4, prefill_chunk=3), max_new_B=max_new_B)
  _compare(static, cont, exact=True)


@pytest.mark.parametrize("kv", [None, pytest.param("int8", marks=pytest.mark.slow),
                                pytest.param("int4", marks=pytest.mark.slow)], ids=["fp32", "int8", "int4"])
def test_continuous_equals_static_to_rounding(kv):
  """Outside the invariant mode: same tokens, top-k ids and lengths; log-probs to float rounding. A
  quantized KV cache too: the continuous engine writes one row's codes and scales at its own slot. Two
  decode phases (cache slots 16, then 18): a phase's prefix of codes and scales goes back whole."""
  graphdef, state = nnx.split(_model(False, invariant=False))
  toks, valid = _prompts([3, 7, 5, 1, 6, 2], seed=8)
  key = jax.random.key(5)
  quant = QuantConfig() if kv is None else QuantConfig(kv=KVSpec(kv))
  base = SamplerConfig(max_prompt_len=P, max_new_tokens=T, temperature=1.5, record_topk=8, quant=quant,
                       decode_phases=2, min_phase_steps=1)
  base = dataclasses.replace(base, eos_id=_frequent_token(graphdef, state, toks, valid, key, base))
  static = gen.generate(graphdef, state, toks, valid, key, base)
  assert np.asarray(static.lengths_B).min() < T
  cont = gen.generate(graphdef, state, toks, valid, key,
                      dataclasses.replace(base, engine="continuous", slots=2, prefill_chunk=1))
  _compare(static, cont, exact=False)


def test_engine_config_errors():
  with pytest.raises(ConfigError, match="sampler.engine"):
    SamplerConfig(engine="paged")
  with pytest.raises(ConfigError, match="sampler.prefill_chunk"):
    SamplerConfig(prefill_chunk=0)
  with pytest.raises(ConfigError, match="sampler.slots"):
    SamplerConfig(slots=-1)


def _batch_mesh():
  from rl_jax.sharding import MeshConfig, make_mesh  # pylint: disable=g-import-not-at-top
  return make_mesh(MeshConfig(data=2, fsdp=1, expert=2, tensor=2))  # 4 batch-axis devices, heads 2-way


@pytest.mark.slow  # 5 s on 2 loaded cores: compiling the program for 8 devices
def test_continuous_refill_prefill_gathers_no_cache():
  """On a batch-sharded mesh each device prefills its own slots (`continuous._group_slot_cache`):
  the compiled program moves no slot's KV cache between devices. Pins the fix of a refill that
  sliced one global slot at a traced index of the sharded slot axis, which XLA served by gathering
  every slot's cache onto every device (the 30B `:n4_32k` plan's generate at 260 GiB per device)."""
  import re  # pylint: disable=g-import-not-at-top
  from rl_jax.sharding import shard_batch, shard_state  # pylint: disable=g-import-not-at-top
  model = _model(False, invariant=False)
  graphdef, state = nnx.split(model)
  mesh = _batch_mesh()
  slots, t = 8, 40
  # Three decode phases: the phases' cache prefixes (sliced, written back) stay on their devices too.
  cfg = SamplerConfig(max_prompt_len=P, max_new_tokens=t, record_topk=8, engine="continuous", slots=slots,
                      prefill_chunk=3, decode_phases=3, min_phase_steps=1)
  toks, valid = shard_batch((np.ones((16, P), np.int32), np.ones((16, P), bool)), mesh)
  hlo = gen.lower_generate(graphdef, shard_state(state, mesh), toks, valid, jax.random.key(0), cfg,
                           mesh=mesh).compile().as_text()
  # One layer's cache of every slot for one device's kv heads: [slots, G / tensor, C, head dim].
  m = model.cfg
  cache_elems = slots * m.n_kv_heads // mesh.shape["tensor"] * (P + t) * m.head_dim
  moved = []
  for dims in re.findall(r"= [a-z0-9]+\[([0-9,]*)\]\S* (?:all-gather|all-to-all|collective-permute|all-reduce)\(",
                         hlo):
    moved.append(int(np.prod([int(d) for d in dims.split(",") if d])))
  assert moved and max(moved) < cache_elems, (max(moved), cache_elems)


@pytest.mark.slow
def test_continuous_on_a_batch_mesh_equals_static_bitwise():
  """With the slots split over 4 batch-axis devices (2 per device, a refill prefill chunk of one
  slot per device at a time), the continuous rollout is still the static one bit for bit
  (model.batch_invariant), the static engine run on the same mesh."""
  from rl_jax.sharding import shard_state  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(_model(False, invariant=True))
  mesh = _batch_mesh()
  state = shard_state(state, mesh)
  toks, valid = _prompts([3, 7, 5, 1, 6, 2, 4, 8], seed=9)
  key = jax.random.key(6)
  base = SamplerConfig(max_prompt_len=P, max_new_tokens=T, temperature=1.5, top_k=24, record_topk=8,
                       decode_phases=2, min_phase_steps=1)  # cache slots 16, then 18
  base = dataclasses.replace(base, eos_id=_frequent_token(graphdef, state, toks, valid, key, base))
  static = gen.generate(graphdef, state, toks, valid, key, base, mesh=mesh)
  assert len(set(np.asarray(static.lengths_B).tolist())) >= 3  # rows end at different steps
  cont = gen.generate(graphdef, state, toks, valid, key,
                      dataclasses.replace(base, engine="continuous", slots=8, prefill_chunk=3), mesh=mesh)
  _compare(static, cont, exact=True)


@pytest.mark.parametrize("kv,scan", [(None, False), ("int8", True), ("fp4", False)])
def test_cache_prefix_put_back_and_grow(kv, scan):
  """The decode phases' cache moves (`kv_cache.cache_prefix` / `put_cache_prefix` / `grow_cache`),
  along each array's own slot axis (transposed unquantized keys, packed codes, scales; unrolled and
  layer-stacked): a prefix put back gives the cache bit for bit, with slots past it untouched; a
  grown prefix has fresh slots as `init_cache` makes them (zero codes, unit scales)."""
  from rl_jax.models.kv_cache import cache_len, cache_prefix, grow_cache, init_cache, put_cache_prefix  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(_model(False, invariant=False).cfg, n_layers=2, scan_layers=scan)
  spec = None if kv is None else KVSpec(kv, block_size=8) if kv == "fp4" else KVSpec(kv)
  fresh = init_cache(cfg, 3, 24, jax.numpy.float32, spec)
  leaves, treedef = jax.tree.flatten(fresh)
  rng = np.random.default_rng(0)
  cache = jax.tree.unflatten(treedef, [jax.numpy.asarray(rng.integers(1, 100, x.shape)).astype(x.dtype)
                                       for x in leaves])
  part = cache_prefix(cache, 16)
  assert cache_len(part) == 16
  edit = jax.tree.map(lambda x: x + jax.numpy.ones((), x.dtype), part)  # a phase's writes
  back = put_cache_prefix(cache, edit)
  for b_kv, c_kv, e_kv, f_kv in zip(back, cache, edit, grow_cache(edit, 24)):
    for name in ("k", "v", "k_scale", "v_scale"):
      b_, c_, e_, f_ = (getattr(x, name) for x in (b_kv, c_kv, e_kv, f_kv))
      if c_ is None:
        continue
      ax = -1 if name == "k" and kv is None else -2
      np.testing.assert_array_equal(np.asarray(jax.lax.slice_in_dim(b_, 0, 16, axis=b_.ndim + ax)), np.asarray(e_))
      np.testing.assert_array_equal(np.asarray(jax.lax.slice_in_dim(b_, 16, 24, axis=b_.ndim + ax)),
                                    np.asarray(jax.lax.slice_in_dim(c_, 16, 24, axis=c_.ndim + ax)), err_msg=name)
      tail = np.asarray(jax.lax.slice_in_dim(f_, 16, 24, axis=f_.ndim + ax))
      assert (tail == (1 if name.endswith("scale") else 0)).all(), name
  np.testing.assert_array_equal(np.asarray(jax.tree.leaves(put_cache_prefix(cache, part))[0]),
                                np.asarray(jax.tree.leaves(cache)[0]))
