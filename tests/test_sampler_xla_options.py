"""The sampler programs' XLA:CPU compiler options (`sampler/xla_options.py`): applied at the top level, not nested."""
import jax
import numpy as np
import pytest
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.sampler import generate as gen
from rl_jax.sampler import xla_options
from rl_jax.sampler.config import SamplerConfig

V, P, T = 64, 6, 5


def test_options_by_backend_and_env(monkeypatch):
  assert xla_options.compiler_options("cpu") == xla_options.CPU_OPTIONS
  assert xla_options.compiler_options("gpu") is None and xla_options.compiler_options("tpu") is None
  monkeypatch.setenv(xla_options.ENV_KEEP_DEFAULT, "1")
  assert xla_options.compiler_options("cpu") is None


def test_generate_compiles_without_library_fusions_and_nests():
  """The top-level program has no YNNPACK fusion; called inside another jit, the program is inlined
  (no nested compiler options) and samples the same tokens; XLA's default jit of the same program
  has some YNNPACK fusion (else the option is moot on this jax: skipped, so the first check is not
  read as proof)."""
  cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                    n_experts=4, n_experts_per_tok=2, moe_d_ff=32, init_std=0.2, tie_embeddings=False)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  scfg = SamplerConfig(max_prompt_len=P, max_new_tokens=T, eos_id=1, record_topk=4)
  toks = np.random.default_rng(0).integers(2, V, (4, P)).astype(np.int32)
  valid = np.ones((4, P), bool)
  key = jax.random.key(0)
  ours = gen.lower_generate(graphdef, state, toks, valid, key, scfg).compile().as_text()
  default = jax.jit(gen.generate_program, static_argnames=gen._STATIC_ARGNAMES).lower(
      graphdef, state, toks, valid, key, cfg=scfg, kv_spec=gen.resolve_kv_spec(None, scfg), mesh=None)
  assert "ynn" not in ours.lower()
  top = gen.generate(graphdef, state, toks, valid, key, scfg)
  nested = jax.jit(lambda s, t, v, k: gen._generate(graphdef, s, t, v, k, None, cfg=scfg,
                                                      kv_spec=gen.resolve_kv_spec(None, scfg), mesh=None))
  inner = nested(state, toks, valid, key)
  np.testing.assert_array_equal(np.asarray(top.tokens_BS), np.asarray(inner.tokens_BS))
  if "ynn" not in default.compile().as_text().lower():  # the option would change nothing here
    pytest.skip(f"jax {jax.__version__}: XLA's default compiles this program without YNNPACK fusions")
