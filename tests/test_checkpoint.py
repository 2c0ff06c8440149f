"""Checkpointer: sharded round trip, and a non-finite state is refused without writing anything."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_jax.checkpoint import Checkpointer, nonfinite_leaves


def _state():
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("fsdp", None)))
  return {"params": {"w": w, "b": jnp.ones(3, jnp.bfloat16)}, "opt_state": {"count": jnp.int32(7)}}


def test_sharded_round_trip(tmp_path):
  state = _state()
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(3, state, {"step": 3})
  out, meta, step = ckpt.restore(state)
  ckpt.close()
  assert step == 3 and meta == {"step": 3}
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == b.sharding


def test_non_finite_state_is_refused_and_nothing_written(tmp_path):
  state = _state()
  state["params"]["w"] = state["params"]["w"].at[5, 1].set(jnp.nan)
  state["params"]["b"] = state["params"]["b"].at[0].set(jnp.inf)
  assert nonfinite_leaves(state) == ["params['b']", "params['w']"]
  ckpt = Checkpointer(str(tmp_path))
  with pytest.raises(FloatingPointError, match=r"refusing to checkpoint step 4.*params\['w'\]"):
    ckpt.save(4, state, {"step": 4})
  assert ckpt.latest_step() is None
  ckpt.close()
