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
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (bits < 0) bits ^= 0x7FFFFFFF;
  return static_cast<uint32_t>(bits) ^ 0x80000000u;
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
  // Per row: the keys; a lower bound L on the k-th largest key, the k-th largest of the maxima of
  // chunks of kChunk (each of the k chunks whose maximum is >= L holds one key >= L, so at least k
  // keys are >= L and every top-k key is); then a selection over the keys >= L only (~1.1k of 4096
  // for normal rows), each as a composite (key << 32 | (2^32 - 1 - index)), so that one unsigned
  // compare orders by key, then by the lower index first, exactly as lax.top_k breaks ties.
  constexpr int64_t kChunk = 8;
  const int64_t n_chunks = (v + kChunk - 1) / kChunk;
  struct Scratch {
    std::vector<uint32_t> keys, maxima;
    std::vector<uint64_t> cand;
  };
  auto make_scratch = [v, n_chunks] {
    Scratch s{std::vector<uint32_t>(v), std::vector<uint32_t>(n_chunks), {}};
    s.cand.reserve(v);
    return s;
  };
  // Rows are independent: spread over XLA's intra-op threads.
  rl_jax_native::ParallelFor(pool, rows, make_scratch, [&](Scratch& s, int64_t start, int64_t stop) {
    auto& keys = s.keys;
    auto& maxima = s.maxima;
    auto& cand = s.cand;
    for (int64_t r = start; r < stop; ++r) {
      const float* row = in + r * v;
      for (int64_t c = 0; c < n_chunks; ++c) {
        uint32_t m = 0;
        const int64_t end = std::min(v, (c + 1) * kChunk);
        for (int64_t j = c * kChunk; j < end; ++j) {
          keys[j] = OrderKey(row[j]);
          m = std::max(m, keys[j]);
        }
        maxima[c] = m;
      }
      uint32_t lower = 0;
      if (k <= n_chunks) {
        std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<uint32_t>());
        lower = maxima[k - 1];
      }
      cand.clear();
      for (int64_t j = 0; j < v; ++j) {
        if (keys[j] >= lower) {
          cand.push_back((static_cast<uint64_t>(keys[j]) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j)));
        }
      }
      if (static_cast<int64_t>(cand.size()) > k) {
        std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), std::greater<uint64_t>());
      }
      std::sort(cand.begin(), cand.begin() + k, std::greater<uint64_t>());
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
