"""Recorded expert ids are stored compact (rollout.expert_id_dtype) and replay exactly as int32 did."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ragged_prompts
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.rl import step as step_lib
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.rollout import expert_id_dtype
from rl_jax.sampler import generate as gen
from rl_jax.sampler.config import SamplerConfig

V, P, T = 64, 8, 10
MOE = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                  n_experts=4, n_experts_per_tok=2, moe_d_ff=32, init_std=0.2, tie_embeddings=False)
SCFG = SamplerConfig(max_prompt_len=P, max_new_tokens=T, temperature=0.7, record_topk=4, eos_id=1)


def _prompts():
  return ragged_prompts(V, P)


def test_dtype_rule():
  """The smallest integer dtype holding ids 0..E-1 (no sentinel: unrecorded slots hold 0)."""
  for e, want in [(0, jnp.uint8), (4, jnp.uint8), (128, jnp.uint8), (256, jnp.uint8), (257, jnp.int16),
                  (300, jnp.int16), (32768, jnp.int16), (32769, jnp.int32)]:
    assert expert_id_dtype(e) == jnp.dtype(want), e
    assert e == 0 or jnp.iinfo(expert_id_dtype(e)).max >= e - 1


@pytest.mark.parametrize("n_experts,itemsize", [(4, 1), (300, 2)])
def test_sampler_output_is_compact(n_experts, itemsize):
  """The generate program's abstract output (what the planner sizes): ids in 1 byte at 4 experts,
  2 at 300 (nothing built or run)."""
  cfg = dataclasses.replace(MOE, n_experts=n_experts)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  toks, valid = _prompts()
  program = functools.partial(gen.generate_program, graphdef, cfg=SCFG,
                              kv_spec=gen.resolve_kv_spec(None, SCFG), mesh=None)
  ro = jax.eval_shape(program, state, jnp.asarray(toks), jnp.asarray(valid), jax.random.key(0))
  assert ro.expert_ids_BSLK.dtype == expert_id_dtype(n_experts)
  assert ro.expert_ids_BSLK.dtype.itemsize == itemsize
  assert ro.expert_ids_BSLK.shape == (4, P + T, cfg.n_moe_layers, cfg.n_experts_per_tok)


@pytest.fixture(scope="module")
def rollout():
  model = Transformer(MOE, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  ro = gen.generate(graphdef, params, *_prompts(), jax.random.key(0), SCFG)
  return model, graphdef, params, ro


def test_recorded_ids_are_uint8_and_replay_exactly(rollout):
  """The sampler records uint8 ids (4 experts) equal to the forward's int32 routes at valid slots;
  replaying them (R3) reproduces the int32 replay bit for bit, unrolled and scanned."""
  model, _, params, ro = rollout
  ids = ro.expert_ids_BSLK
  assert ids.dtype == jnp.uint8
  ev = np.asarray(ro.expert_valid_BS)
  nat = model(ro.tokens_BS, ro.positions_BS, ro.valid_BS)
  assert nat.expert_ids_BSLK.dtype == jnp.int32
  np.testing.assert_array_equal(np.where(ev[..., None, None], nat.expert_ids_BSLK, 0), ids)
  scanned = nnx.merge(*nnx.split(Transformer(dataclasses.replace(MOE, scan_layers=True), rngs=nnx.Rngs(0))))
  for m in (model, scanned):
    kw = dict(replay_mask_BS=ro.expert_valid_BS, return_router_logits=True)
    small = m(ro.tokens_BS, ro.positions_BS, ro.valid_BS, replay_ids_BSLK=ids, **kw)
    wide = m(ro.tokens_BS, ro.positions_BS, ro.valid_BS, replay_ids_BSLK=ids.astype(jnp.int32), **kw)
    np.testing.assert_array_equal(small.logits_BSV, wide.logits_BSV)
    np.testing.assert_array_equal(small.expert_ids_BSLK, wide.expert_ids_BSLK)
    np.testing.assert_array_equal(small.router_logits_BSLE, wide.router_logits_BSLE)
  # Replaying a forward's own routes, stored compact, reproduces that forward exactly.
  rep = model(ro.tokens_BS, ro.positions_BS, ro.valid_BS,
              replay_ids_BSLK=nat.expert_ids_BSLK.astype(expert_id_dtype(MOE.n_experts)))
  np.testing.assert_array_equal(rep.logits_BSV, nat.logits_BSV)


@pytest.mark.parametrize("replay", ["R2", "R3"])
def test_old_forward_and_loss_with_compact_ids(rollout, replay):
  """p_old forward: compact own ids (R2's replay), the same p_old, agreement and loss as int32 ids."""
  _, graphdef, params, ro = rollout
  batch = step_lib.TrainBatch.from_rollout(ro, jnp.asarray([1.0, -1.0, 0.5, -0.5]))
  cfg = LossConfig(temperature=0.7, method="naive_is")
  old = jax.jit(functools.partial(step_lib.old_forward, graphdef=graphdef, loss_cfg=cfg, replay=replay))
  loss = jax.jit(functools.partial(step_lib.loss_fn, graphdef=graphdef, loss_cfg=cfg, aux_coef=0.0))
  res = {}
  for name, ids in (("uint8", ro.expert_ids_BSLK), ("int32", ro.expert_ids_BSLK.astype(jnp.int32))):
    logp_old, own_ids, m = old(params, batch, ids, ro.expert_valid_BS)
    assert own_ids.dtype == jnp.uint8
    b = batch.replace(logp_old_BT=logp_old)
    b = (b.replace(replay_ids_BSLK=own_ids, replay_mask_BS=b.valid_BS) if replay == "R2"
         else b.replace(replay_ids_BSLK=ids, replay_mask_BS=ro.expert_valid_BS))
    res[name] = (logp_old, own_ids, m, loss(params, b))
  jax.tree.map(np.testing.assert_array_equal, res["uint8"], res["int32"])
  assert 0.0 < float(res["uint8"][2]["mismatch/routing_agreement"]) <= 1.0
  assert float(step_lib.routing_agreement(res["uint8"][1], ro.expert_ids_BSLK, ro.expert_valid_BS)) > 0.5


def test_bytes_at_minirl_scale():
  """Qwen3-30B-A3B (128 experts, 48 MoE layers x 8 slots): 384 B a token instead of 1.5 KiB."""
  dt = expert_id_dtype(128)
  assert dt == jnp.uint8 and 48 * 8 * dt.itemsize == 384 and 48 * 8 * 4 == 1536
