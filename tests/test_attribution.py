"""Per-source mismatch attribution (rl.attribution_every): each variant against an oracle of plain forwards."""
import dataclasses
import functools

import jax
import numpy as np
import pytest
from conftest import ragged_prompts
from flax import nnx

from rl_jax.config_utils import ConfigError
from rl_jax.configs import countdown_tiny
from rl_jax.logprobs import next_token_logq
from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.quant.config import QuantConfig
from rl_jax.rl import mismatch_attribution as attribution
from rl_jax.rl.job import RLJob
from rl_jax.rollout import response_slice
from rl_jax.sampler import generate as gen
from rl_jax.sampler import weights as sw
from rl_jax.sampler.config import SamplerConfig

V, P, T = 64, 8, 10

pytestmark = pytest.mark.usefixtures("fast_compile")


def _model(moe: bool):
  cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                    n_experts=4 if moe else 0, n_experts_per_tok=2, moe_d_ff=32, init_std=0.2,
                    tie_embeddings=False)
  return cfg, *nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))


def _prompts():
  return ragged_prompts(V, P)


def _run(moe: bool, quant="none", noise=0.0, stale=False):
  """(raw attribution, variants, rollout, the pieces the oracles need) of one sampler setting."""
  mcfg, graphdef, params = _model(moe)
  scfg = SamplerConfig(max_prompt_len=P, max_new_tokens=T, record_topk=0, eos_id=1, quant=quant,
                       noise="relative" if noise else "none", noise_sigma=noise, decode_phases=2, min_phase_steps=4)
  delta = sw.make_noise(params, scfg.noise, noise, jax.random.key(7)) if noise else None
  # The stale weights the sampler was synced from: the reference moved away from them since.
  src = (jax.tree.map(lambda w, d: w + d, params, sw.make_noise(params, "relative", 0.05, jax.random.key(9)))
         if stale else params)
  ro = gen.generate(sw.sampler_graphdef(mcfg, "float32"), sw.sync_weights(src, delta, scfg.quant, "float32"),
                    *_prompts(), jax.random.key(0), scfg)
  found = attribution.variants(scfg, "float32", stale=stale, moe=moe)
  graphs = tuple((n, v, sw.sampler_graphdef(mcfg, v.dtype)) for n, v in found.items())
  fn = jax.jit(functools.partial(attribution.attribute, graphdef=graphdef, variant_graphs=graphs, temperature=1.0))
  raw = attribution.to_host(fn(params, src if stale else None, delta, ro))
  return raw, found, ro, dict(mcfg=mcfg, graphdef=graphdef, params=params, src=src, delta=delta)


@functools.partial(jax.jit, static_argnums=0)
def _logq_BSV(graphdef, weights, ro):
  """A plain forward's next-token log q (no cache), jitted: eagerly every op compiles its own program."""
  return next_token_logq(nnx.merge(graphdef, weights)(ro.tokens_BS, ro.positions_BS, ro.valid_BS).logits_BSV, 1.0)


def _oracle(ctx, ro, weights, graphdef=None):
  """KL(q || p) and TV over V, averaged over response tokens, from two plain forwards (no cache)."""
  fwd = lambda g, w: response_slice(_logq_BSV(g, w, ro), ro)
  logp, logq = fwd(ctx["graphdef"], ctx["params"]), fwd(graphdef or ctx["graphdef"], weights)
  q, p = np.exp(np.asarray(logq, np.float64)), np.exp(np.asarray(logp, np.float64))
  mask = np.asarray(ro.response_mask_BT)
  kl = (q * (np.asarray(logq, np.float64) - np.asarray(logp, np.float64))).sum(-1)
  tv = 0.5 * np.abs(q - p).sum(-1)
  return kl[mask].mean(), tv[mask].mean()


@pytest.mark.parametrize("moe", [pytest.param(False, id="dense", marks=pytest.mark.slow), pytest.param(True, id="moe")])
def test_clean_sampler_attributes_nothing(moe):
  raw, found, _, _ = _run(moe)
  assert set(found) == ({"total", attribution.TRAINER_ROUTES} if moe else {"total"})
  tot = raw["total"]
  # fp32 on both sides: the one-pass teacher forcing differs from the trainer by rounding only.
  assert 0.0 <= tot["kl"] < 1e-7 and tot["tv"] < 1e-5 and abs(tot["k1"]) < 1e-6
  assert tot["logq_err_max"] < attribution.LOGQ_ROUNDING and tot["logq_err_frac"] == 0.0
  if moe:
    assert tot["routing_agreement"] == 1.0


def test_each_source_matches_its_oracle():
  """int8 W+A with an int4 KV cache, relative weight noise and stale weights on an MoE model: each
  one-source variant equals the divergence of plain forwards with that source alone (the weight
  sources need no cache; the KV source is the only one the cache changes), and the teacher-forced
  total reproduces the sampler's recorded log q."""
  raw, found, ro, ctx = _run(True, quant="int8_wa_int4_kv", noise=0.1, stale=True)
  assert list(found) == ["weights", "weights+activations", "kv", "noise", "staleness", "total",
                         attribution.TRAINER_ROUTES]
  q = found["total"].quant
  fp32 = sw.sampler_graphdef(ctx["mcfg"], "float32")
  oracles = {
      "weights": sw.sync_weights(ctx["params"], None, QuantConfig(weights=q.weights), "float32"),
      "weights+activations": sw.sync_weights(ctx["params"], None, QuantConfig(weights=q.weights,
                                                                               activations=q.activations), "float32"),
      "noise": sw.sync_weights(ctx["params"], ctx["delta"], None, "float32"),
      "staleness": ctx["src"]}
  for name, weights in oracles.items():
    kl, tv = _oracle(ctx, ro, weights, fp32)
    assert kl > 1e-6, name   # every source here does mismatch
    np.testing.assert_allclose(raw[name]["kl"], kl, rtol=2e-3, atol=2e-8, err_msg=name)
    np.testing.assert_allclose(raw[name]["tv"], tv, rtol=2e-3, atol=2e-7, err_msg=name)
  assert raw["kv"]["kl"] > 1e-6   # int4 keys and values: the cache is where this one comes from
  # The teacher forcing reproduces the recorded log q to float rounding at all but a few tokens;
  # the rest sit one quantizer step away: an int4 KV value or int8 activation whose input the
  # one-pass forward and the token-by-token decode round differently lands on the other side of a
  # rounding boundary (on an AMD EPYC box: one token of 28 at 4.1e-4, none past 1.7e-6 with an int8
  # cache). A wrong cache, weight or position would move most tokens.
  assert raw["total"]["logq_err_frac"] <= 0.1, raw["total"]
  assert raw["total"]["logq_err_max"] < 1e-2, raw["total"]
  # The total's k1 at the sampled tokens is the run's mismatch/kl_k1 on these rows.
  mask = np.asarray(ro.response_mask_BT)
  logp = response_slice(_logq_BSV(ctx["graphdef"], ctx["params"], ro), ro)
  logp_y = np.take_along_axis(np.asarray(logp), np.asarray(ro.response_BT)[..., None], -1)[..., 0]
  # |mean of two per-token log q's difference| <= the rounding share + the quantizer-step tokens' share.
  tot = raw["total"]
  np.testing.assert_allclose(tot["k1"], (np.asarray(ro.logq_BT) - logp_y)[mask].mean(),
                             atol=attribution.LOGQ_ROUNDING + tot["logq_err_frac"] * tot["logq_err_max"])
  m = attribution.contributions(raw)
  for k in ("kl", "tv"):
    assert m[f"attribution/routing/{k}"] == pytest.approx(raw["total"][k] - raw[attribution.TRAINER_ROUTES][k])
  assert 0.0 < m["attribution/total/routing_agreement"] < 1.0


def test_one_source_alone_has_no_interaction():
  raw, found, _, _ = _run(False, noise=0.1)
  assert list(found) == ["noise", "total"]
  m = attribution.contributions(raw)
  assert m["attribution/noise/kl"] > 1e-5
  assert m["attribution/sum/kl"] == m["attribution/total/kl"]
  assert m["attribution/interaction/kl"] == 0.0 and m["attribution/interaction/tv"] == 0.0


def test_contributions_closed_form():
  st = lambda kl, tv, k1=0.0, k3=0.0: dict(kl=kl, tv=tv, k1=k1, k3=k3)
  raw = {"weights": st(0.1, 0.2, 0.3, 0.4), "weights+activations": st(0.25, 0.3, 0.5, 0.6),
         "kv": st(0.05, 0.1), "total": dict(st(0.5, 0.5), logq_err_max=1e-7),
         attribution.TRAINER_ROUTES: st(0.35, 0.45)}
  m = attribution.contributions(raw)
  assert m["attribution/activations/kl"] == pytest.approx(0.15)
  assert m["attribution/activations/k1"] == pytest.approx(0.2)
  assert m["attribution/sum/kl"] == pytest.approx(0.1 + 0.15 + 0.05)
  assert m["attribution/interaction/kl"] == pytest.approx(0.5 - 0.3)
  assert m["attribution/interaction/tv"] == pytest.approx(0.5 - (0.2 + 0.1 + 0.1))
  assert m["attribution/routing/kl"] == pytest.approx(0.15)
  assert m["attribution/total/logq_err_max"] == 1e-7
  assert attribution.sources(m)[:3] == ["weights", "activations", "kv"]
  assert not any(k.startswith(f"attribution/{attribution.TRAINER_ROUTES}") for k in m)


@pytest.mark.parametrize("override,key", [
    ({"rl.mode": "async", "mesh.sampler_devices": 0}, "rl.attribution_every"),
    ({"rl.attribution_rows": 10_000}, "rl.attribution_rows"),
    ({"rl.attribution_every": -1}, "rl.attribution_every")])
def test_attribution_config_errors_name_the_key(override, key):
  cfg = countdown_tiny.get_config("test")
  cfg.rl.attribution_every = 1
  for k, v in override.items():
    section, name = k.split(".")
    cfg[section][name] = v
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    RLJob.from_config(cfg)


# Builds a trainer and compiles the step's programs and the attribution: minutes on 2 busy cores.
@pytest.mark.slow
def test_trainer_logs_attribution_of_the_run_sources(tmp_path):
  from rl_jax.study import sweeps
  from rl_jax.rl import trainer as trainer_lib
  cfg = countdown_tiny.get_config("test")
  cfg.warm_start.source = "none"
  cfg = sweeps.apply_overrides(cfg, {"rl.attribution_every": 2, "rl.staleness": 2, "rl.meter_every": 0,
                                     "sampler.noise": "relative", "sampler.noise_sigma": 0.05})
  tr = trainer_lib.RLTrainer(cfg, str(tmp_path))
  rows = tr.job.rl.prompts_per_step * tr.job.rl.group_size
  tr.job = dataclasses.replace(tr.job, rl=dataclasses.replace(tr.job.rl, attribution_rows=rows))
  assert not any(k.startswith("attribution/") for k in tr.train_step(0))
  row = tr.train_step(1)   # step 2: attributed, the sampler one sync behind
  names = [n for n, _, _ in tr.programs.learner.attribution_variants]
  assert names == ["noise", "staleness", "total", attribution.TRAINER_ROUTES]   # the :test sampler is fp32
  assert row["attribution/staleness/kl"] > 0 and row["time/attribution_s"] > 0
  # Over every row of the step, the teacher-forced total is the run's own mismatch meter.
  assert row["attribution/total/k1"] == pytest.approx(row["mismatch/kl_k1"], rel=1e-3, abs=1e-6)
  assert row["attribution/total/logq_err_max"] < 1e-4
  tr.close()


def test_analysis_reads_tables_and_plots_attribution(tmp_path):
  import json
  from rl_jax.analysis import attribution_report as analysis_attr
  from rl_jax.analysis import group_runs, load_runs
  from rl_jax.rl import plots
  for seed, scale in ((0, 1.0), (1, 3.0)):
    d = tmp_path / "run" / f"seed{seed}"
    d.mkdir(parents=True)
    rows = [{"step": s, "reward": 0.0, "attribution/total/kl": scale * s, "attribution/kv/kl": scale,
             "attribution/weights/kl": 2 * scale, "attribution/interaction/kl": -scale} for s in (1, 2, 3)]
    rows.insert(1, {"step": 0, "eval_greedy_accuracy": 0.1})   # a row without attribution is skipped
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  runs = load_runs([str(tmp_path / "run" / "seed*")])
  assert analysis_attr.run_sources(runs[0]) == ["weights", "kv", "interaction", "total"]
  assert analysis_attr.run_means(runs[1]) == {"weights": 6.0, "kv": 3.0, "interaction": -3.0, "total": 6.0}
  groups = group_runs(runs)
  cols, table = analysis_attr.group_table(groups)
  assert cols == ["weights", "kv", "interaction", "total"]
  mean, se, n = table[0]["values"]["kv"]
  assert (mean, n) == (2.0, 2) and se == pytest.approx(1.0)    # s.e. of {1, 3}
  assert "| all |" in analysis_attr.markdown(groups)
  assert (tmp_path / "a.png").exists() is False
  analysis_attr.plot(groups, str(tmp_path / "a.png"))
  assert (tmp_path / "a.png").stat().st_size > 1000
  assert plots._expand(("reward", "attribution/*/kl"), rows) == ["reward", "attribution/total/kl",   # pylint: disable=protected-access
                                                                 "attribution/kv/kl", "attribution/weights/kl",
                                                                 "attribution/interaction/kl"]
