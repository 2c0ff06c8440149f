// Exact top-k of float32 rows for the sampler's recording on CPU, an XLA FFI handler:
// `lax.top_k`'s output bit for bit (values in its total order of float bits, -0.0 < 0.0 and NaNs
// at the ends by sign; ties to the lower index), by one selection pass per row instead of a k-heap.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The order key of a float's bits as an unsigned integer: larger key <=> earlier in top_k's order.
inline uint32_t OrderKey(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  // Negative: every bit flipped; otherwise the sign bit set. Branchless, so the passes vectorize.
  return bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
}

// A key L such that at least k of the n >= k chunk maxima are >= L, close above the k-th largest:
// one histogram of 256 buckets over the maxima's range, L the lower edge of the bucket in which the
// count from the top reaches k (~6x cheaper than an nth_element over the maxima at V = 4096,
// k = 128, for ~1% more candidates).
inline uint32_t LowerBound(const uint32_t* maxima, int64_t n, int64_t k) {
  uint32_t lo = maxima[0], hi = maxima[0];
  for (int64_t c = 1; c < n; ++c) {
    lo = std::min(lo, maxima[c]);
    hi = std::max(hi, maxima[c]);
  }
  int shift = 0;
  while (((hi - lo) >> shift) >= 256) ++shift;
  uint32_t hist[256] = {0};
  for (int64_t c = 0; c < n; ++c) ++hist[(maxima[c] - lo) >> shift];
  int64_t seen = 0;
  int b = 255;
  for (; b > 0; --b) {
    seen += hist[b];
    if (seen >= k) break;
  }
  return lo + (static_cast<uint32_t>(b) << shift);  // b = 0: lo, which all n >= k maxima reach
}

ffi::Error TopK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> values,
                ffi::ResultBuffer<ffi::S32> indices, int64_t k) {
  auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("topk: x must have a last axis");
  const int64_t v = dims.back();
  if (k < 1 || k > v) return ffi::Error::InvalidArgument("topk: k must lie in [1, V]");
  const int64_t rows = x.element_count() / v;
  const float* in = x.typed_data();
  float* out_v = values->typed_data();
  int32_t* out_i = indices->typed_data();
  // Per row: the maxima of chunks of kChunk keys; a lower bound L on the k-th largest key, a key
  // that at least k of the maxima reach (`LowerBound`: each such chunk holds one key >= L, so at
  // least k keys are >= L and every top-k key is); then a selection over the keys >= L only
  // (~145 of 4096 at k = 128 on the peer benchmark model's rows), each as a composite
  // (key << 32 | (2^32 - 1 - index)), so that one unsigned compare orders by key, then by the lower
  // index first, exactly as lax.top_k breaks ties.
  constexpr int64_t kChunk = 8;
  const int64_t n_chunks = (v + kChunk - 1) / kChunk;
  struct Scratch {
    std::vector<uint32_t> maxima;
    std::vector<uint64_t> cand;
  };
  auto make_scratch = [v, n_chunks] {
    return Scratch{std::vector<uint32_t>(n_chunks), std::vector<uint64_t>(v)};
  };
  // Rows are independent: spread over XLA's intra-op threads.
  rl_jax_native::ParallelFor(pool, rows, make_scratch, [&](Scratch& s, int64_t start, int64_t stop) {
    uint32_t* maxima = s.maxima.data();
    uint64_t* cand = s.cand.data();
    const int64_t full = v / kChunk;  // whole chunks: fixed-length loops the compiler vectorizes
    for (int64_t r = start; r < stop; ++r) {
      const float* row = in + r * v;
      for (int64_t c = 0; c < full; ++c) {
        uint32_t m = 0;
        for (int64_t j = 0; j < kChunk; ++j) m = std::max(m, OrderKey(row[c * kChunk + j]));
        maxima[c] = m;
      }
      if (full < n_chunks) {
        uint32_t m = 0;
        for (int64_t j = full * kChunk; j < v; ++j) m = std::max(m, OrderKey(row[j]));
        maxima[full] = m;
      }
      const uint32_t lower = k <= n_chunks ? LowerBound(maxima, n_chunks, k) : 0;
      // The keys >= L, in index order, from the chunks whose maximum is >= L (the others hold
      // none); each written unconditionally and kept by advancing n.
      int64_t n = 0;
      for (int64_t c = 0; c < n_chunks; ++c) {
        if (maxima[c] < lower) continue;
        const int64_t end = std::min(v, (c + 1) * kChunk);
        for (int64_t j = c * kChunk; j < end; ++j) {
          const uint32_t key = OrderKey(row[j]);
          cand[n] = (static_cast<uint64_t>(key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
          n += key >= lower;
        }
      }
      if (n > k) std::nth_element(cand, cand + (k - 1), cand + n, std::greater<uint64_t>());
      std::sort(cand, cand + k, std::greater<uint64_t>());
      for (int64_t j = 0; j < k; ++j) {
        const uint32_t idx = 0xFFFFFFFFu - static_cast<uint32_t>(cand[j] & 0xFFFFFFFFu);
        out_i[r * k + j] = static_cast<int32_t>(idx);
        out_v[r * k + j] = row[idx];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxTopKF32, TopK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k"));
