"""Stored bytes of quantized Qwen3-0.6B weights and a 64 x 1024 KV cache, as ratios to bf16.

Run: `python benchmarks/bench_quant_memory.py` (CPU, a few seconds; nothing is
allocated: the parameter tree and the quantized tree are `jax.eval_shape`
abstractions, and the bytes are counted from the abstract leaves, scales
included). Targets (issue 4): int8 / fp8 <= 0.51, int4 / fp4 <= 0.27, measured
on the quantized linear weights + their scales ("linear" column) and on the KV
cache; the "whole tree" column adds the bf16 tied embedding and norms, which
are never quantized.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rl_jax.models.quantize import quantize_params, quantized_nbytes, tree_nbytes
from rl_jax.ops import kv_quant as qkv
from rl_jax.quant.config import KVSpec, QuantConfig, WeightSpec


@dataclasses.dataclass(frozen=True)
class Qwen3Shape:
  """Qwen3-0.6B (config.json of Qwen/Qwen3-0.6B)."""
  vocab: int = 151936
  hidden: int = 1024
  layers: int = 28
  q_heads: int = 16
  kv_heads: int = 8
  head_dim: int = 128
  intermediate: int = 3072


def abstract_params(s: Qwen3Shape = Qwen3Shape(), dtype=jnp.bfloat16):
  """The parameter tree as ShapeDtypeStructs ([in, out] linears, tied embedding)."""
  def build():
    z = lambda *shape: jnp.zeros(shape, dtype)
    layer = lambda: {
        "attn": {"wq": z(s.hidden, s.q_heads * s.head_dim),
                 "wk": z(s.hidden, s.kv_heads * s.head_dim),
                 "wv": z(s.hidden, s.kv_heads * s.head_dim),
                 "wo": z(s.q_heads * s.head_dim, s.hidden),
                 "q_norm": {"scale": z(s.head_dim)}, "k_norm": {"scale": z(s.head_dim)}},
        "mlp": {"w_gate": z(s.hidden, s.intermediate), "w_up": z(s.hidden, s.intermediate),
                "w_down": z(s.intermediate, s.hidden)},
        "input_norm": {"scale": z(s.hidden)}, "post_attn_norm": {"scale": z(s.hidden)}}
    return {"embedding": z(s.vocab, s.hidden), "final_norm": {"scale": z(s.hidden)},
            "layers": [layer() for _ in range(s.layers)]}
  return jax.eval_shape(build)


def weight_ratios(qcfg: QuantConfig, s: Qwen3Shape = Qwen3Shape()) -> tuple[float, float]:
  """(quantized linears + scales / same linears in bf16, whole tree / whole tree in bf16)."""
  tree = abstract_params(s)
  qtree = jax.eval_shape(lambda t: quantize_params(t, qcfg), tree)
  q_bytes, q_elems = quantized_nbytes(qtree)
  return q_bytes / (2 * q_elems), tree_nbytes(qtree) / tree_nbytes(tree)


def kv_ratio(spec: KVSpec, s: Qwen3Shape = Qwen3Shape(), batch: int = 64, tokens: int = 1024
             ) -> tuple[float, int]:
  """(KV cache bytes / bf16 cache bytes, quantized cache bytes for K and V of all layers)."""
  shape = (batch, tokens, s.kv_heads, s.head_dim)
  per_tensor = qkv.kv_bytes(shape, spec)
  bf16 = batch * tokens * s.kv_heads * s.head_dim * 2
  return per_tensor / bf16, per_tensor * 2 * s.layers


FORMATS = ("int8", "fp8", "fp8_e5m2", "int4", "fp4")
TARGET = {"int8": 0.51, "fp8": 0.51, "fp8_e5m2": 0.51, "int4": 0.27, "fp4": 0.27}


def rows():
  """One row per format (role defaults) plus the int4 / fp4 block variants."""
  out = []
  variants = [(f, WeightSpec(f), KVSpec(f)) for f in FORMATS]
  variants += [("int4", WeightSpec("int4", "block", 128), KVSpec("int4", "block", 64)),
               ("fp4", WeightSpec("fp4", "channel"), KVSpec("fp4", "token"))]
  for fmt, wspec, kspec in variants:
    lin, whole = weight_ratios(QuantConfig(weights=wspec))
    kv, kv_bytes = kv_ratio(kspec)
    out.append((fmt, wspec, kspec, lin, whole, kv, kv_bytes))
  return out


def describe(spec) -> str:
  if spec.granularity == "block":
    return f"block{spec.block_size}/{spec.scale_dtype}"
  return f"{spec.granularity}/{spec.scale_dtype}"


def main():
  s = Qwen3Shape()
  print("Qwen3-0.6B stored bytes / bf16 bytes (scales included); KV cache: batch 64 x 1024 "
        f"tokens x {s.layers} layers x K,V x {s.kv_heads} heads x {s.head_dim}")
  print(f"{'format':9} {'weight scales':18} {'linear':>7} {'whole':>7}   {'kv scales':16} "
        f"{'kv':>7} {'kv GiB':>7}  target  ok")
  all_ok = True
  for fmt, wspec, kspec, lin, whole, kv, kv_bytes in rows():
    ok = lin <= TARGET[fmt] and kv <= TARGET[fmt]
    all_ok &= ok
    print(f"{fmt:9} {describe(wspec):18} {lin:7.4f} {whole:7.4f}   {describe(kspec):16} "
          f"{kv:7.4f} {kv_bytes / 2**30:7.3f}  <={TARGET[fmt]:.2f}  {'yes' if ok else 'NO'}")
  _, bf16_kv = kv_ratio(KVSpec("bf16"))
  print(f"bf16 KV cache: {bf16_kv / 2**30:.3f} GiB. 'linear' = quantized linear weights + "
        "scales vs the same weights in bf16 (what the targets refer to); 'whole' also counts "
        "the bf16 tied embedding (155.6M params) and norms, never quantized.")
  print("all targets met" if all_ok else "SOME TARGETS MISSED")
  return all_ok


if __name__ == "__main__":
  raise SystemExit(0 if main() else 1)
