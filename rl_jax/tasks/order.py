"""The order prompts are drawn in: epochs of a seeded shuffle, optionally per-source streams mixed by weight.

Every position is a pure function of (seed, data, index): the trainer asks for prompts
step * B .. step * B + B - 1, so a run resumed at step s continues with prompt s * B, exactly
where the uninterrupted run would be. Hash arithmetic (splitmix64 on uint64 arrays), not a
numpy RNG stream, whose output is not promised across numpy versions.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from rl_jax.config_utils import ConfigError

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
# Blocks of the source-choice stream whose per-source counts are cached (random access is
# O(block) after the first pass over the blocks before it).
BLOCK = 4096


def splitmix64(x: np.ndarray) -> np.ndarray:
  """The splitmix64 finalizer on uint64 (wrapping arithmetic): a bijection with good avalanche."""
  x = np.asarray(x, np.uint64)
  with np.errstate(over="ignore"):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
  h = np.uint64(0)
  for p in parts:
    h = splitmix64(h ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF))
  return h


def permutation(n: int, seed: int, stream: int, epoch: int) -> np.ndarray:
  """A seeded permutation of range(n) (argsort of hashed indices), different per (stream, epoch)."""
  k = _key(seed, stream, epoch)
  with np.errstate(over="ignore"):
    h = splitmix64(np.arange(n, dtype=np.uint64) ^ k)
  return np.argsort(h, kind="stable")


class Stream:
  """Indices 0, 1, ... of one pool of `n` items: epoch e = i // n is a fresh seeded shuffle."""

  def __init__(self, n: int, seed: int, stream: int, shuffle: bool = True):
    if n <= 0:
      raise ValueError("a stream needs at least one item")
    self.n, self.seed, self.stream, self.shuffle = n, seed, stream, shuffle
    self._cache: dict[int, np.ndarray] = {}

  def item(self, i: int) -> int:
    epoch, pos = divmod(int(i), self.n)
    if not self.shuffle:
      return pos
    perm = self._cache.get(epoch)
    if perm is None:
      if len(self._cache) > 2:  # resumes and steps move forward: keep the recent epochs only
        self._cache.pop(min(self._cache))
      perm = self._cache[epoch] = permutation(self.n, self.seed, self.stream, epoch)
    return int(perm[pos])


class Order:
  """Global index -> item index (into the concatenated pools).

  No weights: one pool of every item, shuffled per epoch (sources appear in proportion to
  their sizes). With weights: each source is its own stream (its own epochs), and index i goes
  to source s with probability w_s / sum(w) (a hash of (seed, i)), taking that source's next item.
  """

  def __init__(self, sizes: Mapping[str, int], seed: int, weights: Mapping[str, float] | None = None,
               shuffle: bool = True):
    self.sources = list(sizes)
    self.sizes = [int(sizes[s]) for s in self.sources]
    self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])[:-1].astype(np.int64)
    self.seed = seed
    self.weighted = bool(weights)
    if not self.weighted:
      self._pool = Stream(int(sum(self.sizes)), seed, 0, shuffle)
      return
    w = np.asarray([float(weights.get(s, 0.0)) for s in self.sources])
    self.probs = w / w.sum()
    self._cum = np.cumsum(self.probs)
    self._streams = [Stream(n, seed, j + 1, shuffle) if n else None for j, n in enumerate(self.sizes)]
    self._block_counts: list[np.ndarray] = [np.zeros(len(self.sources), np.int64)]

  def _choices(self, block: int) -> np.ndarray:
    """The source of each index of `block` (vectorized hash -> uniform -> weighted pick)."""
    idx = np.arange(block * BLOCK, (block + 1) * BLOCK, dtype=np.uint64)
    with np.errstate(over="ignore"):
      h = splitmix64(idx ^ _key(self.seed, 0x50C5))
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return np.minimum(np.searchsorted(self._cum, u, side="right"), len(self.sources) - 1)

  def source_position(self, i: int) -> tuple[int, int]:
    """(source number, position in that source's stream) of global index i (weighted order)."""
    block, off = divmod(int(i), BLOCK)
    while len(self._block_counts) <= block:
      b = len(self._block_counts) - 1
      counts = np.bincount(self._choices(b), minlength=len(self.sources))
      self._block_counts.append(self._block_counts[-1] + counts)
    choices = self._choices(block)[:off + 1]
    s = int(choices[-1])
    return s, int(self._block_counts[block][s] + np.count_nonzero(choices[:-1] == s))

  def item(self, i: int) -> int:
    if i < 0:
      raise ValueError(f"index must be >= 0, got {i}")
    if not self.weighted:
      return self._pool.item(i)
    s, k = self.source_position(i)
    return int(self.offsets[s]) + self._streams[s].item(k)

  def items(self, start: int, count: int) -> list[int]:
    return [self.item(i) for i in range(start, start + count)]


def parse_weights(spec: str, sources: Sequence[str], key: str) -> dict[str, float]:
  """'a=1,b=3' -> {'a': 1.0, 'b': 3.0}: every named source must exist, weights >= 0, one > 0."""
  out: dict[str, float] = {}
  for part in [p.strip() for p in spec.split(",") if p.strip()]:
    name, sep, value = part.rpartition("=")
    if not sep or not name:
      raise ConfigError(f"config key '{key}': {part!r} is not source=weight")
    try:
      w = float(value)
    except ValueError:
      raise ConfigError(f"config key '{key}': weight {value!r} of {name!r} is not a number") from None
    if not w >= 0 or not np.isfinite(w):
      raise ConfigError(f"config key '{key}': weight of {name!r} must be finite and >= 0, got {value}")
    if name not in sources:
      raise ConfigError(f"config key '{key}': no source {name!r} in the train files; sources: {list(sources)}")
    out[name] = w
  if out and not any(v > 0 for v in out.values()):
    raise ConfigError(f"config key '{key}': every weight is 0")
  return out
