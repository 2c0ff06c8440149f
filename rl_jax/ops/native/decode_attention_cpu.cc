// Decode attention on CPU, an XLA FFI handler: one query token per row over the heads-major KV
// cache, float32. XLA:CPU runs the two batched matmuls of `layers._decode_attention` as a loop of
// [R, D] x [D, C] products, one per (row, kv head), at a few microseconds each; this handler reads
// each (row, kv head)'s keys and values once, with the mask, softmax and both products in one pass.
//
// q [B, G, R, D], kT [B, G, D, C], v [B, G, C, D], mask [B, C] -> out [B, G, R, D] (B may be
// several leading axes), where
// out = softmax(where(mask, q kT * scale, -1e30)) v, as the jnp reference computes it (to float
// rounding: the sums run in another order and exp is a polynomial).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMaskValue = -1e30f;  // ops/attention.py's MASK_VALUE

// exp(x) for x <= 0 (scores minus their maximum), written so the compiler vectorizes the loop
// that calls it (a libm call would not be): 2^k * e^f, |f| <= ln2 / 2, a degree-6 polynomial
// (relative error ~2e-7, float rounding). exp of a masked score (x < -87) is 0, as jnp's.
inline float ExpNonPositive(float x) {
  const float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  const float xc = std::max(x, -87.0f);
  const float k = std::floor(xc * kLog2e + 0.5f);
  const float f = xc - k * kLn2Hi - k * kLn2Lo;
  float p = 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

struct Shape {
  int64_t b, g, r, d, c;
  float scale;
};

// One (row, kv head): `s` is scratch of R * C floats.
void AttendOne(const Shape& sh, int64_t n, const float* q, const float* kT, const float* v,
               const bool* mask, float* out, float* s) {
  const int64_t R = sh.r, D = sh.d, C = sh.c;
  const float* qn = q + n * R * D;
  const float* kn = kT + n * D * C;
  const float* vn = v + n * C * D;
  const bool* mb = mask + (n / sh.g) * C;
  float* on = out + n * R * D;
  std::fill(s, s + R * C, 0.0f);
  for (int64_t d = 0; d < D; ++d) {  // scores: a pass over kT, C contiguous
    const float* kd = kn + d * C;
    for (int64_t r = 0; r < R; ++r) {
      const float qv = qn[r * D + d];
      float* sr = s + r * C;
      for (int64_t c = 0; c < C; ++c) sr[c] += qv * kd[c];
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // masked softmax over the C slots
    float* sr = s + r * C;
    float m = kMaskValue;
    for (int64_t c = 0; c < C; ++c) {
      sr[c] = mb[c] ? sr[c] * sh.scale : kMaskValue;
      m = std::max(m, sr[c]);
    }
    float total = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      sr[c] = ExpNonPositive(sr[c] - m);
      total += sr[c];
    }
    const float inv = 1.0f / total;
    for (int64_t c = 0; c < C; ++c) sr[c] *= inv;
  }
  std::fill(on, on + R * D, 0.0f);
  for (int64_t c = 0; c < C; ++c) {  // out: a pass over v, D contiguous
    const float* vc = vn + c * D;
    for (int64_t r = 0; r < R; ++r) {
      const float pv = s[r * C + c];
      float* o = on + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] += pv * vc[d];
    }
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kT,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask,
                           ffi::ResultBuffer<ffi::F32> out, float scale) {
  // Leading axes before [G, R, D] fold into B (a vmapped caller's broadcast axes).
  auto qd = q.dimensions(), kd = kT.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  const size_t lead = qd.size() < 4 ? 0 : qd.size() - 3;
  if (qd.size() < 4 || kd.size() != qd.size() || vd.size() != qd.size() || md.size() != lead + 1)
    return ffi::Error::InvalidArgument("decode_attention: q, kT, v must share a rank >= 4, mask 2 less");
  int64_t b = 1;
  for (size_t i = 0; i < lead; ++i) {
    if (kd[i] != qd[i] || vd[i] != qd[i] || md[i] != qd[i])
      return ffi::Error::InvalidArgument("decode_attention: leading axes differ between operands");
    b *= qd[i];
  }
  Shape sh{b, qd[lead], qd[lead + 1], qd[lead + 2], kd[lead + 2], scale};
  if (kd[lead] != sh.g || kd[lead + 1] != sh.d || vd[lead] != sh.g || vd[lead + 1] != sh.c ||
      vd[lead + 2] != sh.d || md[lead] != sh.c)
    return ffi::Error::InvalidArgument(
        "decode_attention: shapes must be q [B,G,R,D], kT [B,G,D,C], v [B,G,C,D], mask [B,C]");
  const float *qp = q.typed_data(), *kp = kT.typed_data(), *vp = v.typed_data();
  const bool* mp = reinterpret_cast<const bool*>(mask.typed_data());
  float* op = out->typed_data();
  rl_jax_native::ParallelFor(
      pool, sh.b * sh.g, [&sh] { return std::vector<float>(sh.r * sh.c); },
      [&](std::vector<float>& s, int64_t start, int64_t stop) {
        for (int64_t n = start; n < stop; ++n) AttendOne(sh, n, qp, kp, vp, mp, op, s.data());
      });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxDecodeAttentionF32, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
