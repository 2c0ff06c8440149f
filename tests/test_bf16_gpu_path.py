"""The pod configs' bf16 path end to end on CPU: one RL step of an `:n4`-shaped tiny config, and the
attention / expert implementations each program traced (rl_jax.impl_log), re-resolved for a GPU."""
import jax
import numpy as np
import pytest

from rl_jax import impl_log
from rl_jax import sharding as sh
from rl_jax.configs import countdown_tiny
from rl_jax.configs import qwen3_30b_a3b_minirl
from rl_jax.models import moe
from rl_jax.ops import attention as attn
from rl_jax.rl import trainer as trainer_lib

# The execution and method choices of the 30B MiniRL config's `:n4` that this test carries over.
_MODEL_KEYS = ("dtype", "param_dtype", "remat", "scan_layers", "moe_dispatch", "attention", "expert_matmul")
_SAMPLER_KEYS = ("dtype", "quant", "record_topk", "record_experts")
_LOSS_KEYS = ("method", "score_centering", "aggregation", "minirl_eps_low", "minirl_eps_high", "minirl_tis_c",
              "minirl_train_infer_is", "minirl_clip")


def n4_shaped_tiny_config():
  """countdown_tiny:test's model and task with qwen3_30b_a3b_minirl:n4's dtypes (bf16 compute on
  f32 master weights, bf16 FP8 sampler), scanned remat layers, shard_map dispatch over an expert
  axis, auto attention and expert matmul, MiniRL loss, 4 mini-batches with R3 replay and
  micro-batched p_old / update; 8 test devices as fsdp 4 x expert 2."""
  src = qwen3_30b_a3b_minirl.get_config("n4")
  cfg = countdown_tiny.get_config("test")
  cfg.warm_start.source = "none"
  for key in _MODEL_KEYS:
    cfg.model[key] = src.model[key]
  for key in _SAMPLER_KEYS:
    cfg.sampler[key] = src.sampler[key]
  for key in _LOSS_KEYS:
    cfg.loss[key] = src.loss[key]
  cfg.mesh.update(data=1, fsdp=4, expert=2, tensor=1)
  n = src.rl.n_minibatches
  cfg.rl.update(steps=1, n_minibatches=n, routing_replay=src.rl.routing_replay, prompts_per_step=4 * n,
                group_size=2, forward_microbatch=16, update_microbatch=8, eval_every=1000, checkpoint_every=1000)
  return cfg


def test_n4_config_shape_is_the_pod_configs():
  cfg = n4_shaped_tiny_config()
  assert (cfg.model.dtype, cfg.model.param_dtype, cfg.sampler.dtype) == ("bfloat16", "float32", "bfloat16")
  assert cfg.sampler.quant == "fp8_wa_fp8_kv" and cfg.rl.n_minibatches == 4 and cfg.rl.routing_replay == "R3"
  assert cfg.model.attention == "auto" and cfg.model.expert_matmul == "auto"


@pytest.mark.slow  # ~30-45 s on 2 busy cores (the compile of a scanned remat MoE step)
def test_one_rl_step_of_the_n4_shape_in_bf16_and_the_paths_it_took(tmp_path):
  cfg = n4_shaped_tiny_config()
  # One step's programs: the FP8 sampler (prefill, decode), p_old, the 4 updates. (The held-out
  # evaluation generates from clean float32 weights by design: trainer.evaluate, not traced here.)
  with impl_log.recording() as log:
    with trainer_lib.RLTrainer(cfg, str(tmp_path)) as tr, sh.mesh_context(tr.mesh):
      row = tr.train_step(0)
  assert np.isfinite(row["loss/loss"]) and np.isfinite(row["loss/grad_norm"]), row
  assert abs(row["mismatch/kl_k1"]) < 1.0  # an FP8 sampler: small, not zero

  # Attention: every call (trainer p_old and update, S x S; the sampler's prefill over its cache)
  # got bf16 q / k / v from the model (no float32 detour) at the static offset 0.
  calls = [impl_log.parse(c) for c in log["attention_call"]]
  layouts = {c["layout"] for c in calls}
  assert layouts == {"bcgd", "cache"}, layouts
  for c in calls:
    assert c["dtype"] == "bfloat16" and c["static_zero_offset"], c
    # On CPU auto runs xla (these are short sequences); on a GPU each call reaches cuDNN.
    args = dict(static_zero_offset=c["static_zero_offset"], static_offset=c["static_offset"], causal=c["causal"])
    shape = (c["b"], c["s"], c["c"], c["heads"], c["head_dim"])
    assert attn.auto_impl("cpu", jax.numpy.bfloat16, *shape, **args) == "xla"
    assert attn.auto_impl("gpu", jax.numpy.bfloat16, *shape, **args) == "cudnn", c
  assert set(log["attention"]) == {"xla"}, log["attention"]

  # Experts: the trainer's in bf16 (the slab on CPU; the grouped kernel on a GPU); the FP8
  # sampler's dequantized (float32 on CPU's ragged_dot, 16-bit under the grouped kernel: test_quant_params).
  experts = set(log["experts"])
  plain = {e for e in experts if not e.startswith("quantized ")}
  assert plain and all(e.endswith(" bfloat16") for e in plain), experts
  assert experts - plain == {"quantized ragged_dot float32"}, experts
  assert moe.resolve_expert_matmul(cfg.model.expert_matmul, "cpu", cfg.model.dtype) == "slab"
  assert moe.resolve_expert_matmul(cfg.model.expert_matmul, "gpu", cfg.model.dtype) == "grouped"
  # The FP8 sampler's linears: XLA's dequantize + dot on CPU (the Pallas qmatmul on a device).
  assert set(log["quantized_linear"]) == {"xla dequantize + float32 dot"}, log["quantized_linear"]
