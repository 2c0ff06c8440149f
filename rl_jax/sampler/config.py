"""SamplerConfig: generation, recording, weight-noise and quantization settings of the sampler."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from rl_jax import microbatch
from rl_jax.config_utils import ConfigError, from_dict, require
from rl_jax.quant.config import QuantConfig

NoiseMode = Literal["none", "relative", "absolute"]
SamplerDType = Literal["float32", "bfloat16"]
Engine = Literal["static", "continuous"]


def _default_quant() -> QuantConfig:
  return QuantConfig.preset("none")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """The sampler `q` of docs/math.md#notation; build with `from_dict(SamplerConfig, d, prefix="sampler")`.

  Prompts are re-laid out left-padded into a `max_prompt_len`-wide buffer, so one
  compiled program serves every batch of the same size. `record_topk = 0` turns the
  top-k recording off, `record_topk = vocab` records the full distribution (checked
  against the vocabulary by `check_vocab`, since the model is not known here).
  The staleness period K is a trainer setting, not a sampler one.
  """
  max_prompt_len: int = 64
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0               # 0 = no top-k truncation when sampling
  greedy: bool = False
  record_topk: int = 128       # 0 = off; default 128 as in [SC], `vocab` = full distribution
  record_experts: bool = True
  dtype: SamplerDType = "float32"
  noise: NoiseMode = "none"
  noise_sigma: float = 0.0
  # A QuantConfig section, or the name of one of `QuantConfig.PRESETS`.
  quant: QuantConfig | str = dataclasses.field(default_factory=_default_quant)
  eos_id: int = 1
  pad_id: int = 0
  # Decode in up to this many phases, each a loop whose attention reads only the cache slots
  # filled by its end (static lengths: one compiled decode step per phase, so phases are at
  # least `min_phase_steps` long). Both engines; the continuous one enters the phase of its
  # furthest slot, and holds the phase's cache prefix beside the whole cache while in it.
  # 1 = every step reads the whole cache.
  decode_phases: int = 4
  min_phase_steps: int = 32
  # Memory (not results): generate at most this many rows at a time, in waves of strided rows
  # each with its own KV cache (0 = every row at once), and prefill each wave's prompts this many
  # rows at a time (0 = the wave at once). Each must divide the rows it splits and the mesh's
  # batch axes; a row's tokens and log-probs do not depend on the others in its wave.
  max_rows_in_flight: int = 0
  prefill_rows: int = 0
  # The generation engine (docs/architecture.md#the-sampler-engines): 'static' decodes each wave
  # of rows until its longest row ends; 'continuous' decodes `slots` rows at a time and gives a
  # finished row's slot to the next prompt of the queue, prefilled `prefill_chunk` prompt slots per
  # decode step. Same rollout either way (bit for bit under model.batch_invariant).
  engine: Engine = "static"
  slots: int = 0               # continuous: rows decoding together (0 = max_rows_in_flight, else all rows)
  prefill_chunk: int = 256     # continuous: prompt slots a refilled slot prefills per decode step

  def __post_init__(self):
    require(self.max_prompt_len >= 1, "sampler.max_prompt_len", f"must be >= 1, got {self.max_prompt_len}")
    require(self.max_new_tokens >= 1, "sampler.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
    require(self.temperature > 0, "sampler.temperature",
            f"must be > 0 (use greedy=True for argmax decoding), got {self.temperature}")
    require(0.0 < self.top_p <= 1.0, "sampler.top_p", f"must be in (0, 1], got {self.top_p}")
    require(self.top_k >= 0, "sampler.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
    require(self.record_topk >= 0, "sampler.record_topk", f"must be >= 0 (0 = off), got {self.record_topk}")
    require(self.noise_sigma >= 0, "sampler.noise_sigma", f"must be >= 0, got {self.noise_sigma}")
    require(self.noise == "none" or self.noise_sigma > 0, "sampler.noise_sigma",
            f"noise={self.noise!r} needs noise_sigma > 0")
    require(self.eos_id >= 0, "sampler.eos_id", f"must be >= 0, got {self.eos_id}")
    require(self.pad_id >= 0, "sampler.pad_id", f"must be >= 0, got {self.pad_id}")
    require(self.decode_phases >= 1, "sampler.decode_phases", f"must be >= 1, got {self.decode_phases}")
    require(self.min_phase_steps >= 1, "sampler.min_phase_steps", f"must be >= 1, got {self.min_phase_steps}")
    require(self.engine in ("static", "continuous"), "sampler.engine",
            f"must be 'static' or 'continuous', got {self.engine!r}")
    require(self.prefill_chunk >= 1, "sampler.prefill_chunk", f"must be >= 1, got {self.prefill_chunk}")
    for k in ("max_rows_in_flight", "prefill_rows", "slots"):
      require(getattr(self, k) >= 0, f"sampler.{k}", f"must be >= 0 (0 = all rows), got {getattr(self, k)}")
    quant = self.quant
    if quant is None:
      quant = QuantConfig.preset("none")
    elif isinstance(quant, str):
      try:
        quant = QuantConfig.preset(quant)
      except ConfigError as e:
        raise ConfigError(f"config key 'sampler.quant': {e}") from None
    elif not isinstance(quant, QuantConfig):
      quant = from_dict(QuantConfig, quant, prefix="sampler.quant")
    # Frozen dataclass: normalizing the nested section needs object.__setattr__.
    object.__setattr__(self, "quant", quant)

  def check_vocab(self, vocab_size: int) -> None:
    """Raises ConfigError if a vocabulary-sized setting exceeds the model's vocabulary."""
    require(self.record_topk <= vocab_size, "sampler.record_topk",
            f"{self.record_topk} exceeds the vocabulary size {vocab_size} (use {vocab_size} for the full "
            "distribution)")
    require(self.top_k <= vocab_size, "sampler.top_k", f"{self.top_k} exceeds the vocabulary size {vocab_size}")
    for key in ("eos_id", "pad_id"):
      require(getattr(self, key) < vocab_size, f"sampler.{key}",
              f"{getattr(self, key)} is not a token id of a {vocab_size}-token vocabulary")

  def phase_bounds(self) -> list[tuple[int, int]]:
    """(end step, cache slots read) per decode phase: step j feeds slot P-1+j, so a phase
    ending before step e reads slots [0, P+e-1), rounded up to a multiple of 8."""
    t, p = self.max_new_tokens, self.max_prompt_len
    n = max(1, min(self.decode_phases, t // self.min_phase_steps))
    ends = [-(-t * (i + 1) // n) for i in range(n)]
    return [(e, min(self.max_len, -(-(p + e - 1) // 8) * 8)) for e in ends]

  def slots_for(self, rows: int, div: int) -> int:
    """The continuous engine's slots N for `rows` rows on `div` batch-axis devices: `slots`, else
    `max_rows_in_flight`, else every row; at most the rows, and split evenly over the devices."""
    n = min(self.slots or self.max_rows_in_flight or rows, rows)
    if n % div:
      raise ConfigError(f"config key 'sampler.slots': {n} slots do not split over the mesh's batch axes "
                        f"({div} devices)")
    return n

  def check_rows(self, rows: int, div: int, rows_key: str = "sampler.max_rows_in_flight") -> None:
    """Raises the ConfigError a generate of `rows` rows on `div` batch-axis devices would raise while
    it is traced (its waves, slots and prefill chunks), so a job names it before any compute.
    `rows_key`: the key that set `max_rows_in_flight` (the evaluation's own `rl.eval_rows_in_flight`)."""
    if self.engine == "continuous":
      prefill_rows = self.slots_for(rows, div)   # the first N rows' batched prefill
    else:
      prefill_rows = rows // microbatch.count(rows, self.max_rows_in_flight, rows_key, div)
    microbatch.count(prefill_rows, self.prefill_rows, "sampler.prefill_rows", div)

  def eval_configs(self, temperature: float, rows_in_flight: int = 0) -> tuple[SamplerConfig, SamplerConfig]:
    """(greedy, sampled) evaluation configs: these shapes with clean float32 weights, sampled at
    `temperature`, in waves of `rows_in_flight` rows (0 = `max_rows_in_flight`)."""
    greedy = dataclasses.replace(self, greedy=True, noise="none", noise_sigma=0.0, quant="none",
                                 dtype="float32", record_topk=0, record_experts=False,
                                 max_rows_in_flight=rows_in_flight or self.max_rows_in_flight)
    return greedy, dataclasses.replace(greedy, greedy=False, temperature=temperature)

  @property
  def truncates(self) -> bool:
    """Whether sampling draws from a truncated distribution (top-k / top-p): the rollout then
    records each token's kept set (`Rollout.trunc_*`) for `loss.sampling_mask='kept_set'`."""
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

  @property
  def max_len(self) -> int:
    """Length S of the token buffer and of the KV cache: prompt slots + response slots."""
    return self.max_prompt_len + self.max_new_tokens


def sampler_config(section: Any) -> SamplerConfig:
  """`from_dict(SamplerConfig, section, prefix="sampler")`, the one entry point for configs."""
  try:
    return from_dict(SamplerConfig, section, prefix="sampler")
  except TypeError as e:  # e.g. a QuantConfig that rejects a value type
    raise ConfigError(f"[sampler] {e}") from None
