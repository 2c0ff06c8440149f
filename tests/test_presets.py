"""Qwen3 presets: abstract parameter counts against the published totals and transformers' own count."""
import math

import pytest
from conftest import need

from rl_jax.config_utils import ConfigError
from rl_jax.models import hf
from rl_jax.models.presets import PRESETS, count_params, get_preset

# Published (model cards): total / non-embedding for dense, total / activated for MoE.
PUBLISHED = {
    "qwen3-0.6b": dict(total=(0.6, 1), non_embedding=(0.44, 2)),
    "qwen3-1.7b": dict(total=(1.7, 1), non_embedding=(1.4, 1)),
    "qwen3-30b-a3b": dict(total=(30.5, 1), active=(3.3, 1)),
    "llama3.1-8b": dict(total=(8.0, 1)),
    "qwen1.5-moe-a2.7b": dict(total=(14.3, 1), active=(2.7, 1)),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_counts(name):
  cfg = PRESETS[name]
  counts = count_params(cfg)
  print(f"{name}: {counts}")
  for field, (billions, digits) in PUBLISHED[name].items():
    scaled = getattr(counts, field) / 1e9 * 10**digits
    # The model cards round (0.596B -> "0.6B") but also truncate (3.35B activated -> "3.3B").
    assert round(billions * 10**digits) in (round(scaled), math.floor(scaled)), (field, counts)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_counts_match_transformers(name):
  # The `hf` extra (torch, transformers) is optional: absent on e.g. the Python 3.12 CI venv.
  torch = need("torch")
  transformers = need("transformers")
  cfg = PRESETS[name]
  counts = count_params(cfg)
  # transformers builds the same architecture from our config.json (on the meta device: no memory).
  hf_cfg = transformers.AutoConfig.for_model(**hf.model_config_to_hf(cfg))
  with torch.device("meta"):
    ref = transformers.AutoModelForCausalLM.from_config(hf_cfg)
  assert counts.total == sum(p.numel() for p in ref.parameters())  # tied lm_head counted once
  assert hf.hf_to_model_config(hf.model_config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("name", ["qwen1.5-moe-a2.7b"])
def test_counts_read_expert_tags_in_either_layout(name):
  """Routed experts are found by their `expert` tag: the scanned layout (dense MLPs stacked 3-D,
  expert stacks 4-D) counts the same active parameters as the unrolled one."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  cfg = PRESETS[name]
  assert count_params(dataclasses.replace(cfg, scan_layers=True)) == count_params(cfg)
  assert count_params(cfg).active < count_params(cfg).total


def test_preset_shapes():
  moe = PRESETS["qwen3-30b-a3b"]
  assert moe.moe_layers == tuple(range(48)) and moe.norm_topk_prob and not moe.tie_embeddings
  assert (moe.n_heads, moe.n_kv_heads, moe.n_experts, moe.n_experts_per_tok, moe.moe_d_ff) == (
      32, 4, 128, 8, 768)
  small = PRESETS["qwen3-0.6b"]
  assert (small.d_model, small.n_layers, small.d_ff, small.tie_embeddings, small.rope_theta) == (
      1024, 28, 3072, True, 1e6)
  assert get_preset("qwen3-1.7b", dtype="bfloat16").dtype == "bfloat16"
  with pytest.raises(ConfigError, match="qwen3-7b"):
    get_preset("qwen3-7b")
