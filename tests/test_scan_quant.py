"""Quantized sampler weights of a scanned model (stacked [L, ...] weights) == the unrolled model's, per layer."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.config_utils import ConfigError
from rl_jax.models import ModelConfig, Transformer
from rl_jax.models.quantize import quantize_params
from rl_jax.models.transformer import stack_layers
from rl_jax.ops import quantized as ops
from rl_jax.quant import ActivationSpec, KVSpec, QTensor, QuantConfig, WeightSpec

# Every contraction dim (d_model 32, heads 4 x 8, d_ff 64, moe_d_ff 32) divides the blocks below.
_BASE = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
             n_experts_per_tok=2, moe_d_ff=32, init_std=0.2, tie_embeddings=False)
DENSE = ModelConfig(n_layers=3, **_BASE)
# Runs of 1 MoE, 2 dense, 2 MoE layers: stacked dense [L, D, F] and expert [L, E, D, F] weights.
RUNS = ModelConfig(n_layers=5, n_experts=8, mlp_only_layers=(1, 2), **_BASE)
# The sampler's (cheaper to compile) MoE case: a dense layer, then a run of 2 MoE layers.
MOE = ModelConfig(n_layers=3, n_experts=8, mlp_only_layers=(0,), **_BASE)

# Every weight format and granularity: per-channel int8 / fp8 W+A, K-blocks (fp32 / bf16 /
# e8m0 scales), packed 4-bit int4 / fp4, and the lm head.
QCFGS = {
    "int8_wa_channel": QuantConfig(weights=WeightSpec("int8"), activations=ActivationSpec("int8"),
                                   quantize_lm_head=True),
    "fp8_wa_block": QuantConfig(weights=WeightSpec("fp8", "block", 16),
                                activations=ActivationSpec("fp8", "block", 16)),
    "fp8_e5m2_block_bf16": QuantConfig(weights=WeightSpec("fp8_e5m2", "block", 8, "bf16")),
    "int4_block_packed": QuantConfig(weights=WeightSpec("int4", "block", 16)),
    "int4_channel_packed": QuantConfig(weights=WeightSpec("int4")),
    "fp4_e8m0_packed": QuantConfig(weights=WeightSpec("fp4", block_size=16), quantize_lm_head=True),
}

pytestmark = pytest.mark.usefixtures("fast_compile")


def _params(cfg, scan):
  model = Transformer(dataclasses.replace(cfg, scan_layers=scan), rngs=nnx.Rngs(0))
  return nnx.to_pure_dict(nnx.state(model))


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _assert_bit_equal(a, b):
  is_q = lambda x: isinstance(x, QTensor)
  assert jax.tree.structure(a, is_leaf=is_q) == jax.tree.structure(b, is_leaf=is_q)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(_bits(x), _bits(y))


# Every format on the XLA path; on Pallas (interpret mode is slow on CPU) three formats that cover its
# block scales, packed 4-bit codes and e8m0 scales.
_BACKEND_CASES = [(n, "xla") for n in QCFGS] + [
    (n, "pallas") for n in ("fp8_wa_block", "int4_block_packed", "fp4_e8m0_packed")]


@pytest.mark.parametrize("name,backend", _BACKEND_CASES)
def test_stacked_quantization_equals_per_layer_bit_for_bit(name, backend):
  """Quantizing the stack == stacking the per-layer QTensors (codes, scales and static metadata)."""
  qcfg = dataclasses.replace(QCFGS[name], backend=backend)
  quant = jax.jit(quantize_params, static_argnums=1)
  scanned = quant(_params(RUNS, True), qcfg)
  # Stacking and dequantizing jitted too: eagerly every op compiles its own XLA program.
  per_layer = jax.jit(stack_layers, static_argnums=1)(quant(_params(RUNS, False), qcfg), RUNS)
  _assert_bit_equal(scanned, per_layer)
  groups = scanned["layer_groups"]
  moe_w, dense_w = groups[2]["ffn"]["w_gate"], groups[1]["ffn"]["w_gate"]
  assert isinstance(moe_w, QTensor) and moe_w.shape == (2, 8, 32, 32)      # [L, E, D, F]
  assert isinstance(dense_w, QTensor) and dense_w.shape == (2, 32, 64)     # [L, D, F]
  # The logical shape follows the children: the scan's per-layer slice is a 2-D / 3-D QTensor.
  layer = jax.tree.map(lambda x: x[1], dense_w)
  assert layer.shape == (32, 64) and layer.k == 32
  dequantize = jax.jit(ops.dequantize_weight)
  np.testing.assert_array_equal(np.asarray(dequantize(dense_w))[1], np.asarray(dequantize(layer)))


def test_stacked_shape_errors_name_the_parameter():
  qcfg = QuantConfig(weights=WeightSpec("int8"))
  bad = {"layer_groups": {0: {"attn": {"wq": jnp.zeros((32, 64))}}}}  # stack axis missing
  with pytest.raises(ConfigError, match=r"'layer_groups/0/attn/wq'.*\[layers, in, out\]"):
    jax.eval_shape(lambda t: quantize_params(t, qcfg), bad)
  odd = {"layer_groups": {0: {"attn": {"wq": jnp.zeros((2, 33, 64))}}}}
  with pytest.raises(ConfigError, match=r"layer_groups/0/attn/wq.*contraction dim 33.*block_size=16"):
    jax.eval_shape(lambda t: quantize_params(t, QCFGS["int4_block_packed"]), odd)


def _generate(cfg, scan, quant, dtype="float32"):
  from rl_jax.sampler import generate as gen  # pylint: disable=g-import-not-at-top
  from rl_jax.sampler import weights as W  # pylint: disable=g-import-not-at-top
  from rl_jax.sampler.config import SamplerConfig  # pylint: disable=g-import-not-at-top
  mcfg = dataclasses.replace(cfg, scan_layers=scan)
  model = Transformer(mcfg, rngs=nnx.Rngs(0))
  scfg = SamplerConfig(max_prompt_len=6, max_new_tokens=6, temperature=0.8, record_topk=5, eos_id=1,
                       quant=quant, dtype=dtype)
  rng = np.random.default_rng(0)
  toks = rng.integers(2, 64, (4, 6)).astype(np.int32)
  valid = np.arange(6)[None, :] < np.array([3, 6, 1, 4])[:, None]
  sstate = W.sync_weights(nnx.state(model), None, scfg.quant, scfg.dtype)
  return gen.generate(W.sampler_graphdef(mcfg, dtype), sstate, toks, valid, jax.random.key(3), scfg)


# (config, quantization, backend). The Pallas kernels run in interpret mode on CPU.
FP8_WA_KV = QuantConfig(weights=WeightSpec("fp8"), activations=ActivationSpec("fp8"), kv=KVSpec("fp8"))
SAMPLER_CASES = [
    (DENSE, FP8_WA_KV, "xla"),
    (MOE, QCFGS["int4_block_packed"], "xla"),
    pytest.param(MOE, FP8_WA_KV, "xla", marks=pytest.mark.slow),
    pytest.param(MOE, FP8_WA_KV, "pallas", marks=pytest.mark.slow),  # interpret mode: ~35 s
]


# Bit for bit: each scanned layer runs the unrolled layer's ops on the same codes and scales (XLA:CPU,
# the suite's `fast_compile` setting; a backend fusing the scan body differently may round differently).
@pytest.mark.parametrize("cfg,quant,backend", SAMPLER_CASES,
                         ids=["dense-fp8_wa_fp8_kv", "moe-int4_block", "moe-fp8_wa_fp8_kv", "moe-fp8_wa_kv-pallas"])
def test_quantized_sampler_scanned_equals_unrolled(cfg, quant, backend):
  quant = dataclasses.replace(quant, backend=backend)
  a = _generate(cfg, False, quant)
  b = _generate(cfg, True, quant)
  np.testing.assert_array_equal(b.tokens_BS, a.tokens_BS)
  np.testing.assert_array_equal(b.topk_ids_BTK, a.topk_ids_BTK)
  np.testing.assert_array_equal(b.logq_BT, a.logq_BT)
  np.testing.assert_array_equal(b.topk_logq_BTK, a.topk_logq_BTK)
  if cfg.n_moe_layers:
    np.testing.assert_array_equal(b.expert_ids_BSLK, a.expert_ids_BSLK)
    assert b.expert_ids_BSLK.shape[2] == cfg.n_moe_layers
  if cfg is DENSE:  # quantization really ran: the fp32 sampler's log q differs
    ref = _generate(cfg, True, QuantConfig())
    assert np.abs(np.asarray(ref.logq_BT) - np.asarray(b.logq_BT)).max() > 1e-4
