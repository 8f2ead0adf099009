// Grouped-query attention of a few new tokens over (KV cache, the new tokens themselves), for
// XLA on CPU, through the XLA FFI: the attention of a decode step or a tree verification.
//
//   q      [B, T, N, H]  f32, not yet rotated    k_new, v_new [B, T, K, H]  f32, k not rotated
//   cos, sin [B, T, H/2] f32: RoPE of the new tokens (rotate-half convention)
//   k_past [B, K, H, S]  v_past [B, K, S, H]   f32: the cache, keys rotated
//   m_past [B, T, S]     pred: t may see slot s  m_new [B, T, T] pred: t may see new token j
// ->
//   out    [B, T, N, H]  f32   k_rot [B, T, K, H] f32: k_new rotated (for the cache write)
//
//   out[b, t, n] = sum over visible slots of softmax(q . k / sqrt(H)) v with q and the new
//   keys rotated, query head n reading kv head n / G (G = N / K). A row that sees nothing gets
//   zeros.
//
// Why: XLA CPU runs this as ~12 small ops a layer (RoPE of q and k, two score einsums, masks, a
// softmax over their concatenation, two value einsums, transposes of q, k, v and the output);
// at T = 8 those cost a SmolLM2 forward about as much as its matmuls' extra rows (issue 11).
// Here one call does it all, reading each (b, kv head)'s cache from L2 for up to 8 query rows
// at a time, and only up to the last slot any of those rows sees (a cache allocated for 2048
// tokens holding 256 costs 256).
//
// How: the new keys are rotated first; then tasks (b, kv head, block of 8 query rows, or 4
// where a kv head has no more: a decode step's group) run on XLA's pool (parallel.h), each
// rotating its queries. Scores are a broadcast-FMA over 32 slots at a time (the key cache is
// [H, S], slots contiguous), the softmax uses a vectorized exp (Cephes' polynomial, ~1 ulp), and the weighted sum of values a
// broadcast-FMA over the head dimension. Written once with GCC vector extensions and compiled
// for AVX-512, AVX2/FMA and plain x86-64 (target_clones picks one at load time).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef float vf_unaligned __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int kLanes = 16;
constexpr int kMaxRows = 8;  // query rows per task (4 where a kv head has at most 4)
constexpr int kPassRows = 4;  // rows per pass of the weighted sum (4 x H accumulators)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define EAGLE3_INLINE __attribute__((always_inline)) inline

EAGLE3_INLINE vf Load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
EAGLE3_INLINE void Store(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }
EAGLE3_INLINE vf Splat(float x) { return vf{} + x; }
EAGLE3_INLINE float Sum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
EAGLE3_INLINE float Max(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// e^x for x <= 0 (a score minus its row's maximum); below -87 (e^x < 2^-125) it reads as 0, so
// masked slots (-inf) weigh exactly nothing. Cephes expf: x = n ln2 + r, e^r by a degree-6
// polynomial, 2^n through the exponent bits.
EAGLE3_INLINE vf Exp(vf x) {
  const vf lo = Splat(-87.0f);
  const vf xc = x < lo ? lo : x;
  const vf n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf y = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  const vf e = y * reinterpret_cast<const vf&>(bits);
  return x < lo ? Splat(0.0f) : e;
}

struct Problem {
  const float *q, *k_new, *v_new, *cos, *sin, *k_past, *v_past;
  const bool *m_past, *m_new;
  float *out, *k_rot;
  int64_t batch, tokens, heads, kv_heads, head_dim, slots;
  int64_t group() const { return heads / kv_heads; }
  // Query rows per (b, kv head), and per task: padded rows would be scored for nothing.
  int64_t rows() const { return tokens * group(); }
  int64_t task_rows() const { return rows() <= kPassRows ? kPassRows : kMaxRows; }
  int64_t row_blocks() const { return (rows() + task_rows() - 1) / task_rows(); }
};

// 1 + the last slot among [0, slots) that mask row `m` marks, or 0.
EAGLE3_INLINE int64_t VisibleEnd(const bool* m, int64_t slots) {
  int64_t s = slots;
  while (s > 0 && !m[s - 1]) --s;
  return s;
}

// y = x rotated by (cos, sin) [H/2] (rotate-half: the pairs are i and i + H/2), as XLA does it.
EAGLE3_INLINE void Rotate(const float* x, const float* cos, const float* sin, int64_t half,
                          float* y) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    y[i] = x1 * cos[i] - x2 * sin[i];
    y[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// out rows r0..r0+nr of (b, kh): rows are (token t, query head g of the group), r = t*G + g;
// kRows (4 or 8) rows are computed, those past nr repeating row r0 and not stored.
template <int HV, int kRows>  // head_dim / 16, rows per task
EAGLE3_INLINE void AttendRows(const Problem& p, int64_t b, int64_t kh, int64_t r0, int64_t nr,
                              std::vector<float>& scratch) {
  const int64_t T = p.tokens, S = p.slots, G = p.group(), H = HV * kLanes;
  alignas(64) float q_rot[kRows][HV * kLanes];  // this task's queries, rotated
  const float* q[kRows];
  const bool* mp[kRows];
  const bool* mn[kRows];
  float* o[kRows];
  int64_t limit = 0;  // past slots [0, limit) hold every slot these rows see
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = r0 + (r < nr ? r : 0), t = row / G, g = row % G;
    const float* rope = p.cos + (b * T + t) * (H / 2);
    Rotate(p.q + ((b * T + t) * p.heads + kh * G + g) * H, rope,
           p.sin + (b * T + t) * (H / 2), H / 2, q_rot[r]);
    q[r] = q_rot[r];
    mp[r] = p.m_past + (b * T + t) * S;
    mn[r] = p.m_new + (b * T + t) * T;
    o[r] = p.out + ((b * T + t) * p.heads + kh * G + g) * H;
    if (r < nr) {
      const int64_t end = VisibleEnd(mp[r], S);
      limit = end > limit ? end : limit;
    }
  }
  const int64_t past_pad = (limit + kLanes - 1) / kLanes * kLanes;
  const int64_t new_pad = (T + kLanes - 1) / kLanes * kLanes;
  const int64_t ld = past_pad + new_pad;
  scratch.resize(kRows * ld);
  float* sc = scratch.data();
  const float* kp = p.k_past + (b * p.kv_heads + kh) * H * S;  // [H, S]
  const float* vp = p.v_past + (b * p.kv_heads + kh) * S * H;  // [S, H]

  // Scores over the past: kRows rows x 32 slots of accumulators, one pass over the head dim.
  int64_t s0 = 0;
  for (; s0 + 2 * kLanes <= limit; s0 += 2 * kLanes) {
    vf a0[kRows] = {}, a1[kRows] = {};
    for (int64_t h = 0; h < H; ++h) {
      const vf k0 = Load(kp + h * S + s0), k1 = Load(kp + h * S + s0 + kLanes);
      for (int r = 0; r < kRows; ++r) {
        const vf qh = Splat(q[r][h]);
        a0[r] += qh * k0;
        a1[r] += qh * k1;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      Store(sc + r * ld + s0, a0[r]);
      Store(sc + r * ld + s0 + kLanes, a1[r]);
    }
  }
  for (; s0 < limit; ++s0) {  // the last < 32 slots
    for (int r = 0; r < kRows; ++r) {
      float a = 0.0f;
      for (int64_t h = 0; h < H; ++h) a += q[r][h] * kp[h * S + s0];
      sc[r * ld + s0] = a;
    }
  }
  // Scores over the new tokens (keys [H] contiguous at k_new[b, j, kh]).
  for (int64_t j = 0; j < T; ++j) {
    const float* kj = p.k_rot + ((b * T + j) * p.kv_heads + kh) * H;
    for (int r = 0; r < kRows; ++r) {
      vf a = {};
      for (int v = 0; v < HV; ++v) a += Load(q[r] + v * kLanes) * Load(kj + v * kLanes);
      sc[r * ld + past_pad + j] = Sum(a);
    }
  }

  // Mask, scale, softmax numerators; the sums' reciprocals.
  const float scale = std::sqrt(static_cast<float>(H));
  float inv_sum[kRows];
  bool any[kRows];
  for (int r = 0; r < kRows; ++r) {
    float* row = sc + r * ld;
    for (int64_t s = 0; s < limit; ++s) row[s] = mp[r][s] ? row[s] / scale : kNegInf;
    for (int64_t s = limit; s < past_pad; ++s) row[s] = kNegInf;
    for (int64_t j = 0; j < T; ++j) row[past_pad + j] = mn[r][j] ? row[past_pad + j] / scale : kNegInf;
    for (int64_t j = T; j < new_pad; ++j) row[past_pad + j] = kNegInf;
    vf m = Splat(kNegInf);
    for (int64_t s = 0; s < ld; s += kLanes) {
      const vf x = Load(row + s);
      m = x > m ? x : m;
    }
    const float mx = Max(m);
    any[r] = mx != kNegInf;
    vf total = {};
    for (int64_t s = 0; s < ld; s += kLanes) {
      const vf e = Exp(Load(row + s) - (any[r] ? mx : 0.0f));
      Store(row + s, e);
      total += e;
    }
    inv_sum[r] = any[r] ? 1.0f / Sum(total) : 0.0f;
  }

  // Weighted sums of values: 4 rows x H accumulators per pass over the visible slots.
  for (int half = 0; half < nr; half += kPassRows) {
    vf acc[kPassRows][HV] = {};
    for (int64_t s = 0; s < limit; ++s) {
      vf vs[HV];
      for (int v = 0; v < HV; ++v) vs[v] = Load(vp + s * H + v * kLanes);
      for (int r = 0; r < kPassRows; ++r) {
        const vf w = Splat(sc[(half + r) * ld + s]);
        for (int v = 0; v < HV; ++v) acc[r][v] += w * vs[v];
      }
    }
    for (int64_t j = 0; j < T; ++j) {
      const float* vj = p.v_new + ((b * T + j) * p.kv_heads + kh) * H;
      vf vs[HV];
      for (int v = 0; v < HV; ++v) vs[v] = Load(vj + v * kLanes);
      for (int r = 0; r < kPassRows; ++r) {
        const vf w = Splat(sc[(half + r) * ld + past_pad + j]);
        for (int v = 0; v < HV; ++v) acc[r][v] += w * vs[v];
      }
    }
    for (int r = half; r < nr && r < half + kPassRows; ++r)
      for (int v = 0; v < HV; ++v) Store(o[r] + v * kLanes, acc[r - half][v] * inv_sum[r]);
  }
}

template <int HV>
EAGLE3_INLINE void AttendHeadDim(const Problem& p, int64_t b, int64_t kh, int64_t r0,
                                 int64_t nr, std::vector<float>& scratch) {
  if (p.task_rows() == kPassRows) {
    AttendRows<HV, kPassRows>(p, b, kh, r0, nr, scratch);
  } else {
    AttendRows<HV, kMaxRows>(p, b, kh, r0, nr, scratch);
  }
}

__attribute__((target_clones("avx512f", "arch=haswell", "default")))
void AttendTask(const Problem& p, int64_t task, std::vector<float>& scratch) {
  const int64_t blocks = p.row_blocks(), per_task = p.task_rows();
  const int64_t b = task / (p.kv_heads * blocks);
  const int64_t kh = task / blocks % p.kv_heads;
  const int64_t r0 = task % blocks * per_task;
  const int64_t nr = p.rows() - r0 < per_task ? p.rows() - r0 : per_task;
  switch (p.head_dim / kLanes) {
    case 1: AttendHeadDim<1>(p, b, kh, r0, nr, scratch); break;
    case 2: AttendHeadDim<2>(p, b, kh, r0, nr, scratch); break;
    case 3: AttendHeadDim<3>(p, b, kh, r0, nr, scratch); break;
    case 4: AttendHeadDim<4>(p, b, kh, r0, nr, scratch); break;
    case 5: AttendHeadDim<5>(p, b, kh, r0, nr, scratch); break;
    case 6: AttendHeadDim<6>(p, b, kh, r0, nr, scratch); break;
    case 7: AttendHeadDim<7>(p, b, kh, r0, nr, scratch); break;
    case 8: AttendHeadDim<8>(p, b, kh, r0, nr, scratch); break;
    default: break;
  }
}

bool Dims(const ffi::Buffer<ffi::F32>& x, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  const auto d = x.dimensions();
  return d.size() == 4 && d[0] == d0 && d[1] == d1 && d[2] == d2 && d[3] == d3;
}

bool MaskDims(const ffi::Buffer<ffi::PRED>& m, int64_t d0, int64_t d1, int64_t d2) {
  const auto d = m.dimensions();
  return d.size() == 3 && d[0] == d0 && d[1] == d1 && d[2] == d2;
}

ffi::Error CachedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                               ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                               ffi::Buffer<ffi::F32> k_past, ffi::Buffer<ffi::F32> v_past,
                               ffi::Buffer<ffi::PRED> m_past, ffi::Buffer<ffi::PRED> m_new,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> k_rot) {
  const auto qd = q.dimensions();
  const auto kd = k_past.dimensions();
  if (qd.size() != 4 || kd.size() != 4)
    return ffi::Error::InvalidArgument("cached_attention: q and k_past must be 4-D");
  Problem p;
  p.batch = qd[0], p.tokens = qd[1], p.heads = qd[2], p.head_dim = qd[3];
  p.kv_heads = kd[1], p.slots = kd[3];
  const int64_t B = p.batch, T = p.tokens, K = p.kv_heads, H = p.head_dim, S = p.slots;
  const auto cd = cos.dimensions(), sd = sin.dimensions();
  const bool rope_ok = cd.size() == 3 && cd[0] == B && cd[1] == T && cd[2] == H / 2 &&
                       sd.size() == 3 && sd[0] == B && sd[1] == T && sd[2] == H / 2;
  if (K < 1 || p.heads % K != 0 || H % kLanes != 0 || H > 8 * kLanes || !rope_ok ||
      !Dims(k_past, B, K, H, S) || !Dims(v_past, B, K, S, H) || !MaskDims(m_past, B, T, S) ||
      !Dims(k_new, B, T, K, H) || !Dims(v_new, B, T, K, H) || !MaskDims(m_new, B, T, T))
    return ffi::Error::InvalidArgument(
        "cached_attention: shapes must be q [B,T,N,H], k_new/v_new [B,T,K,H], cos/sin "
        "[B,T,H/2], k_past [B,K,H,S], v_past [B,K,S,H], m_past [B,T,S], m_new [B,T,T], "
        "N % K == 0, H in 16..128 by 16");
  p.q = q.typed_data(), p.k_new = k_new.typed_data(), p.v_new = v_new.typed_data();
  p.cos = cos.typed_data(), p.sin = sin.typed_data();
  p.k_past = k_past.typed_data(), p.v_past = v_past.typed_data();
  p.m_past = m_past.typed_data(), p.m_new = m_new.typed_data();
  p.out = out->typed_data(), p.k_rot = k_rot->typed_data();
  if (B * T == 0) return ffi::Error::Success();
  for (int64_t bt = 0; bt < B * T; ++bt)  // the new keys, rotated: read by every task
    for (int64_t kh = 0; kh < K; ++kh)
      Rotate(p.k_new + (bt * K + kh) * H, p.cos + bt * (H / 2), p.sin + bt * (H / 2), H / 2,
             p.k_rot + (bt * K + kh) * H);
  eagle3::ParallelFor(pool, B * K * p.row_blocks(), [&](int64_t task) {
    thread_local std::vector<float> scratch;
    AttendTask(p, task, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Eagle3CachedAttention, CachedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_past
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_past
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // m_past
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // m_new
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>());  // k_rot
