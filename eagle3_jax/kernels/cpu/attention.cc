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
// at T = 8 those cost a SmolLM2 forward about as much as its matmuls' extra rows (measured on a
// 2-core AMD EPYC with AVX-512, 2026-12-04).
// Here one call does it all, each task reading its (b, kv head)'s cache once for up to 12 query
// rows, and only up to the last slot any of those rows sees (a cache allocated for 2048 tokens
// holding 256 costs 256).
//
// How: the new keys are rotated first; then tasks (b, kv head, block of up to 12 query rows, or
// 4 where a kv head has no more: a decode step's group; as many as make the count even) run on
// XLA's pool (parallel.h), each rotating its queries. The cache is read in chunks of 64 slots,
// each used by every row of the task while it is in cache. (Reading the keys [H, S] a block of
// rows at a time over all visible slots, as this kernel did before, was slow at the bucketed
// cache sizes decoding allocates: at a power-of-two S the key rows lie a power-of-two stride
// apart, share a few cache sets and evict each other between row blocks. SmolLM2, 30 layers,
// 8 tokens over 400 cached: 6.7 ms at S = 1024, 3.3 at S = 1040; in chunks 3.3 at both.)
// Scores are a broadcast-FMA over 2 vectors of slots at a time, the softmax uses a vectorized
// exp (Cephes' polynomial, ~1 ulp), and the weighted sum of values a broadcast-FMA over the
// head dimension, chunk by chunk, the sums carried between chunks. Written once with GCC vector
// extensions and compiled twice, for AVX-512 (16 lanes) and for AVX2/FMA (8 lanes, blocked for
// its 16 registers: `Narrow`); the CPU picks one at load time.

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
// A vector's worth of mask bytes (bool is one byte, 0 or 1), unaligned.
typedef uint8_t vb16 __attribute__((vector_size(16), aligned(1), may_alias));
typedef uint8_t vb8 __attribute__((vector_size(8), aligned(1), may_alias));

// Register blocking per vector width, so that the accumulators stay in registers.
//   kScoreRows x kScoreVecs: query rows x vectors of slots scored together (accumulators);
//   kValueAcc: accumulators of the weighted sum of values (rows x vectors of the head dim).
// AVX-512 (32 registers of 16 lanes): 4 rows x 64 slots; 4 rows x the whole head dim.
struct Wide {
  typedef vf16 V;
  typedef vf16_unaligned VU;
  typedef vi16 VI;
  typedef vb16 VB;
  static constexpr int kLanes = 16, kScoreRows = 4, kScoreVecs = 4, kValueAcc = 0;  // 0: all H
};
// AVX2 (16 registers of 8 lanes): 4 rows x 16 slots (8 accumulators + 2 keys + 1 query);
// 8 accumulators of the weighted sum (2 rows x 4 vectors of H, or 4 x 2). With the AVX-512
// blocking compiled for AVX2 the accumulators spilled: a SmolLM2 forward of 8 tokens took 73 ms
// against 46 with XLA's attention on a 2-core AMD EPYC.
struct Narrow {
  typedef vf8 V;
  typedef vf8_unaligned VU;
  typedef vi8 VI;
  typedef vb8 VB;
  static constexpr int kLanes = 8, kScoreRows = 4, kScoreVecs = 2, kValueAcc = 8;
};

// Query rows per task: up to kMaxRows (a task reads its kv head's cache once for all its rows),
// kFewRows where a kv head has no more (a decode step's group).
constexpr int kMaxRows = 12;
constexpr int kFewRows = 4;
// Cache slots per chunk: one chunk of keys and of values (16 KB each at head dim 64) stays in
// L1 while every row of a task reads it.
constexpr int64_t kChunk = 64;
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
  // Query rows per (b, kv head); tasks per (b, kv head) (row blocks) and rows per task: blocks
  // of at most kMaxRows, one more where that makes the task count even (on 2 cores 3 equal
  // tasks take 2 rounds, 4 of 3/4 the size take 1.5); a group of at most kFewRows rows stays
  // one task (it reads the cache once; split, each part would read it again).
  int64_t rows() const { return tokens * group(); }
  int64_t row_blocks() const {
    int64_t blocks = (rows() + kMaxRows - 1) / kMaxRows;
    if (rows() > kFewRows && batch * kv_heads * blocks % 2 == 1) ++blocks;
    return blocks;
  }
  int64_t task_rows() const { return (rows() + row_blocks() - 1) / row_blocks(); }
};

// 1 + the last slot among [0, slots) that mask row `m` marks, or 0: 8 slots a step while all
// are hidden, then one at a time.
EAGLE3_INLINE int64_t VisibleEnd(const bool* m, int64_t slots) {
  int64_t s = slots;
  for (uint64_t word = 0; s >= 8; s -= 8) {
    std::memcpy(&word, m + s - 8, 8);
    if (word != 0) break;
  }
  while (s > 0 && !m[s - 1]) --s;
  return s;
}

// The first slot among [0, slots) that mask row `m` marks, or `slots`: 8 slots a step while all
// are hidden. (A sliding window hides the slots before it: those are never read.)
EAGLE3_INLINE int64_t VisibleBegin(const bool* m, int64_t slots) {
  int64_t s = 0;
  for (uint64_t word = 0; s + 8 <= slots; s += 8) {
    std::memcpy(&word, m + s, 8);
    if (word != 0) break;
  }
  while (s < slots && !m[s]) ++s;
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

// Scores of R query rows against SV vectors of slots (keys `k` [H, ld_k], slots contiguous):
// out[r][s] = q[r] . k[:, s], summed over the head dim in order.
template <class C, int HV, int R, int SV>
EAGLE3_INLINE void AddScores(const float* k, int64_t ld_k, const float* const* q, float* out,
                             int64_t ld_out) {
  using V = typename C::V;
  constexpr int L = C::kLanes;
  V a[R][SV] = {};
  for (int h = 0; h < HV * L; ++h) {
    V kv[SV];
    for (int v = 0; v < SV; ++v) kv[v] = Load<C>(k + h * ld_k + v * L);
    for (int r = 0; r < R; ++r) {
      const float qh = q[r][h];  // scalar x vector: one vbroadcastss from memory (Splat's
      for (int v = 0; v < SV; ++v) a[r][v] += qh * kv[v];  // 0 + x adds a vaddss before it)
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < SV; ++v) Store<C>(out + r * ld_out + v * L, a[r][v]);
}

// row[s] for s < n: scaled (divided by `scale`) where `seen[s]`, else -inf; returns the max.
template <class C>
EAGLE3_INLINE typename C::V MaskedScale(float* row, const bool* seen, int64_t n, float scale,
                                        typename C::V m) {
  using V = typename C::V;
  using VI = typename C::VI;
  constexpr int L = C::kLanes;
  int64_t s = 0;
  for (; s + L <= n; s += L) {
    // One vector load of L mask bytes, widened in registers (not L one-byte inserts).
    const VI on = __builtin_convertvector(*reinterpret_cast<const typename C::VB*>(seen + s), VI);
    const V x = Load<C>(row + s);
    const V y = on != 0 ? x / scale : Splat<C>(kNegInf);
    Store<C>(row + s, y);
    m = y > m ? y : m;
  }
  float mx = Max<C>(m);
  for (; s < n; ++s) {
    row[s] = seen[s] ? row[s] / scale : kNegInf;
    mx = row[s] > mx ? row[s] : mx;
  }
  return Splat<C>(mx);
}

// out rows r0..r0+nr of (b, kh): rows are (token t, query head g of the group), r = t*G + g.
// The cache is read in chunks of kChunk slots, each chunk by every row of the task while it is
// in cache. Rows past nr, up to a whole block of C::kScoreRows, repeat row r0 for the scores
// and read row 0's weights; they are never stored.
template <class C, int HV, int kRows>  // vector config, head_dim / lanes, rows per task
EAGLE3_INLINE void AttendRows(const Problem& p, int64_t b, int64_t kh, int64_t r0, int64_t nr,
                              std::vector<float>& scratch) {
  using V = typename C::V;
  constexpr int L = C::kLanes;
  constexpr int SR = C::kScoreRows < kRows ? C::kScoreRows : kRows;  // rows scored together
  constexpr int SV = C::kScoreVecs;  // vectors of slots scored together
  constexpr int RUN = SV * L;        // slots per AddScores
  static_assert(kChunk % RUN == 0, "a chunk is whole runs");
  // The weighted sum: VC vectors of the head dim x PR rows per pass.
  constexpr int VC = C::kValueAcc == 0 ? HV : (HV % 4 == 0 ? 4 : (HV % 2 == 0 ? 2 : 1));
  constexpr int PR_ = C::kValueAcc == 0 ? 4 : C::kValueAcc / VC;
  constexpr int PR = PR_ < SR ? PR_ : SR;
  constexpr int kPadRows = kRows + SR + PR;  // rows a pass may touch past nr
  const int64_t T = p.tokens, S = p.slots, G = p.group(), H = HV * L;
  const int64_t nc = (nr + SR - 1) / SR * SR;  // rows scored
  alignas(64) float q_rot[kRows][HV * L];  // this task's queries, rotated
  const float* q[kPadRows];
  const bool* mp[kRows];
  const bool* mn[kRows];
  float* o[kRows];
  int64_t limit = 0;  // past slots [0, limit) hold every slot these rows see
  int64_t begin = S;  // and none before `begin`
  for (int r = 0; r < nr; ++r) {
    const int64_t row = r0 + r, t = row / G, g = row % G;
    Rotate(p.q + ((b * T + t) * p.heads + kh * G + g) * H, p.cos + (b * T + t) * (H / 2),
           p.sin + (b * T + t) * (H / 2), H / 2, q_rot[r]);
    q[r] = q_rot[r];
    mp[r] = p.m_past + (b * T + t) * S;
    mn[r] = p.m_new + (b * T + t) * T;
    o[r] = p.out + ((b * T + t) * p.heads + kh * G + g) * H;
    const int64_t end = VisibleEnd(mp[r], S);
    limit = end > limit ? end : limit;
    const int64_t first = VisibleBegin(mp[r], end);
    begin = first < begin ? first : begin;
  }
  // Whole chunks from the first one holding a seen slot: the slots before are never read (a
  // sliding window's), which changes no result (their weights are exactly 0).
  const int64_t first_chunk = (begin < limit ? begin : limit) / kChunk;
  for (int r = nr; r < kPadRows; ++r) q[r] = q_rot[0];
  const int64_t past_pad = (limit + RUN - 1) / RUN * RUN;
  const int64_t new_pad = (T + L - 1) / L * L;
  const int64_t ld = past_pad + new_pad;
  // scratch: scores [nc, ld] | weighted sums [kPadRows, H] | the last chunk of keys [H, kChunk]
  scratch.resize(nc * ld + kPadRows * H + H * kChunk + 16);
  float* sc = scratch.data();
  float* acc = sc + nc * ld;
  float* kc = acc + kPadRows * H;
  const float* kp = p.k_past + (b * p.kv_heads + kh) * H * S;  // [H, S]
  const float* vp = p.v_past + (b * p.kv_heads + kh) * S * H;  // [S, H]

  // Scores over the past, a chunk at a time.
  for (int64_t c0 = first_chunk * kChunk; c0 < limit; c0 += kChunk) {
    const int64_t n = limit - c0 < kChunk ? limit - c0 : kChunk;
    const int64_t runs = (n + RUN - 1) / RUN;
    const float* keys = kp + c0;
    int64_t ld_k = S;
    if (c0 + runs * RUN > S) {  // the last run would read past the cache: copy the chunk
      for (int64_t h = 0; h < H; ++h) {
        int64_t s = 0;
        for (; s < n; ++s) kc[h * kChunk + s] = kp[h * S + c0 + s];
        for (; s < runs * RUN; ++s) kc[h * kChunk + s] = 0.0f;
      }
      keys = kc, ld_k = kChunk;
    }
    for (int rb = 0; rb < nc; rb += SR)
      for (int64_t u = 0; u < runs; ++u)
        AddScores<C, HV, SR, SV>(keys + u * RUN, ld_k, q + rb, sc + rb * ld + c0 + u * RUN, ld);
  }
  // Scores over the new tokens (keys [H] contiguous at k_rot[b, j, kh]).
  for (int64_t j = 0; j < T; ++j) {
    const float* kj = p.k_rot + ((b * T + j) * p.kv_heads + kh) * H;
    for (int r = 0; r < nr; ++r) {
      V a = {};
      for (int v = 0; v < HV; ++v) a += Load<C>(q[r] + v * L) * Load<C>(kj + v * L);
      sc[r * ld + past_pad + j] = Sum<C>(a);
    }
  }

  // Mask, scale, softmax numerators; the sums' reciprocals.
  const float scale = std::sqrt(static_cast<float>(H));
  float inv_sum[kRows];
  for (int r = 0; r < nr; ++r) {
    float* row = sc + r * ld;
    const int64_t skip = first_chunk * kChunk;  // unscored: hidden from every row
    for (int64_t s = 0; s < skip; ++s) row[s] = kNegInf;
    V m = MaskedScale<C>(row + skip, mp[r] + skip, limit - skip, scale, Splat<C>(kNegInf));
    for (int64_t s = limit; s < past_pad; ++s) row[s] = kNegInf;
    m = MaskedScale<C>(row + past_pad, mn[r], T, scale, m);
    for (int64_t j = T; j < new_pad; ++j) row[past_pad + j] = kNegInf;
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
  const float* w[kPadRows];  // each row's weights: [ld] of sc
  for (int r = 0; r < kPadRows; ++r) w[r] = sc + (r < nr ? r : 0) * ld;

  // Weighted sums of values, PR rows x VC vectors of the head dim per pass over a chunk of
  // slots, the sums carried between chunks in `acc` (each output element sums the slots in
  // order, whatever the blocking); the new tokens' values last, then the normalization.
  const int64_t past_chunks = (limit + kChunk - 1) / kChunk;
  for (int64_t c = first_chunk; c <= past_chunks; ++c) {
    const bool past = c < past_chunks;
    const int64_t c0 = c * kChunk;
    const int64_t n = past ? (limit - c0 < kChunk ? limit - c0 : kChunk) : T;
    const int64_t col0 = past ? c0 : past_pad;  // the weights' column of value 0
    const float* vals = past ? vp + c0 * H : p.v_new + (b * T * p.kv_heads + kh) * H;
    const int64_t ld_v = past ? H : p.kv_heads * H;
    for (int rp = 0; rp < nr; rp += PR) {
      for (int v0 = 0; v0 < HV; v0 += VC) {
        V a[PR][VC];
        for (int r = 0; r < PR; ++r)
          for (int v = 0; v < VC; ++v)
            a[r][v] = c == first_chunk ? V{} : Load<C>(acc + (rp + r) * H + (v0 + v) * L);
        for (int64_t s = 0; s < n; ++s) {
          V vs[VC];
          for (int v = 0; v < VC; ++v) vs[v] = Load<C>(vals + s * ld_v + (v0 + v) * L);
          for (int r = 0; r < PR; ++r) {
            const float wr = w[rp + r][col0 + s];  // broadcast from memory, as above
            for (int v = 0; v < VC; ++v) a[r][v] += wr * vs[v];
          }
        }
        if (past) {
          for (int r = 0; r < PR; ++r)
            for (int v = 0; v < VC; ++v) Store<C>(acc + (rp + r) * H + (v0 + v) * L, a[r][v]);
        } else {
          for (int r = rp; r < nr && r < rp + PR; ++r)
            for (int v = 0; v < VC; ++v)
              Store<C>(o[r] + (v0 + v) * L, a[r - rp][v] * inv_sum[r]);
        }
      }
    }
  }
}

template <class C, int HV>
EAGLE3_INLINE void AttendHeadDim(const Problem& p, int64_t b, int64_t kh, int64_t r0,
                                 int64_t nr, std::vector<float>& scratch) {
  if (p.task_rows() <= kFewRows) {
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
  if (nr <= 0) return;
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

// The widest variant this CPU runs (decided once, parallel.h's UseAvx512; the library is used
// only with AVX2 and FMA).
const AttendTaskFn kAttendTask = eagle3::UseAvx512() ? AttendTask512 : AttendTask256;

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
