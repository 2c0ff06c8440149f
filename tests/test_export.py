"""`python -m rl_jax.export`: a run's policy as an HF checkpoint that transformers loads with the run's
logits, the source's config.json carried over key for key, its tokenizer and generation config copied."""
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from conftest import need
from flax import nnx

torch = need("torch")
transformers = need("transformers")

from rl_jax import export as export_lib
from rl_jax import workdir as wd
from rl_jax.checkpoint import Checkpointer
from rl_jax.models import families, hf
from rl_jax.tasks import arith

transformers.utils.logging.disable_progress_bar()
HF_IMPL = dict(attn_implementation="eager", experts_implementation="eager")
# As tests/test_hf.py: float32 logits of O(1-10) agree to ~1e-6 between the two implementations.
LOGITS_ATOL = 1e-5
TOKENS_BT = np.array([[5, 17, 99, 3, 64, 27, 110, 8], [9, 1, 42, 7, 7, 120, 1, 55]], np.int64)

# A held-out-style config.json per family, as the hub's checkpoints spell them (scaled down): keys no
# ModelConfig field maps to (bos / eos ids, max_position_embeddings, layer_types, max_window_layers,
# transformers_version, ...) and the router coefficient the run's own may differ from.
_COMMON = dict(attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
               hidden_size=32, initializer_range=0.02, intermediate_size=48, max_position_embeddings=2048,
               num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-6,
               rope_scaling=None, rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
               transformers_version="4.51.0", use_cache=True, vocab_size=128)
HELD_OUT = {
    "qwen3": dict(_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
                  head_dim=8, max_window_layers=28, sliding_window=None, use_sliding_window=False,
                  layer_types=["full_attention", "full_attention"]),
    "qwen3_moe": dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False,
                      head_dim=8, max_window_layers=48, sliding_window=None, use_sliding_window=False,
                      decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=16, norm_topk_prob=True,
                      num_experts=4, num_experts_per_tok=2, output_router_logits=False, router_aux_loss_coef=0.001),
    "llama": dict(_COMMON, architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                  mlp_bias=False, pretraining_tp=1, head_dim=8, eos_token_id=[128001, 128008, 128009],
                  rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 64, "rope_type": "llama3"}),
    "qwen2_moe": dict(_COMMON, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", max_window_layers=21,
                      sliding_window=32768, use_sliding_window=False, decoder_sparse_step=1, mlp_only_layers=[],
                      moe_intermediate_size=16, shared_expert_intermediate_size=24, norm_topk_prob=False,
                      num_experts=4, num_experts_per_tok=2, output_router_logits=False, router_aux_loss_coef=0.001),
}


@pytest.mark.parametrize("model_type", list(HELD_OUT))
def test_each_familys_config_round_trips_with_every_source_key(model_type, tmp_path):
  """The source's config.json comes back whole, only the dtype the tensors are written in changed;
  a run that changed the model (here its RoPE base) changes those keys alone. save_hf_checkpoint
  used to regenerate the file: max_position_embeddings 2048 -> 40960, no bos / eos ids, no
  layer_types or max_window_layers, the router coefficient replaced by the run's."""
  source = HELD_OUT[model_type]
  run = hf.hf_to_model_config(source, router_aux_loss_coef=0.0, dtype="float32")   # the run's own coefficient
  carried = export_lib.carry_config(source, run, run, "float32")
  assert carried == dict(source, torch_dtype="float32")
  graphdef, state = nnx.split(families.abstract_model(run))   # the values do not matter here
  model = nnx.merge(graphdef, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state))
  hf.save_hf_checkpoint(model, str(tmp_path), config=carried)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written == carried
  assert hf.load_hf_config(str(tmp_path), router_aux_loss_coef=0.0) == run
  changed = dataclasses.replace(run, rope_theta=5e5)
  diff = {k for k, v in export_lib.carry_config(source, run, changed, "bfloat16").items() if source.get(k) != v}
  # (A scaled RoPE's rope_scaling holds the base too.)
  assert diff == {"rope_theta", "rope_parameters"} | ({"rope_scaling"} if source["rope_scaling"] else set()), diff
  with pytest.raises(ValueError, match="does not describe this model"):
    hf.save_hf_checkpoint(model, str(tmp_path / "x"), config=dict(carried, hidden_size=64))


def _write_run(workdir, config, params, step):
  """A workdir as a run leaves it: run.json (its config) and a checkpoint of `params` at `step`."""
  run = wd.RunDir.open(workdir, config)
  run.close()
  ckpt = Checkpointer(workdir)
  ckpt.save(step, {"params": params}, {"step": step, "job": "rl"})
  ckpt.close()


def _logits(model, tokens_BT=TOKENS_BT):
  out = nnx.jit(lambda m, t: m(t, valid_BS=jax.numpy.ones(t.shape, bool)).logits_BSV)(
      model, jax.numpy.asarray(tokens_BT, jax.numpy.int32))
  return np.asarray(out)


def _hf_logits(path):
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **HF_IMPL).eval()
  with torch.no_grad():
    return model(torch.tensor(TOKENS_BT)).logits.float().numpy()


def test_export_of_a_run_loads_in_transformers_with_the_runs_logits(tmp_path, capsys):
  """A run warm-started from an HF Qwen3-MoE checkpoint (its weights moved, as training moves them)
  exported with `python -m rl_jax.export`: sharded safetensors, the source's config.json key for key,
  its generation config, tokenizer and chat template byte for byte, and transformers' logits equal to
  the run's to float32 rounding."""
  torch.manual_seed(0)
  src = str(tmp_path / "source")
  kwargs = {k: v for k, v in HELD_OUT["qwen3_moe"].items()
            if k not in ("architectures", "model_type", "transformers_version", "torch_dtype")}
  config = transformers.Qwen3MoeConfig(**dict(kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                                       dtype=torch.float32)
  hf_model = transformers.AutoModelForCausalLM.from_config(config, **HF_IMPL)
  with torch.no_grad():
    for name, p in hf_model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
  hf_model.save_pretrained(src, max_shard_size="20KB")
  transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0, temperature=0.6,
                                top_p=0.95, do_sample=True).save_pretrained(src)
  arith.train_tokenizer(["Ann has 3 pens.", "What is 2+3?"], src, vocab_size=300)
  (tmp_path / "source" / "chat_template.jinja").write_text(arith.CHAT_TEMPLATE)

  model = hf.load_hf_model(src)
  graphdef, state = nnx.split(model)
  params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype),
                        nnx.to_pure_dict(state))   # what training moves
  run_cfg = dataclasses.asdict(model.cfg)
  workdir = str(tmp_path / "run")
  _write_run(workdir, {"job": "rl", "model": run_cfg, "warm_start": {"source": "hf", "path": src},
                       "sampler": {"eos_id": 2, "pad_id": 0}}, params, 7)

  out = str(tmp_path / "export")
  assert export_lib.main([f"--workdir={workdir}", f"--out={out}", "--max_shard_gb=0.00002"]) == 0
  assert "step 7 of" in capsys.readouterr().out
  files = os.listdir(out)
  assert hf.INDEX_FILE in files and sum(f.endswith(".safetensors") for f in files) > 1
  source_json = json.loads(open(os.path.join(src, "config.json")).read())
  assert json.loads(open(os.path.join(out, "config.json")).read()) == source_json
  for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    assert open(os.path.join(out, name), "rb").read() == open(os.path.join(src, name), "rb").read(), name

  ours = _logits(nnx.merge(graphdef, params))
  theirs = _hf_logits(out)
  diff = float(np.abs(ours - theirs).max())
  print(f"export parity: max |logits(transformers, export) - logits(run)| = {diff:.3g}")
  assert diff < LOGITS_ATOL
  assert float(np.abs(ours - _logits(model)).max()) > 100 * LOGITS_ATOL   # the run's weights, not the source's
  reloaded = nnx.to_pure_dict(nnx.state(hf.load_hf_model(out)))
  for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # A run without an HF source: the family's config.json with the sampler's eos / pad ids, the task's
  # tokenizer, a generation config with those ids.
  scratch = str(tmp_path / "scratch")
  _write_run(scratch, {"job": "rl", "model": run_cfg, "warm_start": {"source": "none"},
                       "sampler": {"eos_id": 2, "pad_id": 0}, "task": {"overrides": {"tokenizer": src}}}, params, 3)
  out2 = str(tmp_path / "export2")
  summary = export_lib.export(scratch, out2)
  assert summary["step"] == 3 and summary["source"] is None
  written = json.loads(open(os.path.join(out2, "config.json")).read())
  assert (written["eos_token_id"], written["pad_token_id"]) == (2, 0)
  assert json.loads(open(os.path.join(out2, "generation_config.json")).read()) == {"eos_token_id": 2,
                                                                                   "pad_token_id": 0}
  assert os.path.exists(os.path.join(out2, "chat_template.jinja"))
  np.testing.assert_array_less(np.abs(_hf_logits(out2) - ours), LOGITS_ATOL)


def test_export_errors_are_one_line(tmp_path, capsys):
  rc = None
  try:
    export_lib.main([f"--workdir={tmp_path}", f"--out={tmp_path}/o"])
  except SystemExit as e:
    rc = e.code
  err = capsys.readouterr().err
  assert rc == 2 and err == f"python -m rl_jax.export: error: --workdir={tmp_path}: no run.json (not an rl_jax run " \
                            "directory)\n", err
