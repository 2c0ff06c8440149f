"""Quantized samplers: every regime runs, and D_KL(q || p) grows as the formats get coarser."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax import rollout as rollout_lib
from rl_jax.quant.config import KVSpec, QuantConfig, WeightSpec
from rl_jax.sampler import generate as gen
from rl_jax.sampler import weights as W
from rl_jax.sampler.config import SamplerConfig

V = 128
# Layer 0 dense, layer 1 MoE: both quantized matmul paths (dense `qmatmul`, expert
# `ragged_qmatmul`) in one model. Every contraction dim is 128 and head_dim 32, so the
# presets' block sizes (int4_w: 128 along K; fp4: 32) divide them.
MCFG = ModelConfig(vocab_size=V, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=128,
                   n_experts=4, n_experts_per_tok=2, moe_d_ff=128, mlp_only_layers=(0,), init_std=0.1,
                   tie_embeddings=False)
B, P, T = 8, 4, 8


@pytest.fixture(scope="module")
def setup():
  model = Transformer(MCFG, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  prompts = rng.integers(2, V, (B, P)).astype(np.int32)
  return graphdef, state, prompts, np.ones((B, P), bool)


@functools.partial(jax.jit, static_argnums=0)
def _kl_to_trainer(graphdef, state, r):
  """Mean over response tokens of the exact D_KL(q || p) = sum_v q_v (log q_v - log p_v).

  q is the sampler's recorded full distribution (record_topk = V), p the fp32 trainer
  teacher-forced on the same tokens, both at temperature 1.
  """
  model = nnx.merge(graphdef, state)
  logits_BSV = model(r.tokens_BS, r.positions_BS, r.valid_BS).logits_BSV
  logp_BTV = rollout_lib.response_slice(jax.nn.log_softmax(logits_BSV), r)
  logp_at = jnp.take_along_axis(logp_BTV, r.topk_ids_BTK, axis=-1)
  kl_BT = jnp.sum(jnp.exp(r.topk_logq_BTK) * (r.topk_logq_BTK - logp_at), axis=-1)
  mask = r.response_mask_BT
  return jnp.sum(jnp.where(mask, kl_BT, 0.0)) / jnp.sum(mask)


def _measure(setup, quant, dtype="float32"):
  graphdef, state, prompts, valid = setup
  cfg = SamplerConfig(max_prompt_len=P, max_new_tokens=T, record_topk=V, eos_id=1, quant=quant, dtype=dtype)
  sstate = W.sync_weights(state, None, cfg.quant, cfg.dtype)
  r = gen.generate(W.sampler_graphdef(MCFG, dtype), sstate, prompts, valid, jax.random.key(0), cfg)
  assert np.isfinite(np.asarray(r.logq_BT)).all() and np.isfinite(np.asarray(r.topk_logq_BTK)).all()
  return float(_kl_to_trainer(graphdef, state, r))


def test_kl_grows_with_coarser_formats(setup):
  """fp32 < int8 < int4 weights; fp8 < fp4 KV cache, each step by a factor >= 5."""
  kl = {name: _measure(setup, q) for name, q in [
      ("fp32", QuantConfig()),
      ("int8_w", QuantConfig(weights=WeightSpec("int8"))),
      ("int4_w", QuantConfig(weights=WeightSpec("int4"))),
      ("fp8_kv", QuantConfig(kv=KVSpec("fp8"))),
      ("fp4_kv", QuantConfig(kv=KVSpec("fp4"))),
  ]}
  print("D_KL(q || p):", {k: f"{v:.3g}" for k, v in kl.items()})
  # Observed (CPU, this seed): fp32 -3.6e-8, int8_w 5.4e-4, int4_w 0.099, fp8_kv 2.5e-3, fp4_kv 0.033.
  assert abs(kl["fp32"]) < 1e-6
  assert kl["int8_w"] > 1e-5 and kl["fp8_kv"] > 1e-5  # far above the fp32 float noise
  assert kl["int4_w"] > 5 * kl["int8_w"]
  assert kl["fp4_kv"] > 5 * kl["fp8_kv"]


@pytest.mark.slow
def test_every_quantization_preset_runs(setup):
  """Each [SC] regime (and a bf16 sampler) samples finite logprobs with a small, positive KL."""
  kl = {name: _measure(setup, name) for name in QuantConfig.PRESETS}
  kl["bf16_sampler"] = _measure(setup, "none", dtype="bfloat16")
  print("D_KL(q || p):", {k: f"{v:.3g}" for k, v in kl.items()})
  assert abs(kl["none"]) < 1e-6
  for name, value in kl.items():
    if name != "none":
      assert 1e-7 < value < 1.0, (name, value)
  assert kl["int8_wa_int8_kv"] < kl["int8_wa_int4_kv"]
  assert kl["fp8_wa_fp8_kv"] < kl["fp8_wa_fp4_kv"]
