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
// rotating its queries. Scores are a broadcast-FMA over 2 vectors of slots at a time (the key
// cache is [H, S], slots contiguous), the softmax uses a vectorized exp (Cephes' polynomial,
// ~1 ulp), and the weighted sum of values a broadcast-FMA over the head dimension. Written once
// with GCC vector extensions and compiled twice, for AVX-512 (16 lanes) and for AVX2/FMA (8
// lanes, blocked for its 16 registers: `Narrow`); the CPU picks one at load time.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16_unaligned __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t vi8 __attribute__((vector_size(32)));

// Register blocking per vector width, so that the accumulators stay in registers.
//   kScoreRows: query rows scored together, 2 vectors of slots each (2 x rows accumulators);
//   kValueAcc: accumulators of the weighted sum of values (rows x vectors of the head dim).
// AVX-512 (32 registers of 16 lanes): all 8 rows x 32 slots; 4 rows x the whole head dim.
struct Wide {
  typedef vf16 V;
  typedef vf16_unaligned VU;
  typedef vi16 VI;
  static constexpr int kLanes = 16, kScoreRows = 8, kValueAcc = 0;  // 0: 4 rows x all of H
};
// AVX2 (16 registers of 8 lanes): 4 rows x 16 slots (8 accumulators + 2 keys + 1 query);
// 8 accumulators of the weighted sum (2 rows x 4 vectors of H, or 4 x 2). With the AVX-512
// blocking compiled for AVX2 the accumulators spilled: a SmolLM2 forward of 8 tokens took 73 ms
// against 46 with XLA's attention on a 2-core AMD EPYC.
struct Narrow {
  typedef vf8 V;
  typedef vf8_unaligned VU;
  typedef vi8 VI;
  static constexpr int kLanes = 8, kScoreRows = 4, kValueAcc = 8;
};

constexpr int kMaxRows = 8;  // query rows per task (4 where a kv head has at most 4)
constexpr int kFewRows = 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define EAGLE3_INLINE __attribute__((always_inline)) inline

template <class C>
EAGLE3_INLINE typename C::V Load(const float* p) {
  return *reinterpret_cast<const typename C::VU*>(p);
}
template <class C>
EAGLE3_INLINE void Store(float* p, typename C::V v) {
  *reinterpret_cast<typename C::VU*>(p) = v;
}
template <class C>
EAGLE3_INLINE typename C::V Splat(float x) { return typename C::V{} + x; }
template <class C>
EAGLE3_INLINE float Sum(typename C::V v) {
  float s = 0.0f;
  for (int i = 0; i < C::kLanes; ++i) s += v[i];
  return s;
}
template <class C>
EAGLE3_INLINE float Max(typename C::V v) {
  float m = v[0];
  for (int i = 1; i < C::kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// e^x for x <= 0 (a score minus its row's maximum); below -87 (e^x < 2^-125) it reads as 0, so
// masked slots (-inf) weigh exactly nothing. Cephes expf: x = n ln2 + r, e^r by a degree-6
// polynomial, 2^n through the exponent bits.
template <class C>
EAGLE3_INLINE typename C::V Exp(typename C::V x) {
  using V = typename C::V;
  using VI = typename C::VI;
  const V lo = Splat<C>(-87.0f);
  const V xc = x < lo ? lo : x;
  const V n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = Splat<C>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V y = p * r * r + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  const V e = y * reinterpret_cast<const V&>(bits);
  return x < lo ? Splat<C>(0.0f) : e;
}

struct Problem {
  const float *q, *k_new, *v_new, *cos, *sin, *k_past, *v_past;
  const bool *m_past, *m_new;
  float *out, *k_rot;
  int64_t batch, tokens, heads, kv_heads, head_dim, slots;
  int64_t group() const { return heads / kv_heads; }
  // Query rows per (b, kv head), and per task: padded rows would be scored for nothing.
  int64_t rows() const { return tokens * group(); }
  int64_t task_rows() const { return rows() <= kFewRows ? kFewRows : kMaxRows; }
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
// rows past nr repeat row r0 and are not stored; whole blocks of C::kScoreRows are computed.
template <class C, int HV, int kRows>  // vector config, head_dim / lanes, rows per task
EAGLE3_INLINE void AttendRows(const Problem& p, int64_t b, int64_t kh, int64_t r0, int64_t nr,
                              std::vector<float>& scratch) {
  using V = typename C::V;
  constexpr int L = C::kLanes;
  constexpr int SR = C::kScoreRows < kRows ? C::kScoreRows : kRows;  // rows scored together
  // The weighted sum: VC vectors of the head dim x PR rows per pass (PR divides SR, so a pass
  // reads only computed rows).
  constexpr int VC = C::kValueAcc == 0 ? HV : (HV % 4 == 0 ? 4 : (HV % 2 == 0 ? 2 : 1));
  constexpr int PR_ = C::kValueAcc == 0 ? 4 : C::kValueAcc / VC;
  constexpr int PR = PR_ < SR ? PR_ : SR;
  const int64_t T = p.tokens, S = p.slots, G = p.group(), H = HV * L;
  const int64_t nc = (nr + SR - 1) / SR * SR;  // rows computed
  alignas(64) float q_rot[kRows][HV * L];  // this task's queries, rotated
  const float* q[kRows];
  const bool* mp[kRows];
  const bool* mn[kRows];
  float* o[kRows];
  int64_t limit = 0;  // past slots [0, limit) hold every slot these rows see
  for (int r = 0; r < nc; ++r) {
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
  const int64_t past_pad = (limit + L - 1) / L * L;
  const int64_t new_pad = (T + L - 1) / L * L;
  const int64_t ld = past_pad + new_pad;
  scratch.resize(kRows * ld);
  float* sc = scratch.data();
  const float* kp = p.k_past + (b * p.kv_heads + kh) * H * S;  // [H, S]
  const float* vp = p.v_past + (b * p.kv_heads + kh) * S * H;  // [S, H]

  // Scores over the past: SR rows x 2L slots of accumulators, one pass over the head dim.
  for (int rb = 0; rb < nc; rb += SR) {
    int64_t s0 = 0;
    for (; s0 + 2 * L <= limit; s0 += 2 * L) {
      V a0[SR] = {}, a1[SR] = {};
      for (int64_t h = 0; h < H; ++h) {
        const V k0 = Load<C>(kp + h * S + s0), k1 = Load<C>(kp + h * S + s0 + L);
        for (int r = 0; r < SR; ++r) {
          const V qh = Splat<C>(q[rb + r][h]);
          a0[r] += qh * k0;
          a1[r] += qh * k1;
        }
      }
      for (int r = 0; r < SR; ++r) {
        Store<C>(sc + (rb + r) * ld + s0, a0[r]);
        Store<C>(sc + (rb + r) * ld + s0 + L, a1[r]);
      }
    }
    for (; s0 < limit; ++s0) {  // the last < 2L slots
      for (int r = rb; r < rb + SR; ++r) {
        float a = 0.0f;
        for (int64_t h = 0; h < H; ++h) a += q[r][h] * kp[h * S + s0];
        sc[r * ld + s0] = a;
      }
    }
  }
  // Scores over the new tokens (keys [H] contiguous at k_new[b, j, kh]).
  for (int64_t j = 0; j < T; ++j) {
    const float* kj = p.k_rot + ((b * T + j) * p.kv_heads + kh) * H;
    for (int r = 0; r < nc; ++r) {
      V a = {};
      for (int v = 0; v < HV; ++v) a += Load<C>(q[r] + v * L) * Load<C>(kj + v * L);
      sc[r * ld + past_pad + j] = Sum<C>(a);
    }
  }

  // Mask, scale, softmax numerators; the sums' reciprocals.
  const float scale = std::sqrt(static_cast<float>(H));
  float inv_sum[kRows];
  for (int r = 0; r < nc; ++r) {
    float* row = sc + r * ld;
    for (int64_t s = 0; s < limit; ++s) row[s] = mp[r][s] ? row[s] / scale : kNegInf;
    for (int64_t s = limit; s < past_pad; ++s) row[s] = kNegInf;
    for (int64_t j = 0; j < T; ++j) row[past_pad + j] = mn[r][j] ? row[past_pad + j] / scale : kNegInf;
    for (int64_t j = T; j < new_pad; ++j) row[past_pad + j] = kNegInf;
    V m = Splat<C>(kNegInf);
    for (int64_t s = 0; s < ld; s += L) {
      const V x = Load<C>(row + s);
      m = x > m ? x : m;
    }
    const float mx = Max<C>(m);
    const bool any = mx != kNegInf;
    V total = {};
    for (int64_t s = 0; s < ld; s += L) {
      const V e = Exp<C>(Load<C>(row + s) - (any ? mx : 0.0f));
      Store<C>(row + s, e);
      total += e;
    }
    inv_sum[r] = any ? 1.0f / Sum<C>(total) : 0.0f;
  }

  // Weighted sums of values: PR rows x VC vectors of the head dim per pass over the visible
  // slots (each output element sums the slots in order, whatever the blocking).
  for (int half = 0; half < nr; half += PR) {
    for (int v0 = 0; v0 < HV; v0 += VC) {
      V acc[PR][VC] = {};
      for (int64_t s = 0; s < limit; ++s) {
        V vs[VC];
        for (int v = 0; v < VC; ++v) vs[v] = Load<C>(vp + s * H + (v0 + v) * L);
        for (int r = 0; r < PR; ++r) {
          const V w = Splat<C>(sc[(half + r) * ld + s]);
          for (int v = 0; v < VC; ++v) acc[r][v] += w * vs[v];
        }
      }
      for (int64_t j = 0; j < T; ++j) {
        const float* vj = p.v_new + ((b * T + j) * p.kv_heads + kh) * H;
        V vs[VC];
        for (int v = 0; v < VC; ++v) vs[v] = Load<C>(vj + (v0 + v) * L);
        for (int r = 0; r < PR; ++r) {
          const V w = Splat<C>(sc[(half + r) * ld + past_pad + j]);
          for (int v = 0; v < VC; ++v) acc[r][v] += w * vs[v];
        }
      }
      for (int r = half; r < nr && r < half + PR; ++r)
        for (int v = 0; v < VC; ++v)
          Store<C>(o[r] + (v0 + v) * L, acc[r - half][v] * inv_sum[r]);
    }
  }
}

template <class C, int HV>
EAGLE3_INLINE void AttendHeadDim(const Problem& p, int64_t b, int64_t kh, int64_t r0,
                                 int64_t nr, std::vector<float>& scratch) {
  if (p.task_rows() == kFewRows) {
    AttendRows<C, HV, kFewRows>(p, b, kh, r0, nr, scratch);
  } else {
    AttendRows<C, HV, kMaxRows>(p, b, kh, r0, nr, scratch);
  }
}

template <class C>
EAGLE3_INLINE void AttendTask(const Problem& p, int64_t task, std::vector<float>& scratch) {
  const int64_t blocks = p.row_blocks(), per_task = p.task_rows();
  const int64_t b = task / (p.kv_heads * blocks);
  const int64_t kh = task / blocks % p.kv_heads;
  const int64_t r0 = task % blocks * per_task;
  const int64_t nr = p.rows() - r0 < per_task ? p.rows() - r0 : per_task;
  // head_dim is 16..128 in steps of 16 (checked by the caller): HV = head_dim / lanes.
  switch (p.head_dim / 16) {
    case 1: AttendHeadDim<C, 16 / C::kLanes>(p, b, kh, r0, nr, scratch); break;
    case 2: AttendHeadDim<C, 32 / C::kLanes>(p, b, kh, r0, nr, scratch); break;
    case 3: AttendHeadDim<C, 48 / C::kLanes>(p, b, kh, r0, nr, scratch); break;
    case 4: AttendHeadDim<C, 64 / C::kLanes>(p, b, kh, r0, nr, scratch); break;
    case 5: AttendHeadDim<C, 80 / C::kLanes>(p, b, kh, r0, nr, scratch); break;
    case 6: AttendHeadDim<C, 96 / C::kLanes>(p, b, kh, r0, nr, scratch); break;
    case 7: AttendHeadDim<C, 112 / C::kLanes>(p, b, kh, r0, nr, scratch); break;
    case 8: AttendHeadDim<C, 128 / C::kLanes>(p, b, kh, r0, nr, scratch); break;
    default: break;
  }
}

__attribute__((target("avx512f"))) void AttendTask512(const Problem& p, int64_t task,
                                                      std::vector<float>& scratch) {
  AttendTask<Wide>(p, task, scratch);
}

__attribute__((target("avx2,fma"))) void AttendTask256(const Problem& p, int64_t task,
                                                       std::vector<float>& scratch) {
  AttendTask<Narrow>(p, task, scratch);
}

using AttendTaskFn = void (*)(const Problem&, int64_t, std::vector<float>&);

// The widest variant this CPU runs (decided once; the library is used only with AVX2 and FMA).
const AttendTaskFn kAttendTask =
    __builtin_cpu_supports("avx512f") ? AttendTask512 : AttendTask256;

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
  if (K < 1 || p.heads % K != 0 || H % 16 != 0 || H < 16 || H > 128 || !rope_ok ||
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
    kAttendTask(p, task, scratch);
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
