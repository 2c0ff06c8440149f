"""The residual stream stays split over the batch axes under FSDP (transformer.constrain_batch)."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from rl_jax import sharding as sh
from rl_jax.models import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                  tie_embeddings=False, remat=True)
B, S = 64, 128

pytestmark = pytest.mark.usefixtures("fast_compile")


def _grad_temp_bytes(cfg, batch, mesh=None) -> int:
  """XLA's per-device temporaries of the loss gradient (abstract: nothing is allocated)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  tok = jax.ShapeDtypeStruct((batch, S), jnp.int32)

  def loss(state, tok):
    return jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, state)(tok).logits_BSV)[..., 0])

  if mesh is None:
    return jax.jit(jax.grad(loss)).lower(state, tok).compile().memory_analysis().temp_size_in_bytes
  shardings = sh.state_shardings(state, mesh)
  f = jax.jit(jax.grad(loss), in_shardings=(shardings, sh.batch_sharding(mesh)), out_shardings=shardings)
  with jax.set_mesh(mesh):
    return f.lower(state, tok).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_fsdp_activations_are_per_device_batch_sized(scan):
  """Under fsdp=8 a device holds what one device holding 1/8 of the batch would, not the global batch.

  Without the constraint (no mesh in context) GSPMD follows the d_model-split weights onto the
  activations and replicates the batch. Measured (jax 0.10, XLA:CPU): unrolled 1 device x B/8 50 MiB,
  fsdp=8 43 MiB, fsdp=8 without the context 290 MiB; scanned 15 / 13.5 / 87 MiB.
  """
  cfg = dataclasses.replace(CFG, scan_layers=scan)
  mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=8, expert=1, tensor=1))
  single = _grad_temp_bytes(cfg, B // 8)
  sharded = _grad_temp_bytes(cfg, B, mesh)
  assert sharded < 1.5 * single, (single, sharded)
