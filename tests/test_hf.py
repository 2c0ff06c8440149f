"""HF checkpoint load / save parity with transformers (torch CPU) on tiny random models of every family
(Qwen3, Qwen3-MoE, Llama 3, Qwen2-MoE)."""
import copy
import json
import os
import re
import shutil
import warnings

import jax
import numpy as np
import pytest
from conftest import need
from flax import nnx

# Parity needs the `hf` extra (torch, transformers): skipped without it locally, required under CI=true.
torch = need("torch")
transformers = need("transformers")
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

from rl_jax.models import hf, safetensors_io
from rl_jax.models.decode import greedy_reference
from rl_jax.sharding import MeshConfig, make_mesh

transformers.utils.logging.disable_progress_bar()
VOCAB = 128
# The plain reference implementations (and the fastest on tiny CPU models).
HF_IMPL = dict(attn_implementation="eager", experts_implementation="eager")
# Logits are O(1-10) here; float32 agreement measured ~1e-6 (see report).
LOGITS_ATOL = 1e-5

# name -> (HF config class, config kwargs, save_pretrained max_shard_size or None)
CASES = {
    # GQA 4q/2kv, head_dim * heads != hidden, theta 1e4, untied, multi-file.
    "dense_untied": ("qwen3", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                                   tie_word_embeddings=False), "12KB"),
    # MQA 4q/1kv, theta 1e6, tied, single file.
    "dense_tied": ("qwen3", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                 tie_word_embeddings=True), None),
    # Dense/MoE interleaving via mlp_only_layers (MoE at 0, 2), norm_topk_prob, multi-file.
    "moe_norm_interleaved": ("qwen3_moe", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        tie_word_embeddings=False), "20KB"),
    # decoder_sparse_step=2 (MoE at 1 only), no top-k renormalization, top-3 of 4, tied.
    "moe_plain_sparse_step": ("qwen3_moe", dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=3,
        moe_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2,
        rope_parameters={"rope_type": "default", "rope_theta": 20_000.0},
        tie_word_embeddings=True), None),
    # Llama 3: no q/k norm, llama3 RoPE scaling (original context 64: of head_dim 16's eight
    # wavelengths some are kept, some blended, some divided), tied, single file.
    "llama3_tied_scaled": ("llama", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), None),
    # Llama 3 untied, plain RoPE, MHA (no GQA), head_dim from hidden / heads, multi-file.
    "llama3_untied": ("llama", dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}), "12KB"),
    # Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert, no top-k renormalization, MoE at 1
    # only (mlp_only_layers), untied, multi-file.
    "qwen2_moe_shared": ("qwen2_moe", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[0],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False), "20KB"),
}
HF_CONFIGS = {"qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "llama": "LlamaConfig",
              "qwen2_moe": "Qwen2MoeConfig"}

# Two rows, the second left-padded by 2: positions and masking are checked too.
TOKENS_BT = np.array([[5, 17, 99, 3, 64, 27, 110, 8], [0, 0, 42, 7, 7, 120, 1, 55]], np.int64)
VALID_BT = np.array([[1] * 8, [0, 0] + [1] * 6], bool)


def _hf_config(model_type, kwargs, dtype=torch.float32):
  cls = getattr(transformers, HF_CONFIGS[model_type])
  return cls(vocab_size=VOCAB, rms_norm_eps=1e-6, max_position_embeddings=256, pad_token_id=0,
             bos_token_id=1, eos_token_id=2, dtype=dtype, **kwargs)


def _make_hf_model(model_type, kwargs, seed=0):
  """A transformers model with every weight random (norms near 1) so any mix-up shows."""
  torch.manual_seed(seed)
  config = _hf_config(model_type, kwargs)
  model = transformers.AutoModelForCausalLM.from_config(config, **HF_IMPL)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  """case -> (directory, in-memory transformers model)."""
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for i, (name, (model_type, kwargs, shard)) in enumerate(CASES.items()):
    model = _make_hf_model(model_type, kwargs, seed=i)
    path = str(root / name)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    out[name] = (path, model)
  return out


def _positions(valid_BT):
  return np.maximum(np.cumsum(valid_BT, axis=1) - 1, 0)


def _hf_forward(model, tokens_BT=TOKENS_BT, valid_BT=VALID_BT):
  """(logits, [per MoE layer: router top-k ids]) from transformers, ids captured at the router."""
  ids = []
  hooks = [m.register_forward_hook(lambda mod, inp, out: ids.append(out[2].clone()))
           for name, m in model.named_modules() if name.endswith("mlp.gate")]
  try:
    with torch.no_grad():
      out = model(torch.tensor(tokens_BT), attention_mask=torch.tensor(valid_BT.astype(np.int64)),
                  position_ids=torch.tensor(_positions(valid_BT)))
  finally:
    for h in hooks:
      h.remove()
  b, t = tokens_BT.shape
  return out.logits.float().numpy(), [x.reshape(b, t, -1).numpy() for x in ids]


@nnx.jit
def _forward(model, tokens_BT, valid_BT):
  out = model(tokens_BT, valid_BS=valid_BT)
  return out.logits_BSV, out.expert_ids_BSLK


def _ours(model, tokens_BT=TOKENS_BT, valid_BT=VALID_BT):
  logits, ids = _forward(model, jax.numpy.asarray(tokens_BT, jax.numpy.int32), jax.numpy.asarray(valid_BT))
  return np.asarray(logits), np.asarray(ids)


def _flat_params(model):
  return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def _assert_bit_equal(a, b):
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert a[k].tobytes() == b[k].tobytes(), k


# ------------------------------------------------------------------------------------------------


def test_config_mapping(ckpts):
  cfg = hf.load_hf_config(ckpts["moe_norm_interleaved"][0])
  assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
      VOCAB, 32, 3, 4, 2, 8)
  assert (cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_d_ff, cfg.norm_topk_prob) == (8, 2, 16, True)
  assert cfg.moe_layers == (0, 2) and cfg.rope_theta == 500_000.0 and not cfg.tie_embeddings
  cfg = hf.load_hf_config(ckpts["moe_plain_sparse_step"][0])
  assert cfg.moe_layers == (1,) and not cfg.norm_topk_prob and cfg.tie_embeddings
  cfg = hf.load_hf_config(ckpts["dense_tied"][0])
  assert cfg.n_experts == 0 and cfg.rope_theta == 1e6 and cfg.tie_embeddings and cfg.n_kv_heads == 1
  # transformers 4.x spelling: num_experts, top-level rope_theta, torch_dtype, no head_dim.
  old = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=8, rope_theta=123.0, rope_scaling=None,
             torch_dtype="bfloat16", mlp_only_layers=[0], tie_word_embeddings=False)
  cfg = hf.hf_to_model_config(old)
  assert (cfg.head_dim, cfg.rope_theta, cfg.dtype, cfg.moe_layers, cfg.norm_topk_prob) == (
      8, 123.0, "bfloat16", (1,), False)
  # Round trip through our own config.json writer.
  assert hf.hf_to_model_config(hf.model_config_to_hf(cfg)) == cfg
  with pytest.raises(hf.CheckpointError, match="rope_scaling"):
    hf.hf_to_model_config({**old, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
  with pytest.raises(hf.CheckpointError, match="num_experts"):
    hf.hf_to_model_config({k: v for k, v in old.items() if k != "num_experts"})


def test_new_family_config_mapping(ckpts):
  """Llama 3 and Qwen2-MoE map to their block switches; our RoPE frequencies are transformers' own
  (llama3 scaling included) to the bit; each family's config.json round-trips."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from rl_jax.models.layers import rope_inv_freq
  cfg = hf.load_hf_config(ckpts["llama3_tied_scaled"][0])
  assert (cfg.family, cfg.qk_norm, cfg.qkv_bias, cfg.tie_embeddings, cfg.rope_scaling) == (
      "llama3", False, False, True, "llama3")
  assert (cfg.rope_factor, cfg.rope_original_max_positions) == (4.0, 64)
  hf_model = ckpts["llama3_tied_scaled"][1]
  theirs = ROPE_INIT_FUNCTIONS["llama3"](hf_model.config, "cpu")[0].numpy()
  ours = rope_inv_freq(cfg)
  np.testing.assert_array_equal(ours, theirs)
  plain = rope_inv_freq(hf.hf_to_model_config({**hf.model_config_to_hf(cfg), "rope_scaling": None,
                                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}))
  assert (ours == plain).sum() not in (0, len(ours))  # scaling moved some frequencies, kept others
  cfg = hf.load_hf_config(ckpts["qwen2_moe_shared"][0])
  assert (cfg.family, cfg.qk_norm, cfg.qkv_bias, cfg.shared_expert_d_ff, cfg.norm_topk_prob) == (
      "qwen2_moe", False, True, 24, False)
  assert cfg.moe_layers == (1,) and not cfg.tie_embeddings
  for case in ("llama3_tied_scaled", "llama3_untied", "qwen2_moe_shared"):
    cfg = hf.load_hf_config(ckpts[case][0])
    assert hf.hf_to_model_config(hf.model_config_to_hf(cfg)) == cfg, case
  with pytest.raises(hf.CheckpointError, match="attention_bias"):
    hf.hf_to_model_config({**hf.model_config_to_hf(hf.load_hf_config(ckpts["llama3_untied"][0])),
                           "attention_bias": True})


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_expert_ids_match_transformers(ckpts, case):
  path, hf_model = ckpts[case]
  if CASES[case][2]:
    assert os.path.exists(os.path.join(path, hf.INDEX_FILE))  # really multi-file
  model = hf.load_hf_model(path)
  logits, ids_BTLK = _ours(model)
  ref_logits, ref_ids = _hf_forward(hf_model)
  diff = np.abs(logits - ref_logits)[VALID_BT].max()
  print(f"{case}: max |logits - transformers| = {diff:.3g}")
  assert diff < LOGITS_ATOL
  cfg = model.cfg
  assert ids_BTLK.shape[2] == cfg.n_moe_layers == len(ref_ids)
  for layer in range(cfg.n_moe_layers):
    np.testing.assert_array_equal(ids_BTLK[:, :, layer][VALID_BT], ref_ids[layer][VALID_BT])


@pytest.mark.parametrize("case", ["dense_untied", "moe_norm_interleaved", "llama3_tied_scaled",
                                  "qwen2_moe_shared"])
def test_greedy_matches_transformers_generate(ckpts, case):
  path, hf_model = ckpts[case]
  model = hf.load_hf_model(path)
  prompts, valid = TOKENS_BT[:, :6], VALID_BT[:, :6]
  n_new = 8

  def hf_generate(eos):
    with torch.no_grad():
      out = hf_model.generate(torch.tensor(prompts), attention_mask=torch.tensor(valid.astype(np.int64)),
                              max_new_tokens=n_new, do_sample=False, eos_token_id=eos,
                              pad_token_id=0)
    new = out[:, prompts.shape[1]:].numpy()
    return np.pad(new, ((0, 0), (0, n_new - new.shape[1])), constant_values=0)

  ours = greedy_reference(model, prompts, valid, n_new, eos_id=VOCAB + 1, pad_id=0)  # no eos
  np.testing.assert_array_equal(ours, hf_generate(None))
  # Again with an eos that row 0 emits mid-way: both stop that row and pad it.
  eos = int(ours[0, 3])
  ours_eos = greedy_reference(model, prompts, valid, n_new, eos_id=eos, pad_id=0)
  np.testing.assert_array_equal(ours_eos, hf_generate(eos))
  assert (ours_eos[0, 4:] == 0).all()


def test_sharded_load_equals_unsharded(ckpts, tmp_path, monkeypatch):
  path, _ = ckpts["moe_norm_interleaved"]
  mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
  blocks = []
  read_slice = hf._read_slice  # pylint: disable=protected-access

  def spy(reader, kind, refs, index, f_dim):
    out = read_slice(reader, kind, refs, index, f_dim)
    blocks.append((kind, out.shape))
    return out

  monkeypatch.setattr(hf, "_read_slice", spy)
  sharded = hf.load_hf_model(path, mesh=mesh)
  monkeypatch.undo()
  # Streaming: expert stacks [8, 32, 16] are only ever read as one device's [4, 16, 8] block.
  expert_blocks = {shape for kind, shape in blocks if kind == "experts"}
  assert expert_blocks == {(4, 16, 8), (4, 8, 16)}
  plain = hf.load_hf_model(path)
  _assert_bit_equal(_flat_params(sharded), _flat_params(plain))
  w_up = sharded.layers[0].ffn.w_up.get_value()
  assert w_up.sharding.spec == jax.sharding.PartitionSpec("expert", "fsdp", "tensor")
  assert w_up.addressable_shards[0].data.shape == (4, 16, 8)
  logits, ids = _ours(sharded)
  ref_logits, ref_ids = _ours(plain)
  # Sharded matmuls reduce in another order: equal up to float32 rounding.
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(ids, ref_ids)
  # Saving gathers the shards: same files as from the unsharded model.
  hf.save_hf_checkpoint(sharded, str(tmp_path / "a"), max_shard_bytes=16_000)
  hf.save_hf_checkpoint(plain, str(tmp_path / "b"), max_shard_bytes=16_000)
  for f in os.listdir(tmp_path / "a"):
    assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


@pytest.mark.parametrize("case", ["dense_tied", "moe_norm_interleaved", "llama3_untied", "qwen2_moe_shared"])
def test_save_round_trip_and_transformers_reload(ckpts, case, tmp_path):
  path, hf_model = ckpts[case]
  model = hf.load_hf_model(path)
  out = str(tmp_path / "saved")
  written = hf.save_hf_checkpoint(model, out, max_shard_bytes=16_000)
  assert hf.INDEX_FILE in written and len([f for f in written if f.endswith(".safetensors")]) > 1
  # rl_jax -> rl_jax: bit-exact.
  _assert_bit_equal(_flat_params(hf.load_hf_model(out)), _flat_params(model))
  # Same tensors, names (hub per-expert layout) and bits as transformers wrote.
  ours = {}
  for f in written:
    if f.endswith(".safetensors"):
      ours.update(torch_load_file(os.path.join(out, f)))
  theirs = {}
  for f in os.listdir(path):
    if f.endswith(".safetensors"):
      theirs.update(torch_load_file(os.path.join(path, f)))
  assert ours.keys() == theirs.keys()
  for k in theirs:
    assert torch.equal(ours[k], theirs[k]), k
  # transformers loads what we wrote and agrees with us.
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                               **HF_IMPL)
  diff = np.abs(_hf_forward(reloaded)[0] - _ours(model)[0])[VALID_BT].max()
  assert diff < LOGITS_ATOL
  with pytest.raises(FileExistsError):
    hf.save_hf_checkpoint(model, out)
  hf.save_hf_checkpoint(model, out, overwrite=True)  # single file replaces the shards
  assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]
  _assert_bit_equal(_flat_params(hf.load_hf_model(out)), _flat_params(model))


def test_fused_expert_layout_loads(ckpts, tmp_path):
  """transformers >= 5's in-memory layout (experts.gate_up_proj / down_proj), e.g. a raw state_dict dump."""
  path, hf_model = ckpts["moe_plain_sparse_step"]
  state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
  assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
  fused = tmp_path / "fused"
  fused.mkdir()
  shutil.copy(os.path.join(path, "config.json"), fused / "config.json")
  torch_save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
  _assert_bit_equal(_flat_params(hf.load_hf_model(str(fused))), _flat_params(hf.load_hf_model(path)))


def test_bfloat16_checkpoint(ckpts, tmp_path):
  path, hf_model = ckpts["moe_norm_interleaved"]
  bf16_dir = str(tmp_path / "bf16")
  # A copy: .to() would also round the shared fixture model's RoPE inv_freq buffer.
  copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(bf16_dir)
  assert hf.load_hf_config(bf16_dir).dtype == "bfloat16"
  # Stored bf16: bits equal the file; the float32 router holds the exact upcast.
  model = hf.load_hf_model(bf16_dir)
  params = _flat_params(model)
  file = torch_load_file(os.path.join(bf16_dir, "model.safetensors"))
  emb = file["model.embed_tokens.weight"].view(torch.int16).numpy()
  assert params["embedding"].dtype == jax.numpy.bfloat16
  assert params["embedding"].view(np.int16).tobytes() == emb.tobytes()
  router = file["model.layers.2.mlp.gate.weight"].float().numpy().T
  assert params["layers/2/ffn/w_router"].tobytes() == router.tobytes()
  # bf16 -> save -> same file bits.
  out = str(tmp_path / "bf16_saved")
  hf.save_hf_checkpoint(model, out)
  again = torch_load_file(os.path.join(out, "model.safetensors"))
  assert again.keys() == file.keys()
  for k in file:
    assert again[k].dtype == torch.bfloat16 and torch.equal(again[k], file[k]), k
  # Upcast on load: float32 parity with transformers reading the same bf16 file as float32.
  model32 = hf.load_hf_model(bf16_dir, dtype="float32")
  ref = transformers.AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32,
                                                          **HF_IMPL)
  diff = np.abs(_ours(model32)[0] - _hf_forward(ref)[0])[VALID_BT].max()
  assert diff < LOGITS_ATOL


# --- errors name the tensor / key and the file -------------------------------------------------


def _copy_single_file(ckpts, tmp_path):
  src, _ = ckpts["moe_plain_sparse_step"]
  dst = tmp_path / "ckpt"
  shutil.copytree(src, dst)
  return dst, torch_load_file(str(dst / "model.safetensors"))


def test_error_missing_tensor(ckpts, tmp_path):
  dst, tensors = _copy_single_file(ckpts, tmp_path)
  name = "model.layers.1.mlp.experts.2.up_proj.weight"
  del tensors[name]
  torch_save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError, match=rf"missing tensor '{name}'.*model\.safetensors"):
    hf.load_hf_model(str(dst))


def test_error_unexpected_tensor(ckpts, tmp_path):
  dst, tensors = _copy_single_file(ckpts, tmp_path)
  tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
  torch_save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointError,
                     match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' in file "
                           r"'model\.safetensors'"):
    hf.load_hf_model(str(dst))


def test_error_shape_mismatch(ckpts, tmp_path):
  dst, _ = _copy_single_file(ckpts, tmp_path)
  cfg = json.loads((dst / "config.json").read_text())
  cfg["intermediate_size"] = 41  # dense layer 0 was saved with 40
  (dst / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf.CheckpointError,
                     match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' in file "
                           r"'model\.safetensors' has shape \[40, 32\].*\[41, 32\]"):
    hf.load_hf_model(str(dst))


def test_error_unsupported_model_type(ckpts, tmp_path):
  dst, _ = _copy_single_file(ckpts, tmp_path)
  cfg = json.loads((dst / "config.json").read_text())
  cfg["model_type"] = "gpt2"
  (dst / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf.CheckpointError, match=r"config\.json: key 'model_type' = 'gpt2'"):
    hf.load_hf_model(str(dst))


def test_error_index_points_to_missing_file(ckpts, tmp_path):
  src, _ = ckpts["dense_untied"]
  dst = tmp_path / "ckpt"
  shutil.copytree(src, dst)
  victim = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))[-1]
  os.remove(dst / victim)
  with pytest.raises(hf.CheckpointError, match=rf"'{victim}', which does not exist"):
    hf.load_hf_model(str(dst))


def test_error_truncated_safetensors_names_file_and_tensor(ckpts, tmp_path):
  dst, _ = _copy_single_file(ckpts, tmp_path)
  file = dst / "model.safetensors"
  refs = safetensors_io.read_header(str(file))
  last = max(refs.values(), key=lambda r: r.end)  # the tensor whose bytes a cut copy loses
  with open(file, "r+b") as f:
    f.truncate(last.begin + 4)  # inside its data
  with pytest.raises(hf.CheckpointError,
                     match=rf"model\.safetensors: tensor '{re.escape(last.name)}' needs bytes "
                           rf"\[{last.begin}, {last.end}\).*only {last.begin + 4} bytes"):
    hf.load_hf_model(str(dst))


@pytest.mark.parametrize("key, value, kind", [("hidden_size", "forty", "an integer"),
                                              ("num_hidden_layers", 2.5, "an integer"),
                                              ("rms_norm_eps", "1e-6", "a number")])
def test_error_non_numeric_config_field_names_the_key(ckpts, tmp_path, key, value, kind):
  dst, _ = _copy_single_file(ckpts, tmp_path)
  cfg = json.loads((dst / "config.json").read_text())
  cfg[key] = value
  (dst / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf.CheckpointError,
                     match=rf"config\.json: key '{key}' = {re.escape(repr(value))} is not {kind}"):
    hf.load_hf_model(str(dst))


def _tied_with_head(ckpts, tmp_path, head_of):
  """The tied MoE checkpoint re-saved with an explicit lm_head.weight = head_of(embedding)."""
  dst, tensors = _copy_single_file(ckpts, tmp_path)
  assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"]
  assert "lm_head.weight" not in tensors
  tensors["lm_head.weight"] = head_of(tensors["model.embed_tokens.weight"])
  torch_save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  return dst


def test_tied_config_with_different_head_loads_untied_like_transformers(ckpts, tmp_path):
  torch.manual_seed(7)
  dst = _tied_with_head(ckpts, tmp_path, lambda emb: 0.15 * torch.randn_like(emb))
  with pytest.warns(UserWarning, match=r"tie_word_embeddings=true, but tensor 'lm_head\.weight' "
                                       r".*differs from 'model\.embed_tokens\.weight'"):
    model = hf.load_hf_model(str(dst))
  assert not model.cfg.tie_embeddings
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(dst), **HF_IMPL).eval()
  # transformers keeps the file's head too (the behaviour matched here).
  assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)
  logits, _ = _ours(model)
  ref_logits, _ = _hf_forward(ref)
  assert np.abs(logits - ref_logits)[VALID_BT].max() < LOGITS_ATOL
  # A tied load would be far off: the check above can fail.
  tied_logits, _ = _hf_forward(ckpts["moe_plain_sparse_step"][1])
  assert np.abs(logits - tied_logits)[VALID_BT].max() > 100 * LOGITS_ATOL


def test_tied_config_with_identical_head_loads_tied_silently(ckpts, tmp_path):
  dst = _tied_with_head(ckpts, tmp_path, lambda emb: emb.clone())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    model = hf.load_hf_model(str(dst))
  assert model.cfg.tie_embeddings
  logits, _ = _ours(model)
  ref_logits, _ = _hf_forward(ckpts["moe_plain_sparse_step"][1])
  assert np.abs(logits - ref_logits)[VALID_BT].max() < LOGITS_ATOL


# --- tokenizer ------------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  """A tiny byte-level BPE tokenizer in the Qwen3 file layout (no bos token, two eos ids)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["Using the numbers [3, 5, 7], create an equation that equals 22.",
                           "<answer> (3 + 5) * 7 - 34 </answer>", "hello world"] * 4, trainer)
  path = tmp_path_factory.mktemp("tok")
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
      "eos_token": "<|im_end|>",
      "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
      "chat_template": CHAT_TEMPLATE}))
  ids = {s: tok.token_to_id(s) for s in specials}
  (path / "generation_config.json").write_text(json.dumps({
      "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
  return str(path), ids


def test_hf_tokenizer_matches_transformers(tok_dir):
  from rl_jax.tasks.hf_tokenizer import HFTokenizer
  from rl_jax.tasks.tokenizer import Tokenizer
  path, ids = tok_dir
  tok = HFTokenizer.from_dir(path)
  ref = transformers.AutoTokenizer.from_pretrained(path)
  assert isinstance(tok, Tokenizer)
  assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.has_bos) == (
      ids["<|im_end|>"], ids["<|endoftext|>"], ids["<|endoftext|>"], False)
  assert tok.eos_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
  assert tok.vocab_size == len(ref)
  messages = [{"role": "user", "content": "Using the numbers [3, 5], make 8."}]
  for kw in ({}, {"enable_thinking": False}):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, **kw)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
  for text in ["hello world", "héllo wörld 12+3 ✓", text, "<answer> 8 </answer>"]:
    enc = tok.encode(text)
    assert enc == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(enc) == text.split("<|im_end|>")[0]  # decoding stops at eos
  assert tok.encode("<|im_start|>user")[0] == ids["<|im_start|>"]  # added tokens match whole
  # CharTokenizer's decode rules: skip left padding, stop at eos, U+FFFD off-vocabulary.
  hello = tok.encode("hello")
  assert tok.decode([tok.pad_id] * 3 + hello + [tok.eos_id] + tok.encode(" world")) == "hello"
  assert tok.decode(hello + [ids["<|endoftext|>"]] + hello) == "hello"  # second eos id
  assert tok.decode(hello + [10_000] + hello) == "hello\ufffdhello"
  batch, lengths = tok.encode_batch(["hello", "hello world"], max_len=8, add_eos=True)
  assert batch.shape == (2, 8) and lengths.tolist() == [len(hello) + 1, len(tok.encode("hello world")) + 1]
  assert tok.decode_batch(batch) == ["hello", "hello world"]
