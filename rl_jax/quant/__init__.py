"""Sampler quantization: number formats, QTensor storage, Pallas kernels and jnp references."""
from rl_jax.quant.config import (ActivationSpec, FormatSpec, KVSpec, QuantConfig,  # noqa: F401
                                 WeightSpec)
from rl_jax.quant.formats import FORMATS, get_format  # noqa: F401
from rl_jax.quant.kv import kv_cache_zeros, kv_dequantize, kv_quantize, kv_write  # noqa: F401
from rl_jax.quant.ops import (dequantize_weight, matmul, qmatmul, quantize_weight,  # noqa: F401
                              ragged_matmul, ragged_qmatmul, resolve_backend)
from rl_jax.quant.params import quantize_params, tree_nbytes  # noqa: F401
from rl_jax.quant.qtensor import QTensor, is_qtensor  # noqa: F401
