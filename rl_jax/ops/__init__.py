"""Kernels and matmul dispatch, below the models: every Pallas kernel with its jnp reference.

Imported by module, so importing the package loads nothing: `ops.linear` (the models' `linear` /
`ragged_linear` / `dense`, quantized or not), `ops.attention` (xla / blocked / cudnn / splash),
`ops.quantized` (quantize, dequantize, quantized matmuls: Pallas or XLA), `ops.quant_kernels`
(their Pallas kernels), `ops.grouped_matmul`, `ops.batch_invariant` (the zero-mismatch mode's
products), `ops.kv_quant` (the KV cache's codec). The quantized storage types and the number
formats' jnp math are one layer down, in `rl_jax.quant`.
"""
