"""Sampler quantization's types: number formats (with their jnp reference math), QTensor storage, QuantConfig.

Below the kernels layer: `rl_jax.ops` imports this package, never the other way round. The
math on these types lives there (`ops.quantized`: quantize, dequantize, quantized matmuls;
`ops.quant_kernels`: their Pallas kernels; `ops.kv_quant`: the KV cache's codec), and a model's
parameter tree is quantized by `models.quantize` (it reads the models' parameter tags).
"""
from rl_jax.quant.config import (ActivationSpec, FormatSpec, KVSpec, QuantConfig,  # noqa: F401
                                 WeightSpec)
from rl_jax.quant.formats import FORMATS, get_format  # noqa: F401
from rl_jax.quant.qtensor import QTensor  # noqa: F401
