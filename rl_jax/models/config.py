"""ModelConfig: the shape of a decoder of a registered family (models/families), validated at the boundary."""
from __future__ import annotations

import dataclasses
from typing import Literal

from rl_jax.config_utils import require

DType = Literal["float32", "bfloat16"]
# How the local experts' matmuls run (`model.expert_matmul`; models/moe.py resolves "auto").
EXPERT_MATMULS = ("auto", "slab", "ragged_dot", "grouped")
# The job's execution choices: how the model computes, not what it is. A Hugging Face config.json
# holds none of them, so a warm start from a checkpoint takes each one from the job's model section
# (rl/warm_start.py); a field added here is carried there with no other edit.
EXECUTION_FIELDS = ("dtype", "param_dtype", "remat", "router_aux_loss_coef", "scan_layers",
                    "moe_dispatch", "moe_a2a", "expert_matmul", "moe_seq_chunk", "attention",
                    "batch_invariant")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer hyper-parameters (Qwen3 / Qwen3-MoE naming in comments).

  `family` names the registered family (rl_jax/models/families) whose HF mapping and defaults
  the config follows; the block-construction switches below (q/k norm, q/k/v biases, RoPE
  scaling, shared experts) are what a family sets, so the model code reads switches, not names.

  MoE layers follow transformers' Qwen3-MoE rule: layer `i` is MoE iff
  `n_experts > 0`, `i not in mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`.
  """
  family: str = "qwen3"        # rl_jax.models.families: qwen3 (dense + MoE), llama3, qwen2_moe
  vocab_size: int = 64
  d_model: int = 64            # hidden_size
  n_layers: int = 2            # num_hidden_layers
  n_heads: int = 4             # num_attention_heads
  n_kv_heads: int = 2          # num_key_value_heads (GQA)
  head_dim: int = 16
  d_ff: int = 128              # intermediate_size (dense MLP)
  n_experts: int = 0           # num_experts; 0 = dense model
  n_experts_per_tok: int = 2   # num_experts_per_tok (top-k)
  moe_d_ff: int = 64           # moe_intermediate_size
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.0  # Switch load-balancing loss weight (0 = off)
  # MoE expert communication: "gspmd" lets XLA partition it (each batch shard's tokens sorted
  # on their own under a mesh); "shard_map" is the explicit expert-parallel all-to-all of
  # models/expert_parallel.py (exact all-gather fallback on overflow), "all_gather" that module's
  # all-gather + reduce-scatter alone (both need `jax.set_mesh(mesh)`).
  moe_dispatch: Literal["gspmd", "shard_map", "all_gather"] = "gspmd"
  # The shard_map all-to-all's collective: "padded" (lax.all_to_all of fixed per-peer buffers,
  # runs everywhere) or "ragged" (lax.ragged_all_to_all, only routed rows; not on XLA:CPU).
  moe_a2a: Literal["padded", "ragged"] = "padded"
  # The local experts' matmuls (docs/architecture.md#expert-dispatch): "slab" (an [E, C, D] capacity
  # slab, then rounds of it: plain XLA ops, no dense expansion), "grouped" (the Pallas grouped
  # matmul of expert-sorted rows, ops/grouped_matmul.py, with its own VJP; interpreted on CPU),
  # "ragged_dot" (lax.ragged_dot, the reference: native on TPU, dense [rows, E * F] on XLA:CPU/GPU),
  # or "auto" (grouped on GPU for bf16 / f16 compute, ragged_dot on TPU, slab on CPU, for float32
  # on GPU and in the zero-mismatch mode, from jax.default_backend() at trace time). Quantized
  # sampler experts take ragged_dot unless "grouped".
  expert_matmul: Literal["auto", "slab", "ragged_dot", "grouped"] = "auto"
  # Sequence positions per MoE dispatch chunk (0: the whole sequence at once). The experts run per
  # token, so chunking is exact; it bounds the dispatch's buffers (all-to-all, capacity slab, the
  # experts' activations, each ~tokens x top-k x d_model) to one chunk's, forward and backward
  # (each chunk rematerialized), which at 32K-token responses is most of a layer's memory.
  moe_seq_chunk: int = 0
  # Attention kernel (rl_jax/ops/attention.py, `auto_impl`): "auto" (cuDNN on GPU where the mask
  # and dtype allow, splash on TPU, the native handlers on CPU for the float32 no-cache forward,
  # else XLA, or the blocked lax-loop attention where it wins (CPU, from 512 x 512 scores) or
  # memory forces it), or one of "xla" (materialized [S, C] scores), "blocked", "native" (auto's
  # choice, saying so once, where it cannot run), "cudnn", "splash" (the last two fall back to
  # blocked, saying so once, where they cannot run). "flash" is blocked's old name (deprecated:
  # a warning, then blocked).
  attention: Literal["auto", "xla", "blocked", "native", "cudnn", "splash", "flash"] = "auto"
  # The zero-mismatch mode (docs/math.md#zero-mismatch-mode): every forward computes a token the
  # same way whatever else it holds, so an fp32 sampler's log q equals the trainer's log p_old bit
  # for bit (on the shapes tests/test_zero_mismatch.py pins). Attention: blocked with 1-slot query
  # blocks and fixed key blocks everywhere (trainer, prefill, decode); every product a fixed-order
  # accumulation (rl_jax/ops/batch_invariant.py). Slow: a certificate, not a training setting.
  batch_invariant: bool = False
  rope_theta: float = 1_000_000.0
  # Block-construction switches (set by the family; docs/architecture.md#extending).
  qk_norm: bool = True         # per-head RMSNorm of q and k before RoPE (Qwen3, not Llama / Qwen2)
  qkv_bias: bool = False       # biases on the q / k / v projections (Qwen2-MoE)
  # RoPE frequency scaling: "none", or "llama3" (long wavelengths divided by rope_factor, a smooth
  # blend between low_freq_factor and high_freq_factor of the original context length).
  rope_scaling: Literal["none", "llama3"] = "none"
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  # A shared expert in every MoE layer (Qwen2-MoE): a SwiGLU MLP of this width that every token
  # runs, scaled by sigmoid(x w_shared_gate) and added to the routed experts' output; it never
  # enters the routing record. 0 = none.
  shared_expert_d_ff: int = 0
  rms_eps: float = 1e-6
  tie_embeddings: bool = True
  dtype: DType = "float32"        # compute dtype
  param_dtype: DType = "float32"  # storage dtype of the trainer's parameters
  remat: bool = False             # per-layer rematerialization
  # Layers as one `lax.scan` per run of same-kind layers (params stacked on a leading
  # 'layers' axis): compile time flat in depth. Not interchangeable with the unrolled
  # layout in orbax checkpoints; convert with transformer.stack_layers / unstack_layers.
  scan_layers: bool = False
  init_std: float = 0.02

  def __post_init__(self):
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
      require(getattr(self, key) > 0, f"model.{key}", f"must be positive, got {getattr(self, key)}")
    require(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads",
            f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
    require(self.head_dim % 2 == 0, "model.head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
    require(self.n_experts >= 0, "model.n_experts", "must be >= 0")
    require(self.moe_dispatch in ("gspmd", "shard_map", "all_gather"), "model.moe_dispatch",
            f"must be 'gspmd', 'shard_map' or 'all_gather', got {self.moe_dispatch!r}")
    require(self.attention in ("auto", "xla", "blocked", "native", "cudnn", "splash", "flash"), "model.attention",
            f"must be one of auto, xla, blocked, native, cudnn, splash (flash: blocked's deprecated name); "
            f"got {self.attention!r}")
    require(self.moe_a2a in ("padded", "ragged"), "model.moe_a2a",
            f"must be 'padded' or 'ragged', got {self.moe_a2a!r}")
    require(self.expert_matmul in EXPERT_MATMULS, "model.expert_matmul",
            f"must be one of {', '.join(EXPERT_MATMULS)}; got {self.expert_matmul!r}")
    require(self.moe_seq_chunk >= 0, "model.moe_seq_chunk",
            f"must be >= 0 (0: no chunking), got {self.moe_seq_chunk}")
    # The zero-mismatch mode's fixed-order products are the slab's (batch_invariant.ordered_bmm).
    require(not self.batch_invariant or self.expert_matmul in ("auto", "slab"), "model.expert_matmul",
            f"must be 'auto' or 'slab' with model.batch_invariant, got {self.expert_matmul!r}")
    if self.n_experts:
      require(0 < self.n_experts_per_tok <= self.n_experts, "model.n_experts_per_tok",
              f"must be in [1, n_experts={self.n_experts}], got {self.n_experts_per_tok}")
      require(self.moe_d_ff > 0, "model.moe_d_ff", "must be positive for an MoE model")
      require(self.decoder_sparse_step >= 1, "model.decoder_sparse_step", "must be >= 1")
    require(self.rope_scaling in ("none", "llama3"), "model.rope_scaling",
            f"must be 'none' or 'llama3', got {self.rope_scaling!r}")
    if self.rope_scaling == "llama3":
      require(self.rope_factor > 0 and self.rope_original_max_positions > 0, "model.rope_factor",
              "llama3 RoPE scaling needs rope_factor > 0 and rope_original_max_positions > 0")
      require(self.rope_high_freq_factor > self.rope_low_freq_factor > 0, "model.rope_high_freq_factor",
              f"must exceed rope_low_freq_factor > 0, got {self.rope_high_freq_factor} and "
              f"{self.rope_low_freq_factor}")
    require(self.shared_expert_d_ff >= 0, "model.shared_expert_d_ff", "must be >= 0")
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
    require(not bad, "model.mlp_only_layers", f"layer indices {bad} outside [0, {self.n_layers})")

  @property
  def is_moe(self) -> bool:
    return bool(self.moe_layers)

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """Indices of the MoE layers, in order; position in this tuple = MoE-layer index."""
    if not self.n_experts:
      return ()
    return tuple(i for i in range(self.n_layers)
                 if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

  @property
  def moe_index(self) -> dict[int, int]:
    """Explicit map layer index -> MoE-layer index (docs/math.md#routing-replay: interleaving)."""
    return {layer: j for j, layer in enumerate(self.moe_layers)}

  @property
  def n_moe_layers(self) -> int:
    return len(self.moe_layers)

  @property
  def layer_groups(self) -> tuple[tuple[int, int, bool], ...]:
    """Maximal runs of consecutive same-kind layers as (first layer, count, is_moe).

    The scanned layout scans each run: one run for an all-dense or all-MoE model,
    alternating runs for `decoder_sparse_step` / `mlp_only_layers` interleavings.
    """
    moe = set(self.moe_layers)
    groups: list[tuple[int, int, bool]] = []
    for i in range(self.n_layers):
      if groups and groups[-1][2] == (i in moe):
        start, count, kind = groups[-1]
        groups[-1] = (start, count + 1, kind)
      else:
        groups.append((i, 1, i in moe))
    return tuple(groups)
