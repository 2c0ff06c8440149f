"""Sampler quantization: number formats, QTensor storage, Pallas kernels and jnp references.

The package exports only the config and storage types, so importing it (the sampler's
config does) pulls in no kernels; the math is imported by module: `quant.ops` (quantize,
dequantize, the model's `linear` / `ragged_linear` dispatch), `quant.params`, `quant.kv`.
"""
from rl_jax.quant.config import (ActivationSpec, FormatSpec, KVSpec, QuantConfig,  # noqa: F401
                                 WeightSpec)
from rl_jax.quant.formats import FORMATS, get_format  # noqa: F401
from rl_jax.quant.qtensor import QTensor  # noqa: F401
