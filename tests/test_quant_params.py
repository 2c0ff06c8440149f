"""QuantConfig checks; quantize_params on dicts / nnx.State (by parameter tags); QTensor via jit, sharding, orbax."""
import dataclasses
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_jax.config_utils import ConfigError, from_dict
from rl_jax.models import quantize as quant_params
from rl_jax.models.quantize import plan_of, quantize_params
from rl_jax.ops import quantized as ops
from rl_jax.ops.linear import linear as ops_linear, ragged_linear
from rl_jax.quant import ActivationSpec, KVSpec, QTensor, QuantConfig, WeightSpec

# --------------------------------------------------------------------------- config


def test_from_dict_builds_nested_sections_with_role_defaults():
  cfg = from_dict(QuantConfig, {"weights": {"format": "fp4"}, "activations": {"format": "fp8"},
                                "kv": {"format": "int8"}, "backend": "xla"},
                  prefix="sampler.quant")
  assert cfg.weights == WeightSpec("fp4", "block", 32, "e8m0")  # MXFP4
  assert cfg.activations == ActivationSpec("fp8", "token", 128, "fp32")
  assert cfg.kv == KVSpec("int8", "token", 128, "bf16")
  assert QuantConfig() == from_dict(QuantConfig, {}) and not QuantConfig().weights.quantized
  assert hash(cfg) == hash(from_dict(QuantConfig, {"weights": {"format": "fp4"},
                                                   "activations": {"format": "fp8"},
                                                   "kv": {"format": "int8"}, "backend": "xla"}))


@pytest.mark.parametrize("name", QuantConfig.PRESETS)
def test_presets(name):
  cfg = QuantConfig.preset(name)
  expected = {"fp8_wa_fp4_kv": ("fp8", "fp8", "fp4"), "int8_wa_int4_kv": ("int8", "int8", "int4"),
              "fp8_wa_fp8_kv": ("fp8", "fp8", "fp8"), "int8_wa_int8_kv": ("int8", "int8", "int8"),
              "int4_w": ("int4", "fp32", "fp32"), "fp4_w": ("fp4", "fp32", "fp32"),
              "none": ("fp32", "fp32", "fp32"), "bf16": ("bf16", "fp32", "bf16")}[name]
  assert (cfg.weights.format, cfg.activations.format, cfg.kv.format) == expected


@pytest.mark.parametrize("section,match", [
    ({"weights": {"format": "int3"}}, r"sampler\.quant\.weights\.format"),
    ({"weights": {"fromat": "int8"}}, r"sampler\.quant\.weights\.fromat"),
    ({"bogus": 1}, r"sampler\.quant\.bogus"),
    ({"backend": "cuda"}, r"sampler\.quant\.backend"),
    ({"weights": {"format": "int8", "granularity": "token"}},
     r"sampler\.quant\.weights.*granularity"),
    ({"kv": {"format": "int8", "granularity": "channel"}}, r"sampler\.quant\.kv.*granularity"),
    ({"weights": {"format": "fp4", "block_size": 15}}, r"sampler\.quant\.weights.*block_size"),
    ({"weights": {"format": "int8", "block_size": 0}}, r"block_size"),
    ({"kv": {"format": "int8", "scale_dtype": "fp16"}}, r"sampler\.quant\.kv\.scale_dtype"),
    ({"activations": {"format": "int8"}}, r"activations\.format.*quantized weights"),
])
def test_invalid_configs_name_the_key(section, match):
  with pytest.raises(ConfigError, match=match):
    from_dict(QuantConfig, section, prefix="sampler.quant")


def test_unknown_preset():
  with pytest.raises(ConfigError, match="preset"):
    QuantConfig.preset("int2_everything")


# --------------------------------------------------------------------------- params

D, F_, E, V = 16, 24, 4, 32


def _tree(dtype=jnp.float32):
  rng = np.random.default_rng(0)  # numpy: eager jax.random would compile per shape
  n = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return {"embedding": n(V, D), "final_norm": {"scale": jnp.ones((D,), dtype)},
          "w_unembed": n(D, V),
          "layers": [{"attn": {"wq": n(D, 2 * D), "wk": n(D, D), "wv": n(D, D), "wo": n(2 * D, D),
                               "q_norm": {"scale": jnp.ones((8,), dtype)}},
                      "moe": {"w_router": n(D, E), "w_gate": n(E, D, F_), "w_up": n(E, D, F_),
                              "w_down": n(E, F_, D)}}]}


_quantize_jit = jax.jit(quantize_params, static_argnums=1)


def test_quantize_params_replaces_only_linear_weights():
  """Linear weights become QTensors (per expert + channel scales for 3-D); the rest is untouched."""
  tree = jax.eval_shape(_tree)
  cfg = QuantConfig.preset("int8_wa_int4_kv")
  q = jax.eval_shape(lambda t: quantize_params(t, cfg), tree)
  layer = q["layers"][0]
  for name in ("wq", "wk", "wv", "wo"):
    qt = layer["attn"][name]
    assert isinstance(qt, QTensor) and qt.shape == tree["layers"][0]["attn"][name].shape
    assert qt.values.dtype == jnp.int8 and qt.scales.shape == (1, qt.shape[1])
    assert qt.act_format == "int8" and qt.dtype == jnp.float32
  gate = layer["moe"]["w_gate"]
  assert gate.values.shape == (E, D, F_) and gate.scales.shape == (E, 1, F_)
  for path in (("embedding",), ("w_unembed",), ("final_norm", "scale"),
               ("layers", 0, "moe", "w_router"), ("layers", 0, "attn", "q_norm", "scale")):
    a, b = tree, q
    for p in path:
      a, b = a[p], b[p]
    assert not isinstance(b, QTensor) and (a.shape, a.dtype) == (b.shape, b.dtype)
  # With values: dequantized expert weights are within int8's bound scale / 2 per element.
  w = _tree()["layers"][0]["moe"]["w_down"]
  deq = jax.jit(lambda t: ops.dequantize_weight(quantize_params(t, cfg)["w_down"]))({"w_down": w})
  amax = np.max(np.abs(np.asarray(w)), axis=1, keepdims=True)
  assert np.all(np.abs(np.asarray(deq) - np.asarray(w)) <= amax / 127 * (0.5 + 1e-5))


_LINEAR = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _flat(tree):
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QTensor))[0]
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path if getattr(k, "name", None) != "value"): v
          for path, v in leaves}


@pytest.mark.parametrize("family", ["qwen3", "llama3", "qwen2_moe"])
def test_every_family_quantizes_its_linear_weights_only(family):
  """On each family's real parameter tree (abstract): the projections, routed experts and the shared
  expert's MLP become QTensors; q/k/v biases, the shared-expert gate, router, norms and embedding do not.
  The same leaves by the tags on the model's nnx.State, by its plan on the pure dict, and by name on
  a pure dict without a plan (names derived from the tags); the lm head only with quantize_lm_head."""
  from rl_jax.models import families  # pylint: disable=g-import-not-at-top
  from rl_jax.models.config import ModelConfig  # pylint: disable=g-import-not-at-top
  switches = {"qwen3": dict(family="qwen3", n_experts=4, moe_d_ff=16, mlp_only_layers=(0,)),
              "llama3": dict(family="llama3", qk_norm=False),
              "qwen2_moe": dict(family="qwen2_moe", qk_norm=False, qkv_bias=True, shared_expert_d_ff=24,
                                n_experts=4, moe_d_ff=16)}[family]
  cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                    tie_embeddings=False, **switches)
  state = nnx.state(families.abstract_model(cfg))
  tree, plan = nnx.to_pure_dict(state), plan_of(state)
  qcfg = QuantConfig.preset("int8_wa_int4_kv")
  linear = {k for k in _flat(tree) if k.rsplit("/", 1)[-1] in _LINEAR}
  assert linear and plan.paths("quantize") == linear and plan.paths("lm_head") == {"w_unembed"}
  for how, src, p in (("tags", state, None), ("plan", tree, plan), ("names", tree, None)):
    flat = _flat(jax.eval_shape(lambda t: quantize_params(t, qcfg, p), src))  # pylint: disable=cell-var-from-loop
    quantized = {k for k, v in flat.items() if isinstance(v, QTensor)}
    assert quantized == linear, how
    with_head = dataclasses.replace(qcfg, quantize_lm_head=True)
    head = _flat(jax.eval_shape(lambda t: quantize_params(t, with_head, p), src))  # pylint: disable=cell-var-from-loop
    assert {k for k, v in head.items() if isinstance(v, QTensor)} == linear | {"w_unembed"}, how
  if family == "qwen2_moe":
    assert {"layers/0/shared_ffn/w_gate", "layers/0/ffn/w_gate"} <= quantized
  for k in {"qwen3": ("layers/1/ffn/w_router", "layers/0/attn/q_norm/scale", "embedding"),
            "llama3": ("embedding", "final_norm/scale"),
            "qwen2_moe": ("layers/0/attn/bq", "layers/0/w_shared_gate", "layers/0/ffn/w_router")}[family]:
    assert k in flat and k not in quantized, k


def test_a_new_tagged_linear_weight_is_quantized_without_a_name_list(monkeypatch, request):
  """A family's new linear weight needs only its tag: an MLP with an extra `quantize=True` weight
  under a name nothing lists is quantized in every layer of the real model through its plan (and its
  nnx.State); the same weight untagged stays plain."""
  from rl_jax.models import families, layers, transformer  # pylint: disable=g-import-not-at-top
  from rl_jax.models.config import ModelConfig  # pylint: disable=g-import-not-at-top

  def mlp_with(tags):
    class ExtraMLP(layers.MLP):
      def __init__(self, cfg, *, rngs, d_ff=None):
        super().__init__(cfg, rngs=rngs, d_ff=d_ff)
        self.w_novel = layers.param(rngs, (cfg.d_model, 16), ("embed", "mlp"), cfg, **tags)
    return ExtraMLP

  cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
  qcfg = QuantConfig.preset("int8_wa_int4_kv")
  request.addfinalizer(families.clear_abstract_models)   # no later test may get the patched model
  for tags, expect in (({"quantize": True}, True), ({}, False)):
    monkeypatch.setattr(transformer, "MLP", mlp_with(tags))
    families.clear_abstract_models()   # the cache is keyed by the config, which the patch leaves alone
    state = nnx.state(families.abstract_model(cfg))
    plan = plan_of(state)
    assert ("layers/1/ffn/w_novel" in plan.paths("quantize")) == expect
    for src, p in ((nnx.to_pure_dict(state), plan), (state, None)):
      flat = _flat(jax.eval_shape(lambda t: quantize_params(t, qcfg, p), src))  # pylint: disable=cell-var-from-loop
      assert all(isinstance(flat[f"layers/{i}/ffn/w_novel"], QTensor) == expect for i in range(2)), tags
      assert isinstance(flat["layers/0/ffn/w_up"], QTensor)


def test_plan_errors_and_jit_with_a_static_plan():
  """A plan of another layout names the missing parameters; a pure tree has no tags to plan from;
  the plan is hashable, so `quantize_params` jits with it static."""
  from rl_jax.models import families  # pylint: disable=g-import-not-at-top
  from rl_jax.models.config import ModelConfig  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
  unrolled = nnx.state(families.abstract_model(cfg))
  scanned = plan_of(nnx.state(families.abstract_model(dataclasses.replace(cfg, scan_layers=True))))
  assert {s for _, _, s in scanned.entries} == {1}  # the layer axis, read off the `axes` tag
  qcfg = QuantConfig.preset("int8_wa_int4_kv")
  with pytest.raises(ValueError, match=r"does not have.*layer_groups/0/"):
    jax.eval_shape(lambda t: quantize_params(t, qcfg, scanned), nnx.to_pure_dict(unrolled))
  with pytest.raises(ValueError, match="no parameter tags"):
    plan_of(nnx.to_pure_dict(unrolled))
  plan = plan_of(unrolled)
  assert plan == plan_of(unrolled) and hash(plan) == hash(plan_of(unrolled))
  lowered = jax.jit(quantize_params, static_argnums=(1, 2)).lower(nnx.to_pure_dict(unrolled), qcfg, plan)
  assert "i8" in lowered.as_text()


def test_a_name_tagged_in_one_place_only_needs_a_plan(monkeypatch):
  monkeypatch.setattr(quant_params, "tagged_names", lambda: {"w": quant_params._AMBIGUOUS})  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"'blk/w'.*plan=plan_of"):
    jax.eval_shape(lambda t: quantize_params(t, QuantConfig.preset("int8_wa_int4_kv")),
                   {"blk": {"w": jax.ShapeDtypeStruct((D, D), jnp.float32)}})


def test_quantize_params_lm_head_plain_formats_and_4bit_packing():
  tree = jax.eval_shape(_tree)
  cfg = QuantConfig(weights=WeightSpec("fp4", block_size=8), quantize_lm_head=True)
  head = jax.eval_shape(lambda t: quantize_params(t, cfg), tree)["w_unembed"]
  assert isinstance(head, QTensor) and head.values.shape == (D // 2, V)  # packed along K
  assert head.scales.shape == (D // 8, V) and head.scales.dtype == jnp.uint8  # e8m0 bytes
  assert head.values.dtype == jnp.uint8 and head.act_format is None
  bf16 = jax.eval_shape(lambda t: quantize_params(t, QuantConfig.preset("bf16")), tree)
  assert bf16["layers"][0]["attn"]["wq"].dtype == jnp.bfloat16
  assert bf16["embedding"].dtype == jnp.float32


def test_quantize_params_errors_name_the_parameter():
  tree = jax.eval_shape(_tree)
  cfg = QuantConfig(weights=WeightSpec("int4", "block", 32))
  with pytest.raises(ConfigError, match=r"layers/0/attn/w[qkv].*block_size=32"):
    jax.eval_shape(lambda t: quantize_params(t, cfg), tree)
  cfg = QuantConfig(weights=WeightSpec("int8"), activations=ActivationSpec("int8", "block", 32))
  with pytest.raises(ConfigError, match=r"layers/0/attn/w[qkv].*activations.block_size"):
    jax.eval_shape(lambda t: quantize_params(t, cfg), tree)


class _Tiny(nnx.Module):
  def __init__(self):
    self.embedding = nnx.Param(jnp.ones((V, D)))
    self.wq = nnx.Param(jnp.asarray(np.random.default_rng(1).standard_normal((D, 8)), jnp.float32), quantize=True)
    self.scale = nnx.Param(jnp.ones((D,)))

  def __call__(self, x):
    return ops_linear(x * self.scale.get_value(), self.wq.get_value())


def test_quantize_params_on_nnx_state():
  """nnx.State paths end in `.value`: the Variable's `quantize` tag decides; merge gives a usable model."""
  model = _Tiny()
  graphdef, state = nnx.split(model)
  qstate = _quantize_jit(state, QuantConfig.preset("fp8_wa_fp8_kv"))
  assert isinstance(qstate, nnx.State)
  assert isinstance(qstate["wq"].get_value(), QTensor)
  assert not isinstance(qstate["embedding"].get_value(), QTensor)
  qmodel = nnx.merge(graphdef, qstate)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, D)).astype(np.float32))

  @jax.jit
  def run(m, x):
    qt = m.wq.get_value()
    return m(x), ops.fake_quantize_activations(x, qt) @ ops.dequantize_weight(qt)

  out, ref = run(qmodel, x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- QTensor


def test_qtensor_through_jit_tree_map_and_sharding():
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.standard_normal((D, 64)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((5, D)), jnp.float32)
  qt = jax.jit(lambda w: ops.quantize_weight(w, WeightSpec("int4", "block", 8), backend="xla"))(w)
  assert jax.tree_util.tree_structure(jax.jit(lambda q: q)(qt)) == jax.tree_util.tree_structure(qt)
  copied = jax.tree_util.tree_map(lambda a: a + 0, qt)
  assert isinstance(copied, QTensor) and copied.shape == (D, 64) and copied.format == "int4"
  assert qt.nbytes == (D // 2) * 64 + (D // 8) * 64 * 4
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  sharded = jax.device_put(qt, NamedSharding(mesh, P(None, "model")))  # N split: every child
  assert sharded.values.sharding.spec == P(None, "model")
  # A K split cannot apply to the packed [K/2, N] values' and [K/8, N] scales' K uniformly:
  # `shardings` keeps it only where it divides.
  tree = qt.shardings(NamedSharding(mesh, P("model", "data")))
  assert tree.values.spec == P("model", "data") and tree.scales.spec == P(None, "data")
  sharded2 = jax.device_put(qt, tree)
  f = jax.jit(lambda x, q: ops.qmatmul(x, q))
  ref = f(x, qt)
  np.testing.assert_allclose(np.asarray(f(x, sharded)), np.asarray(ref), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(f(x, sharded2)), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_orbax_roundtrip(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  tree = jax.jit(lambda: {
      "fp4": ops.quantize_weight(jnp.ones((D, 8)), WeightSpec("fp4", block_size=8), backend="xla"),
      "fp8": ops.quantize_weight(jnp.ones((2, D, 8)), WeightSpec("fp8"), backend="xla")})()
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.fspath(tmp_path / "q"), tree)
  ckpt.wait_until_finished()
  abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
  back = ckpt.restore(os.fspath(tmp_path / "q"), abstract)
  for key in tree:
    assert isinstance(back[key], QTensor) and back[key].format == tree[key].format
    for a, b in zip(jax.tree_util.tree_leaves(back[key]), jax.tree_util.tree_leaves(tree[key])):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("aspec", [None, ActivationSpec("int8")])
def test_ragged_qmatmul_matches_per_expert_matmul(aspec):
  rng = np.random.default_rng(5)
  w = jnp.asarray(rng.standard_normal((3, D, 8)).astype(np.float32))
  x = jnp.asarray(rng.standard_normal((7, D)).astype(np.float32))
  sizes = jnp.array([2, 0, 5], jnp.int32)

  @jax.jit
  def run(x, w):
    qt = ops.quantize_weight(w, WeightSpec("fp8"), act=aspec, backend="xla")
    return ragged_linear(x, qt, sizes), ops.fake_quantize_activations(x, qt), ops.dequantize_weight(qt)

  out, xd, wd = run(x, w)
  xd, wd = np.asarray(xd, np.float64), np.asarray(wd, np.float64)
  ref = np.concatenate([xd[:2] @ wd[0], xd[2:] @ wd[2]])
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_memory_targets_on_qwen3_shapes():
  """The benchmark's accounting on one Qwen3-0.6B layer (ratios do not depend on the depth)."""
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_quant_memory.py")
  spec = importlib.util.spec_from_file_location("bench_quant_memory", path)
  bench = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = bench  # dataclasses look their module up while the class is built
  spec.loader.exec_module(bench)
  shape = bench.Qwen3Shape(layers=1)
  for fmt, target in (("int8", 0.51), ("fp8", 0.51), ("int4", 0.27), ("fp4", 0.27)):
    linear, whole = bench.weight_ratios(QuantConfig(weights=WeightSpec(fmt)), shape)
    kv, _ = bench.kv_ratio(KVSpec(fmt), shape, batch=4, tokens=16)
    assert linear <= target and kv <= target, (fmt, linear, kv)
    assert linear < whole < 1.0


def test_qtensor_does_not_import_ops():
  """The storage type stands alone: the kernels (rl_jax.ops) import qtensor, never the other way round."""
  code = ("import sys, rl_jax.quant.qtensor, rl_jax.quant; "
          "assert 'rl_jax.ops' not in sys.modules, sorted(sys.modules)")
  subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


@pytest.mark.parametrize("fmt,aspec", [("fp8", None), ("int8", None), ("fp8", ActivationSpec("fp8"))])
def test_ragged_qmatmul_runs_the_grouped_kernel_at_16_bits_for_bf16_rows(fmt, aspec):
  """bf16 rows and FP8 / INT8 experts under the grouped kernel (impl "pallas"): weights dequantized
  to bf16 (not float32 at HIGHEST), products accumulated in float32, output bf16. Against the
  float64 product of the same bf16 operands: one rounding of the output to bf16 (2**-8 of |y|)
  plus a float32 sum of K terms (2 K 2**-24 of |x| @ |w|), elementwise."""
  from rl_jax import impl_log  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(6)
  w = jnp.asarray(rng.standard_normal((3, D, 8)).astype(np.float32))
  x = jnp.asarray(rng.standard_normal((7, D)).astype(np.float32), jnp.bfloat16)
  sizes = jnp.array([2, 0, 5], jnp.int32)

  @jax.jit
  def run(x, w):
    qt = ops.quantize_weight(w, WeightSpec(fmt), act=aspec, backend="xla")
    return (ragged_linear(x, qt, sizes, impl="pallas"), ops.fake_quantize_activations(x, qt).astype(jnp.bfloat16),
            ops.dequantize_weight(qt, jnp.bfloat16))

  with impl_log.recording() as log:
    out, xd, wd = run(x, w)
  assert out.dtype == jnp.bfloat16 and wd.dtype == jnp.bfloat16
  assert dict(log["experts"]) == {"quantized grouped bfloat16": 1}
  xd, wd = np.asarray(xd, np.float64), np.asarray(wd, np.float64)
  per_expert = lambda a, b: np.concatenate([a[:2] @ b[0], a[2:] @ b[2]])
  ref, scale = per_expert(xd, wd), per_expert(np.abs(xd), np.abs(wd))
  err = np.abs(np.asarray(out, np.float64) - ref)
  assert np.all(err <= 2.0**-8 * np.abs(ref) + 2 * D * 2.0**-24 * scale), err.max()
  # float32 rows keep float32 operands at HIGHEST (and XLA:CPU's ragged_dot keeps them for bf16).
  with impl_log.recording() as log:
    jax.jit(lambda x, w: ragged_linear(x, ops.quantize_weight(w, WeightSpec(fmt), backend="xla"), sizes,
                                           impl="pallas"))(x.astype(jnp.float32), w)
    jax.jit(lambda x, w: ragged_linear(x, ops.quantize_weight(w, WeightSpec(fmt), backend="xla"), sizes))(x, w)
  assert dict(log["experts"]) == {"quantized grouped float32": 1, "quantized ragged_dot float32": 1}
