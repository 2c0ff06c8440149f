"""QuantConfig: sampler quantization of weights, activations and KV cache, validated early."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Optional

from rl_jax.config_utils import ConfigError
from rl_jax.quant.formats import FORMATS, SCALE_DTYPES, FormatName, ScaleDType

Granularity = Literal["channel", "token", "block"]
Backend = Literal["auto", "pallas", "xla"]

# fp4 follows MXFP4: 32 elements share one power-of-two (e8m0) scale. Other
# formats use 128 (DeepSeek-V3 FP8 / GPTQ group size) when asked for blocks.
_DEFAULT_BLOCK = {"fp4": 32}
_DEFAULT_BLOCK_OTHER = 128


@dataclasses.dataclass(frozen=True)
class FormatSpec:
  """Format, scale granularity and scale dtype of one role (weights / activations / kv).

  `None` fields resolve in `__post_init__` to the role's defaults, so two specs
  that quantize the same way compare (and hash) equal:
    granularity: 'block' for fp4 (MXFP4-like), else the role's per-row default:
      weights 'channel' (one scale per output channel, absmax over K),
      activations 'token' (per token, absmax over K), kv 'token' (per token and
      head, absmax over head_dim).
    block_size: 32 for fp4, 128 otherwise (only used with granularity='block';
      blocks run along the contraction axis K, or head_dim for the KV cache).
    scale_dtype: 'e8m0' for fp4 blocks; 'bf16' (rounded up) for the KV cache,
      where one scale per 128 values is a visible share of the bytes; 'fp32' else.
  """
  ROLE: ClassVar[str] = "weights"
  ROLE_GRANULARITY: ClassVar[tuple[str, ...]] = ("channel", "block")

  format: FormatName = "fp32"
  granularity: Optional[Granularity] = None
  block_size: Optional[int] = None
  scale_dtype: Optional[ScaleDType] = None

  def __post_init__(self):
    if self.format not in FORMATS:
      raise ConfigError(f"key 'format': unknown format {self.format!r}; valid: {sorted(FORMATS)}")
    default_gran = "block" if self.format == "fp4" else self.ROLE_GRANULARITY[0]
    gran = self.granularity or default_gran
    if gran not in self.ROLE_GRANULARITY:
      raise ConfigError(f"key 'granularity': {gran!r} is not valid for {self.ROLE}; "
                        f"use one of {list(self.ROLE_GRANULARITY)}")
    block = self.block_size
    if block is None:
      block = _DEFAULT_BLOCK.get(self.format, _DEFAULT_BLOCK_OTHER)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
      raise ConfigError(f"key 'block_size': must be a positive int, got {block!r}")
    if gran == "block" and FORMATS[self.format].packed and block % 2:
      raise ConfigError(f"key 'block_size': {self.format} packs two values per byte, so blocks "
                        f"must have an even size, got {block}")
    scale = self.scale_dtype
    if scale is None:
      if gran == "block" and self.format == "fp4":
        scale = "e8m0"
      else:
        scale = "bf16" if self.ROLE == "kv" else "fp32"
    if scale not in SCALE_DTYPES:
      raise ConfigError(f"key 'scale_dtype': unknown {scale!r}; valid: {sorted(SCALE_DTYPES)}")
    object.__setattr__(self, "granularity", gran)
    object.__setattr__(self, "block_size", block)
    object.__setattr__(self, "scale_dtype", scale)

  @property
  def quantized(self) -> bool:
    return FORMATS[self.format].quantized

  @property
  def block(self) -> int | None:
    """Elements per scale along the reduced axis; None = one scale for the whole axis."""
    return self.block_size if self.granularity == "block" else None


@dataclasses.dataclass(frozen=True)
class WeightSpec(FormatSpec):
  """Weights `[K, N]` / `[E, K, N]`: scales per output channel (and expert), or K-blocks."""
  ROLE: ClassVar[str] = "weights"
  ROLE_GRANULARITY: ClassVar[tuple[str, ...]] = ("channel", "block")


@dataclasses.dataclass(frozen=True)
class ActivationSpec(FormatSpec):
  """Activations `[..., K]` entering a quantized matmul: scales per token, or K-blocks."""
  ROLE: ClassVar[str] = "activations"
  ROLE_GRANULARITY: ClassVar[tuple[str, ...]] = ("token", "block")


@dataclasses.dataclass(frozen=True)
class KVSpec(FormatSpec):
  """KV cache `[B, T, H, D]`: scales per (token, head), or blocks along D."""
  ROLE: ClassVar[str] = "kv"
  ROLE_GRANULARITY: ClassVar[tuple[str, ...]] = ("token", "block")


def _w(fmt, **kw):
  return WeightSpec(format=fmt, **kw)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """Sampler quantization (docs/math.md#mismatch-sources), each role independent.

  Defaults quantize nothing (fp32 everywhere: the zero-mismatch setting).
  `backend`: 'auto' runs the quantized-matmul Pallas kernel on GPU/TPU and XLA's fusions
  for the codecs (quantize / dequantize: faster than their kernels on an H200) and on CPU;
  'pallas' forces every kernel (interpret mode on CPU); 'xla' forces jnp.
  `quantize_lm_head` also quantizes an untied `w_unembed`; tied embeddings
  are never quantized.
  """
  weights: WeightSpec = dataclasses.field(default_factory=WeightSpec)
  activations: ActivationSpec = dataclasses.field(default_factory=ActivationSpec)
  kv: KVSpec = dataclasses.field(default_factory=KVSpec)
  backend: Backend = "auto"
  quantize_lm_head: bool = False

  def __post_init__(self):
    # Plain dicts are accepted for direct construction as well as via from_dict.
    for name, cls in (("weights", WeightSpec), ("activations", ActivationSpec), ("kv", KVSpec)):
      value = getattr(self, name)
      if isinstance(value, dict):
        value = cls(**value)
      if not isinstance(value, cls):
        if isinstance(value, FormatSpec):
          # A spec built for another role keeps its choices; per-row granularity is renamed.
          value = cls(value.format, "block" if value.granularity == "block" else None,
                      value.block_size, value.scale_dtype)
        else:
          raise ConfigError(f"key '{name}': expected a {cls.__name__}, got {type(value).__name__}")
      object.__setattr__(self, name, value)
    if self.backend not in ("auto", "pallas", "xla"):
      raise ConfigError(f"key 'backend': {self.backend!r} is not one of ['auto', 'pallas', 'xla']")
    if self.activations.quantized and not self.weights.quantized:
      raise ConfigError(
          f"key 'activations.format': activation quantization ({self.activations.format}) happens "
          f"inside the quantized matmul, so it needs quantized weights (weights.format is "
          f"{self.weights.format!r})")

  @classmethod
  def preset(cls, name: str, backend: str = "auto") -> "QuantConfig":
    """Named regimes: [SC]'s W/A + KV settings, weight-only int4/fp4, 'bf16' and 'none'."""
    presets = {
        "none": dict(),
        "bf16": dict(weights=_w("bf16"), kv=KVSpec("bf16")),
        "fp8_wa_fp8_kv": dict(weights=_w("fp8"), activations=ActivationSpec("fp8"),
                              kv=KVSpec("fp8")),
        "fp8_wa_fp4_kv": dict(weights=_w("fp8"), activations=ActivationSpec("fp8"),
                              kv=KVSpec("fp4")),
        "int8_wa_int4_kv": dict(weights=_w("int8"), activations=ActivationSpec("int8"),
                                kv=KVSpec("int4")),
        "int8_wa_int8_kv": dict(weights=_w("int8"), activations=ActivationSpec("int8"),
                                kv=KVSpec("int8")),
        # Weight-only int4 with GPTQ/AWQ-style groups of 128 along K.
        "int4_w": dict(weights=_w("int4", granularity="block", block_size=128)),
        "fp4_w": dict(weights=_w("fp4")),
    }
    if name not in presets:
      raise ConfigError(f"key 'preset': unknown quantization preset {name!r}; "
                        f"valid: {sorted(presets)}")
    return cls(backend=backend, **presets[name])

  PRESETS: ClassVar[tuple[str, ...]] = ("none", "bf16", "fp8_wa_fp8_kv", "fp8_wa_fp4_kv",
                                        "int8_wa_int4_kv", "int8_wa_int8_kv", "int4_w", "fp4_w")
