// Training attention on CPU, two XLA FFI handlers (forward, backward): the trainer's no-cache GQA
// attention over S tokens, float32, read in the model's own [B, S, G, ...] layouts. XLA:CPU runs
// `ops/attention.py`'s computation as separate passes (two batched dots, the mask, a softmax of
// several reductions) over [B, G, R, S, S] scores plus layout copies to (b, g)-major; here one
// (row, kv head) is a unit: its keys and values are read once, its [R, S] scores never leave the
// thread's scratch, and the causal limit skips the upper triangle key by key.
//
// Forward:  q [B, S, G, R, D], k [B, S, G, D], v [B, S, G, D], valid [B, S]
//           -> out [B, S, G, R, D], m [B, S, G, R], l [B, S, G, R]
// Backward: q, k, v, valid, out, m, l, dout [B, S, G, R, D] -> dq, dk, dv (q's, k's, v's shapes)
// (B may be several leading axes.) Query (s, r) of kv head g reads key c iff valid[b, c] and, when
// `causal`, c <= s; its scores are (q . k) * scale, a masked one the constant -1e30, and
// out = sum_c exp(score_c - m) v_c / l with m the row's max and l the sum of exp(score - m) over
// the keys it visits (c <= s; all S when not causal). A query that sees no key therefore averages
// v over the keys it visits, as `ops/attention.py`'s implementations do over theirs. m and l are
// the residuals the backward recomputes the probabilities from (as the blocked attention does):
// no gradient flows through a masked score.
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

// Eight floats as one value (GCC / Clang vector extensions: one AVX register, two SSE or NEON
// ones). Every loop over keys runs over whole chunks of 8 slots: a unit's scratch is padded to Sp,
// a multiple of 8, so short rows (S = 36 in the study model) have no scalar tails.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline v8f Load(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void Store(float* p, v8f x) { std::memcpy(p, &x, sizeof(x)); }
inline v8f Splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline float MaxOf(v8f x) {
  float m = x[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, x[i]);
  return m;
}
inline float SumOf(v8f x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

// exp(x) for x <= 0, lane by lane: 2^k * e^f, |f| <= ln2 / 2, a degree-6 polynomial (relative
// error ~2e-7, float rounding, as decode_attention_cpu.cc's scalar one); 0 below -87.
inline v8f ExpNonPositive(v8f x) {
  const v8f lo = Splat(-87.0f);
  const v8i under = x < lo;
  const v8f xc = under ? lo : x;
  const v8f y = xc * 1.44269504088896341f + 0.5f;
  v8f k = __builtin_convertvector(__builtin_convertvector(y, v8i), v8f);  // truncation ...
  k = k + __builtin_convertvector(k > y, v8f);  // ... to floor (a true compare is -1)
  const v8f f = xc - k * 0.693359375f - k * -2.12194440e-4f;
  v8f p = Splat(1.3981999507e-3f);
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const v8i bits = (__builtin_convertvector(k, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return under ? Splat(0.0f) : p * scale;
}

constexpr int64_t kMaxHeadDim = 256;  // the D loops keep up to 256 / 8 vectors on the stack

struct Shape {
  int64_t b, s, g, r, d;  // b: the leading axes folded
  float scale;
  bool causal;
  int64_t sp() const { return (s + kLanes - 1) / kLanes * kLanes; }  // S padded to whole chunks
  int64_t dc() const { return (d + kLanes - 1) / kLanes; }           // chunks of the head dim
  int64_t dp() const { return dc() * kLanes; }                        // D padded to whole chunks
  // Offsets of one (row b, slot s, kv head g) in q / out (then + r * D), in k / v, and in m / l.
  int64_t QAt(int64_t bb, int64_t ss, int64_t gg) const { return ((bb * s + ss) * g + gg) * r * d; }
  int64_t KAt(int64_t bb, int64_t ss, int64_t gg) const { return ((bb * s + ss) * g + gg) * d; }
  int64_t StatAt(int64_t bb, int64_t ss, int64_t gg) const { return ((bb * s + ss) * g + gg) * r; }
  // Chunks of 8 key slots query slot ss visits: through its own slot (causal), else all.
  int64_t Chunks(int64_t ss) const { return causal ? ss / kLanes + 1 : sp() / kLanes; }
  // The key slots [0, Limit(ss)) query slot ss visits: a query that sees no key averages v over them.
  int64_t Limit(int64_t ss) const { return causal ? ss + 1 : s; }
};

// Per-thread scratch, made once per claim of units. Slots past S and head-dim lanes past D stay
// zero (keys, values, rows), and the slots past S masked (`ok`): every loop runs over whole
// chunks of 8, in registers, with no scalar tails and no aliasing between its operands.
struct Scratch {
  std::vector<float> kT, vT, kr, vr, rows, ds, dk, dv, qi, doi;
  std::vector<int32_t> ok;  // -1 where a key slot is valid, 0 where it is padding or past S
  Scratch(const Shape& sh, bool backward)
      : kT(sh.d * sh.sp()), vT(backward ? sh.d * sh.sp() : 0), kr(backward ? sh.sp() * sh.dp() : 0),
        vr(sh.sp() * sh.dp()), rows(sh.sp()), ds(backward ? sh.sp() : 0), dk(backward ? sh.sp() * sh.dp() : 0),
        dv(backward ? sh.sp() * sh.dp() : 0), qi(sh.dp()), doi(sh.dp()), ok(sh.sp()) {}
};

// Unit (b, g)'s keys / values into the scratch: transposed [D, Sp] for the passes over slots,
// [Sp, Dp] for the passes over the head dimension.
void LoadKV(const Shape& sh, const float* x, int64_t b, int64_t g, float* xT, float* xr) {
  const int64_t Sp = sh.sp(), D = sh.d, Dp = sh.dp();
  for (int64_t c = 0; c < sh.s; ++c) {
    const float* xc = x + sh.KAt(b, c, g);
    if (xT)
      for (int64_t d = 0; d < D; ++d) xT[d * Sp + c] = xc[d];
    if (xr) std::memcpy(xr + c * Dp, xc, D * sizeof(float));
  }
}

void LoadMask(const Shape& sh, const bool* valid_b, int32_t* ok) {
  for (int64_t c = 0; c < sh.sp(); ++c) ok[c] = c < sh.s && valid_b[c] ? -1 : 0;
}

// Whether query slot ss reads the 8 key slots of chunk j (valid, and at or before ss when causal).
inline v8i Reads(const Shape& sh, const int32_t* ok, int64_t j, int64_t ss) {
  v8i mask;
  std::memcpy(&mask, ok + j * kLanes, sizeof(mask));
  if (sh.causal) {
    const v8i slot = v8i{0, 1, 2, 3, 4, 5, 6, 7} + static_cast<int32_t>(j * kLanes);
    mask = mask & (slot <= static_cast<int32_t>(ss));
  }
  return mask;
}

// Masked scaled scores of one query (its D values at q_r) over the chunks slot ss visits -> row.
inline void ScoreRow(const Shape& sh, const float* q_r, const float* kT, const int32_t* ok, int64_t ss,
                     float* __restrict__ row) {
  const int64_t Sp = sh.sp(), D = sh.d;
  for (int64_t j = 0, n = sh.Chunks(ss); j < n; ++j) {
    v8f acc = Splat(0.0f);
    for (int64_t d = 0; d < D; ++d) acc += q_r[d] * Load(kT + d * Sp + j * kLanes);
    Store(row + j * kLanes, Reads(sh, ok, j, ss) ? acc * sh.scale : Splat(kMaskValue));
  }
}

// exp(score - m) over the chunks of a row, in place; their sum. A query that sees no key (m is the
// mask value) has exp(0) = 1 at every slot of its chunks, also past its causal limit and past S:
// its uniform weights are kept on the slots it visits, [0, Limit(ss)).
inline float ExpRow(const Shape& sh, int64_t ss, float m, float scale_by, float* __restrict__ row) {
  const int64_t n = sh.Chunks(ss);
  const bool none_seen = m == kMaskValue;
  v8f lv = Splat(0.0f);
  for (int64_t j = 0; j < n; ++j) {
    v8f p = ExpNonPositive(Load(row + j * kLanes) - m);
    if (none_seen) {
      const v8i slot = v8i{0, 1, 2, 3, 4, 5, 6, 7} + static_cast<int32_t>(j * kLanes);
      p = slot < static_cast<int32_t>(sh.Limit(ss)) ? p : Splat(0.0f);
    }
    lv += p;
    Store(row + j * kLanes, p * scale_by);
  }
  return SumOf(lv);
}

void ForwardUnit(const Shape& sh, int64_t unit, const float* q, const float* k, const float* v,
                 const bool* valid, float* out, float* m_out, float* l_out, Scratch& w) {
  const int64_t b = unit / sh.g, g = unit % sh.g, R = sh.r, D = sh.d, Dp = sh.dp(), DC = sh.dc();
  LoadKV(sh, k, b, g, w.kT.data(), nullptr);
  LoadKV(sh, v, b, g, nullptr, w.vr.data());
  LoadMask(sh, valid + b * sh.s, w.ok.data());
  float* row = w.rows.data();
  const float* vr = w.vr.data();
  v8f o[kMaxHeadDim / kLanes];
  for (int64_t s = 0; s < sh.s; ++s) {
    const int64_t n = sh.Chunks(s);
    for (int64_t r = 0; r < R; ++r) {
      ScoreRow(sh, q + sh.QAt(b, s, g) + r * D, w.kT.data(), w.ok.data(), s, row);
      v8f mv = Splat(kMaskValue);
      for (int64_t j = 0; j < n; ++j) {
        const v8f x = Load(row + j * kLanes);
        mv = x > mv ? x : mv;
      }
      const float m = MaxOf(mv);
      const float l = ExpRow(sh, s, m, 1.0f, row);  // l >= 1: the row's max contributes exp(0)
      for (int64_t i = 0; i < DC; ++i) o[i] = Splat(0.0f);
      for (int64_t c = 0; c < n * kLanes; ++c) {
        const float p = row[c];
        for (int64_t i = 0; i < DC; ++i) o[i] += p * Load(vr + c * Dp + i * kLanes);
      }
      const float inv = 1.0f / l;
      float* out_r = out + sh.QAt(b, s, g) + r * D;
      for (int64_t i = 0; i < DC; ++i) Store(w.qi.data() + i * kLanes, o[i] * inv);
      std::memcpy(out_r, w.qi.data(), D * sizeof(float));
      m_out[sh.StatAt(b, s, g) + r] = m;
      l_out[sh.StatAt(b, s, g) + r] = l;
    }
  }
}

void BackwardUnit(const Shape& sh, int64_t unit, const float* q, const float* k, const float* v,
                  const bool* valid, const float* out, const float* m_in, const float* l_in,
                  const float* dout, float* dq, float* dk, float* dv, Scratch& w) {
  const int64_t b = unit / sh.g, g = unit % sh.g, R = sh.r, D = sh.d, Sp = sh.sp(), Dp = sh.dp(), DC = sh.dc();
  LoadKV(sh, k, b, g, w.kT.data(), w.kr.data());
  LoadKV(sh, v, b, g, w.vT.data(), nullptr);
  LoadMask(sh, valid + b * sh.s, w.ok.data());
  std::fill(w.dk.begin(), w.dk.end(), 0.0f);
  std::fill(w.dv.begin(), w.dv.end(), 0.0f);
  float *p = w.rows.data(), *ds = w.ds.data(), *dkw = w.dk.data(), *dvw = w.dv.data();
  const float *kr = w.kr.data(), *vT = w.vT.data();
  v8f qv[kMaxHeadDim / kLanes], dov[kMaxHeadDim / kLanes], dqv[kMaxHeadDim / kLanes];
  for (int64_t s = 0; s < sh.s; ++s) {
    const int64_t n = sh.Chunks(s);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = sh.QAt(b, s, g) + r * D;
      std::memcpy(w.qi.data(), q + at, D * sizeof(float));  // lanes past D stay 0
      std::memcpy(w.doi.data(), dout + at, D * sizeof(float));
      const float* doi = dout + at;
      float delta = 0.0f;  // rowsum(dO * O)
      for (int64_t d = 0; d < D; ++d) delta += doi[d] * out[at + d];
      for (int64_t i = 0; i < DC; ++i) {
        qv[i] = Load(w.qi.data() + i * kLanes);
        dov[i] = Load(w.doi.data() + i * kLanes);
        dqv[i] = Splat(0.0f);
      }
      // P exactly as the forward normalized it: exp(score - m) / l (for a query that sees no key
      // too: uniform weights, where exp(score - logsumexp) would round to 1, not 1 / l).
      ScoreRow(sh, q + at, w.kT.data(), w.ok.data(), s, p);
      ExpRow(sh, s, m_in[sh.StatAt(b, s, g) + r], 1.0f / l_in[sh.StatAt(b, s, g) + r], p);
      for (int64_t j = 0; j < n; ++j) {
        v8f dpj = Splat(0.0f);  // dP = dO v^T
        for (int64_t d = 0; d < D; ++d) dpj += doi[d] * Load(vT + d * Sp + j * kLanes);
        // dS = P (dP - delta), times the scale (dscore / dq = scale k); 0 at a masked score (a constant).
        const v8f pj = Load(p + j * kLanes);
        Store(ds + j * kLanes, Reads(sh, w.ok.data(), j, s) ? pj * (dpj - delta) * sh.scale : Splat(0.0f));
      }
      for (int64_t c = 0; c < n * kLanes; ++c) {
        const float dsc = ds[c], pc = p[c];
        for (int64_t i = 0; i < DC; ++i) {
          const int64_t x = c * Dp + i * kLanes;
          dqv[i] += dsc * Load(kr + x);
          Store(dkw + x, Load(dkw + x) + dsc * qv[i]);
          Store(dvw + x, Load(dvw + x) + pc * dov[i]);
        }
      }
      for (int64_t i = 0; i < DC; ++i) Store(w.qi.data() + i * kLanes, dqv[i]);
      std::memcpy(dq + at, w.qi.data(), D * sizeof(float));
    }
  }
  for (int64_t c = 0; c < sh.s; ++c) {
    std::memcpy(dk + sh.KAt(b, c, g), dkw + c * Dp, D * sizeof(float));
    std::memcpy(dv + sh.KAt(b, c, g), dvw + c * Dp, D * sizeof(float));
  }
}

// Reads the shapes (leading axes folded into b) and checks every operand against them.
ffi::Error ShapeOf(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                   ffi::Buffer<ffi::PRED>& valid, float scale, bool causal, Shape* sh) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = valid.dimensions();
  if (qd.size() < 5 || kd.size() != qd.size() - 1 || vd.size() != kd.size() || md.size() != qd.size() - 3)
    return ffi::Error::InvalidArgument(
        "causal_attention: want q [B..., S, G, R, D], k and v [B..., S, G, D], valid [B..., S]");
  const size_t lead = qd.size() - 4;
  int64_t b = 1;
  for (size_t i = 0; i < lead; ++i) {
    if (kd[i] != qd[i] || vd[i] != qd[i] || md[i] != qd[i])
      return ffi::Error::InvalidArgument("causal_attention: leading axes differ between operands");
    b *= qd[i];
  }
  *sh = Shape{b, qd[lead], qd[lead + 1], qd[lead + 2], qd[lead + 3], scale, causal};
  if (sh->d > kMaxHeadDim) return ffi::Error::InvalidArgument("causal_attention: head dim above 256");
  for (size_t i = 0; i < 3; ++i)
    if (kd[lead + i] != qd[lead + (i < 2 ? i : 3)] || vd[lead + i] != kd[lead + i])
      return ffi::Error::InvalidArgument("causal_attention: k and v must be [B..., S, G, D] for q [B..., S, G, R, D]");
  if (md[lead] != sh->s) return ffi::Error::InvalidArgument("causal_attention: valid must be [B..., S]");
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> valid, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l, float scale, bool causal) {
  Shape sh;
  if (auto err = ShapeOf(q, k, v, valid, scale, causal, &sh); err.failure()) return err;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const bool* vb = reinterpret_cast<const bool*>(valid.typed_data());
  float *op = out->typed_data(), *mp = m->typed_data(), *lp = l->typed_data();
  rl_jax_native::ParallelFor(
      pool, sh.b * sh.g, [&sh] { return Scratch(sh, false); },
      [&](Scratch& w, int64_t start, int64_t stop) {
        for (int64_t u = start; u < stop; ++u) ForwardUnit(sh, u, qp, kp, vp, vb, op, mp, lp, w);
      });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::F32> out,
                    ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> l, ffi::Buffer<ffi::F32> dout,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv, float scale, bool causal) {
  Shape sh;
  if (auto err = ShapeOf(q, k, v, valid, scale, causal, &sh); err.failure()) return err;
  if (out.element_count() != q.element_count() || dout.element_count() != q.element_count() ||
      m.element_count() * sh.d != q.element_count() || l.element_count() != m.element_count())
    return ffi::Error::InvalidArgument("causal_attention backward: out / dout must be q's shape, m / l q's without D");
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *op = out.typed_data(), *mp = m.typed_data(), *lp = l.typed_data(), *dop = dout.typed_data();
  const bool* vb = reinterpret_cast<const bool*>(valid.typed_data());
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  rl_jax_native::ParallelFor(
      pool, sh.b * sh.g, [&sh] { return Scratch(sh, true); },
      [&](Scratch& w, int64_t start, int64_t stop) {
        for (int64_t u = start; u < stop; ++u)
          BackwardUnit(sh, u, qp, kp, vp, vb, op, mp, lp, dop, dqp, dkp, dvp, w);
      });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxCausalAttentionFwdF32, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlJaxCausalAttentionBwdF32, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal"));
