// A matmul for few rows against an [out, in] weight, for XLA on CPU, through the XLA FFI.
//
//   y[m, o] = sum_i x[m, i] * w[o, i]      x [M, I] f32, w [O, I] f32, y [M, O] f32
//   y[m, o] = sum_i x[m, i] * w[i, o]      the same with w [I, O] (`Eagle3RowsMatmulInOut`:
//                                          the draft head's weights, an untied output head)
//   y[m, 16p + c] = sum_i x[m, i] * w[p, i, c]   the same with w as panels [O/16, I, 16]
//                                          (`Eagle3PanelMatmul`: the target's serving weights
//                                          on CPU; see "Panels" below)
//   y[m, o] = sum_i x[m, i] * float(w[o, i])   w [O, I] bf16, x and y f32
//                                          (`Eagle3RowsMatmulBf16`: the draft head when its
//                                          values are all bfloat16; AVX2 form on every CPU)
//
// Why: XLA CPU runs a dot with few rows (M = 1..64: a decode step, a draft-tree verification)
// as a general matmul that packs the whole weight into a scratch layout on every call, so a
// forward that should cost one read of the weights costs several (about 25 GFLOP/s where the
// machine does 10x that: a 2-core AMD EPYC with AVX-512, 2026-12-04). Here each weight row is
// read from memory once per call and used for all M rows while it is in L1.
//
// How:
//  * micro-kernel: RO = 4 weight rows x RM <= 6 input rows, 24 AVX-512 accumulators of 16
//    lanes (or 3 x 4 with AVX2: 12 of 8 lanes), one pass over `in` with the weight rows two
//    blocks ahead prefetched; the lanes are summed at the end in a fixed order. Every y[m, o] is
//    therefore computed by the same instructions whatever M is and wherever the row falls in a
//    block: a row's result does not depend on how many rows are in the call (a verification
//    forward and a decode step see bit-identical matmuls).
//  * threads: `out` is cut into chunks run on XLA's intra-op pool (parallel.h). Chunk
//    boundaries never change a result.
//  * x86-64 with AVX2 and FMA (AVX-512F used where present); `eagle3_rows_matmul_supported()`
//    says whether this CPU can run it, and the Python side falls back to the XLA dot when it cannot (or the library is
//    absent: eagle3_jax/kernels/matmul.py).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define EAGLE3_X86 1
#else
#define EAGLE3_X86 0
#endif

namespace ffi = xla::ffi;

namespace {

#if EAGLE3_X86

// ---- AVX-512: 4 weight rows x up to 6 input rows, 24 accumulators of 16 lanes. ------------
constexpr int kOut512 = 4, kRows512 = 6;

// Prefetch the weight rows two blocks ahead into L1 while this block's are used: with several
// rows per block the hardware prefetcher alone falls behind (8 rows: 33 -> 24 ms for SmolLM2's
// matrices on one core); with one row it keeps up, and the prefetches only cost issue slots.
#ifndef EAGLE3_PREFETCH_BLOCKS
#define EAGLE3_PREFETCH_BLOCKS 2
#endif
constexpr int kPrefetchBlocks = EAGLE3_PREFETCH_BLOCKS;

// bfloat16 weights (the draft head: every draft step's matmuls, 1-8 rows) go to L2 instead
// (`_MM_HINT_T1`, same distance). The draft reads its weights cold after the target's
// verification forward has streamed 540 MB past them, and L1 prefetches hold the few L1 miss
// buffers a core has, which capped those reads near 15 GB/s (the 8192-token output head, 9.4 MB,
// took 0.6 ms). On a 2-core AMD EPYC with AVX-512 (Zen 4), whole EAGLE rounds in one process,
// medians of 37 interleaved, ms, L1 -> L2: tree 2/3/8 over 256 cached 24.59 -> 23.56 and
// 24.94 -> 23.62, 3/4/8 over 600 28.31 -> 27.17; 1, 4, 8 or 16 blocks ahead, or `_MM_HINT_T2`,
// within noise of 2.
#ifndef EAGLE3_BF16_PREFETCH_HINT
#define EAGLE3_BF16_PREFETCH_HINT _MM_HINT_T1
#endif
template <int RO, typename W>
__attribute__((always_inline)) inline void PrefetchAhead(const W* w, int64_t in, int64_t i) {
  constexpr auto hint = sizeof(W) == 2 ? EAGLE3_BF16_PREFETCH_HINT : _MM_HINT_T0;
  for (int r = 0; r < RO; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(w + (r + kPrefetchBlocks * RO) * in + i), hint);
}

// y[m * ldy + r] = sum_i x[m * ldx + i] * w[r * in + i], r < RO, m < RM. The `in` tail (in % 16)
// is a masked load, so every element is summed by the same instructions.
template <int RO, int RM>
__attribute__((target("avx512f"), always_inline)) inline void Micro512(
    const float* x, int64_t ldx, const float* w, int64_t in, float* y, int64_t ldy) {
  __m512 acc[RO][RM];
  for (int r = 0; r < RO; ++r)
    for (int m = 0; m < RM; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t vec_end = in - in % 16;
  for (int64_t i = 0; i < vec_end; i += 16) {
    __m512 wv[RO];
    for (int r = 0; r < RO; ++r) wv[r] = _mm512_loadu_ps(w + r * in + i);
    if (RM > 1) PrefetchAhead<RO>(w, in, i);  // one row: the hardware prefetcher keeps up
    for (int m = 0; m < RM; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + i);
      for (int r = 0; r < RO; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  if (vec_end < in) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (in - vec_end)) - 1);
    __m512 wv[RO];
    for (int r = 0; r < RO; ++r) wv[r] = _mm512_maskz_loadu_ps(tail, w + r * in + vec_end);
    for (int m = 0; m < RM; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + vec_end);
      for (int r = 0; r < RO; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < RO; ++r)
    for (int m = 0; m < RM; ++m) y[m * ldy + r] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int RO>
__attribute__((target("avx512f"))) inline void Rows512(const float* x, int64_t n, const float* w,
                                                       int64_t in, float* y, int64_t out) {
  switch (n) {
    case 1: Micro512<RO, 1>(x, in, w, in, y, out); break;
    case 2: Micro512<RO, 2>(x, in, w, in, y, out); break;
    case 3: Micro512<RO, 3>(x, in, w, in, y, out); break;
    case 4: Micro512<RO, 4>(x, in, w, in, y, out); break;
    case 5: Micro512<RO, 5>(x, in, w, in, y, out); break;
    case 6: Micro512<RO, 6>(x, in, w, in, y, out); break;
    default: break;
  }
}

// Calls block(first_row, n) over `rows` in blocks of at most `max_rows`, made as even as
// possible (8 rows: 4 + 4, not 6 + 2: a 2-row block runs the FMA units at a third of their rate).
template <typename Block>
__attribute__((always_inline)) inline void EvenBlocks(int64_t rows, int64_t max_rows,
                                                      Block&& block) {
  const int64_t blocks = (rows + max_rows - 1) / max_rows;
  const int64_t base = rows / blocks, extra = rows % blocks;  // `extra` blocks get base + 1
  for (int64_t b = 0, m = 0; b < blocks; ++b) {
    const int64_t n = base + (b < extra ? 1 : 0);
    block(m, n);
    m += n;
  }
}

// All rows against RO weight rows.
template <int RO>
__attribute__((target("avx512f"))) void AllRows512(const float* x, int64_t rows, const float* w,
                                                   int64_t in, float* y, int64_t out) {
  EvenBlocks(rows, kRows512, [&](int64_t m, int64_t n) {
    Rows512<RO>(x + m * in, n, w, in, y + m * out, out);
  });
}

__attribute__((target("avx512f"))) void OutRange512(const float* x, int64_t rows, const float* w,
                                                    int64_t in, float* y, int64_t out,
                                                    int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + kOut512 <= end; o += kOut512) AllRows512<kOut512>(x, rows, w + o * in, in, y + o, out);
  for (; o < end; ++o) AllRows512<1>(x, rows, w + o * in, in, y + o, out);
}

// ---- AVX2 + FMA: 3 weight rows x up to 4 input rows, 12 accumulators of 8 lanes. -----------
// 12 accumulators + 3 weight vectors + 1 input vector fill the 16 registers exactly (4 x 3
// needs 17 and spills). With blocks made even (8 rows: 4 + 4, not 3 + 3 + 2), on a 2-core AMD
// EPYC without AVX-512 (the 121 matrices of a SmolLM2 forward, medians of 15 interleaved
// repeats, ms, 4 x 3 -> 3 x 4): T = 4 37.7 -> 34.3, 8 46.4 -> 39.6, 16 71.1 -> 60.6; T = 1
// unchanged (the memory floor). 4 x 4, 2 x 4, 2 x 6 and 8 weight rows for one input row: no
// better.
constexpr int kOut256 = 3, kRows256 = 4;

__attribute__((target("avx2,fma"))) inline float HorizontalSum(__m256 v) {
  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)): a fixed order, the same for every element.
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weights as float32, or as bfloat16 (`uint16_t`: the top half of a float32, so widening is a
// shift and exact): half the bytes for a weight that is memory-bound at few rows (the draft
// head, stored in bfloat16). The products and sums are float32's in the same order either way.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 LoadWeights256(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma"), always_inline)) inline __m256 LoadWeights256(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float WeightValue(float w) { return w; }
inline float WeightValue(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

template <int RO, int RM, typename W>
__attribute__((target("avx2,fma"), always_inline)) inline void Micro256(
    const float* x, int64_t ldx, const W* w, int64_t in, float* y, int64_t ldy) {
  __m256 acc[RO][RM];
  for (int r = 0; r < RO; ++r)
    for (int m = 0; m < RM; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t vec_end = in - in % 8;
  for (int64_t i = 0; i < vec_end; i += 8) {
    __m256 wv[RO];
    for (int r = 0; r < RO; ++r) wv[r] = LoadWeights256(w + r * in + i);
    PrefetchAhead<RO>(w, in, i);
    for (int m = 0; m < RM; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + i);
      for (int r = 0; r < RO; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < RO; ++r) {
    for (int m = 0; m < RM; ++m) {
      float s = HorizontalSum(acc[r][m]);
      for (int64_t i = vec_end; i < in; ++i) s += WeightValue(w[r * in + i]) * x[m * ldx + i];
      y[m * ldy + r] = s;
    }
  }
}

template <int RO, typename W>
__attribute__((target("avx2,fma"))) inline void Rows256(const float* x, int64_t n, const W* w,
                                                       int64_t in, float* y, int64_t out) {
  switch (n) {
    case 1: Micro256<RO, 1>(x, in, w, in, y, out); break;
    case 2: Micro256<RO, 2>(x, in, w, in, y, out); break;
    case 3: Micro256<RO, 3>(x, in, w, in, y, out); break;
    case 4: Micro256<RO, 4>(x, in, w, in, y, out); break;
    default: break;
  }
}

template <int RO, typename W>
__attribute__((target("avx2,fma"))) void AllRows256(const float* x, int64_t rows, const W* w,
                                                    int64_t in, float* y, int64_t out) {
  EvenBlocks(rows, kRows256, [&](int64_t m, int64_t n) {
    Rows256<RO>(x + m * in, n, w, in, y + m * out, out);
  });
}

template <typename W>
__attribute__((target("avx2,fma"))) void OutRange256(const float* x, int64_t rows, const W* w,
                                                     int64_t in, float* y, int64_t out,
                                                     int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + kOut256 <= end; o += kOut256) AllRows256<kOut256>(x, rows, w + o * in, in, y + o, out);
  for (; o < end; ++o) AllRows256<1>(x, rows, w + o * in, in, y + o, out);
}

// bfloat16 weights with more rows than one block: each group of weight rows is widened once
// into a float32 scratch (3 x in floats, in L1/L2) that every row block then reads, instead of
// widening it again per block (10 rows, the draft head: 2.5 -> ms a step against 2.1 for
// float32 weights). The same values and instructions as reading the bfloat16 directly.
template <int RO>
__attribute__((target("avx2,fma"))) void AllRowsWidened256(const float* x, int64_t rows,
                                                            const uint16_t* w, int64_t in,
                                                            float* y, int64_t out, float* scratch) {
  if (rows <= kRows256) {
    AllRows256<RO>(x, rows, w, in, y, out);
    return;
  }
  for (int64_t i = 0; i < RO * in; ++i) scratch[i] = WeightValue(w[i]);
  AllRows256<RO>(x, rows, static_cast<const float*>(scratch), in, y, out);
}

__attribute__((target("avx2,fma"))) void OutRange256Bf16(const float* x, int64_t rows,
                                                         const uint16_t* w, int64_t in, float* y,
                                                         int64_t out, int64_t begin, int64_t end) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < kOut256 * in) scratch.resize(kOut256 * in);
  int64_t o = begin;
  for (; o + kOut256 <= end; o += kOut256)
    AllRowsWidened256<kOut256>(x, rows, w + o * in, in, y + o, out, scratch.data());
  for (; o < end; ++o) AllRowsWidened256<1>(x, rows, w + o * in, in, y + o, out, scratch.data());
}

// ---- [in, out] weights: y[m, c] = sum_i x[m, i] * w[i, c] ------------------------------------
// The row of w for input i is contiguous in c, so a panel of output columns is updated from a
// broadcast x[m, i] times a vector of w's row: the sum for each y[m, c] runs over i in order,
// the same for every row and block (bit-identical whatever the number of rows, as above).

// AVX-512: NV <= 4 vectors of 16 columns x RM <= 6 rows; the panel's last vector is masked.
template <int NV, int RM>
__attribute__((target("avx512f"), always_inline)) inline void MicroInOut512(
    const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t in, float* y, int64_t ldy,
    __mmask16 last) {
  __m512 acc[NV][RM];
  for (int v = 0; v < NV; ++v)
    for (int m = 0; m < RM; ++m) acc[v][m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; ++i) {
    const float* wi = w + i * ldw;
    __m512 wv[NV];
    for (int v = 0; v < NV - 1; ++v) wv[v] = _mm512_loadu_ps(wi + 16 * v);
    wv[NV - 1] = _mm512_maskz_loadu_ps(last, wi + 16 * (NV - 1));
    if (RM > 1)
      for (int v = 0; v < NV; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(wi + 8 * ldw + 16 * v), _MM_HINT_T0);
    for (int m = 0; m < RM; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + i]);
      for (int v = 0; v < NV; ++v) acc[v][m] = _mm512_fmadd_ps(wv[v], xb, acc[v][m]);
    }
  }
  for (int m = 0; m < RM; ++m) {
    for (int v = 0; v < NV - 1; ++v) _mm512_storeu_ps(y + m * ldy + 16 * v, acc[v][m]);
    _mm512_mask_storeu_ps(y + m * ldy + 16 * (NV - 1), last, acc[NV - 1][m]);
  }
}

template <int NV>
__attribute__((target("avx512f"))) inline void RowsInOut512(const float* x, int64_t n,
                                                            const float* w, int64_t in, float* y,
                                                            int64_t out, __mmask16 last) {
  switch (n) {
    case 1: MicroInOut512<NV, 1>(x, in, w, out, in, y, out, last); break;
    case 2: MicroInOut512<NV, 2>(x, in, w, out, in, y, out, last); break;
    case 3: MicroInOut512<NV, 3>(x, in, w, out, in, y, out, last); break;
    case 4: MicroInOut512<NV, 4>(x, in, w, out, in, y, out, last); break;
    case 5: MicroInOut512<NV, 5>(x, in, w, out, in, y, out, last); break;
    case 6: MicroInOut512<NV, 6>(x, in, w, out, in, y, out, last); break;
    default: break;
  }
}

template <int NV>
__attribute__((target("avx512f"))) void PanelInOut512(const float* x, int64_t rows, const float* w,
                                                      int64_t in, float* y, int64_t out,
                                                      __mmask16 last) {
  EvenBlocks(rows, kRows512, [&](int64_t m, int64_t n) {
    RowsInOut512<NV>(x + m * in, n, w, in, y + m * out, out, last);
  });
}

// Output columns [begin, end) in panels of 64 (the last one narrower, masked).
__attribute__((target("avx512f"))) void InOutRange512(const float* x, int64_t rows, const float* w,
                                                      int64_t in, float* y, int64_t out,
                                                      int64_t begin, int64_t end) {
  for (int64_t c = begin; c < end; c += 64) {
    const int64_t width = end - c < 64 ? end - c : 64;
    const int64_t nv = (width + 15) / 16;
    const int64_t tail = width - 16 * (nv - 1);  // 1..16 columns in the last vector
    const __mmask16 last = static_cast<__mmask16>((1u << tail) - 1);
    switch (nv) {
      case 1: PanelInOut512<1>(x, rows, w + c, in, y + c, out, last); break;
      case 2: PanelInOut512<2>(x, rows, w + c, in, y + c, out, last); break;
      case 3: PanelInOut512<3>(x, rows, w + c, in, y + c, out, last); break;
      default: PanelInOut512<4>(x, rows, w + c, in, y + c, out, last); break;
    }
  }
}

// AVX2: 4 vectors of 8 columns x up to 3 rows; columns past the last full 8 are scalar.
template <int RM>
__attribute__((target("avx2,fma"), always_inline)) inline void MicroInOut256(
    const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t in, float* y, int64_t ldy) {
  __m256 acc[4][RM];
  for (int v = 0; v < 4; ++v)
    for (int m = 0; m < RM; ++m) acc[v][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in; ++i) {
    const float* wi = w + i * ldw;
    __m256 wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_loadu_ps(wi + 8 * v);
    for (int m = 0; m < RM; ++m) {
      const __m256 xb = _mm256_set1_ps(x[m * ldx + i]);
      for (int v = 0; v < 4; ++v) acc[v][m] = _mm256_fmadd_ps(wv[v], xb, acc[v][m]);
    }
  }
  for (int m = 0; m < RM; ++m)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + m * ldy + 8 * v, acc[v][m]);
}

__attribute__((target("avx2,fma"))) void InOutRange256(const float* x, int64_t rows, const float* w,
                                                       int64_t in, float* y, int64_t out,
                                                       int64_t begin, int64_t end) {
  int64_t c = begin;
  for (; c + 32 <= end; c += 32) {
    int64_t m = 0;
    for (; m + 3 <= rows; m += 3) MicroInOut256<3>(x + m * in, in, w + c, out, in, y + m * out + c, out);
    for (; m < rows; ++m) MicroInOut256<1>(x + m * in, in, w + c, out, in, y + m * out + c, out);
  }
  for (; c < end; ++c) {
    for (int64_t m = 0; m < rows; ++m) {
      float s = 0.0f;
      for (int64_t i = 0; i < in; ++i) s = std::fma(x[m * in + i], w[i * out + c], s);
      y[m * out + c] = s;
    }
  }
}

// ---- Panels: w [P, I, 16], output o = 16 p + c is column c of panel p ---------------------
//   y[m, 16 p + c] = sum_i x[m, i] * w[p, i, c]
// The [out, in] weight regrouped so that the 16 outputs of a panel are contiguous for each i
// (the target's serving weights on CPU: eagle3_jax/kernels/matmul.py, to_panels). A step over
// i is then 2 vector loads of w (one 64-byte line), one broadcast of x per row and 2 FMAs per
// row: up to 6 rows a pass, 12 accumulators + 2 weight vectors + 1 broadcast = 15 registers, no
// horizontal sums, and the FMA units near their peak when the panel is in cache (94 GFLOP/s on
// one core of a 2-core AMD EPYC against 65-75 for the 3 x 4 dot-product form above).
// What made the difference streaming from memory: while a panel is used, the next one is
// prefetched a line at a time, spread evenly over all the passes over this one, so the
// weights' memory traffic overlaps the arithmetic of every pass rather than stalling the
// first. The prefetches go to L2 (`kPanelPrefetchHint`), not L1: a panel (16 x in floats: 36 KB
// for in = 576, 96 KB for 1536) is larger than a 32 KB L1, so with more than one pass the
// current panel is re-read from L2, and prefetching the next one into L1 made those re-reads
// wait behind the memory traffic: compute and streaming ran one after the other, not together.
// On a 2-core AMD EPYC with AVX-512 (Zen 4), the 121 matrices alone, T = 8 (2 passes of 4
// rows), medians of 15 interleaved calls, ms, L1 -> L2: 26.2 -> 18.7 on 2 threads (T = 1
// 18.0 -> 18.2, the floor), 47 -> 28 on one; the whole forward 31.9 -> 22.7 (T = 16 33.9 ->
// 32.2, T = 1 20.2 -> 20.6: noise). The AVX2-only EPYC's numbers below were measured with L1
// prefetches (`CPPFLAGS=-DEAGLE3_PANEL_PREFETCH_HINT=_MM_HINT_T0` builds that form there):
// the 121 matrices of a SmolLM2 forward (2 threads, ms, 3 x 4 dot form -> panels): T = 1
// 21.0 -> 20.2, 8 24.9 -> 21.9, 16 40.5 -> 27.4, 64 134.6 -> 99.7 (173 GFLOP/s, the machine's
// measured matmul peak is ~179).
// Every y[m, o] is one float32 FMA chain over i in order, whatever the number of rows or the
// block a row falls in: bit-identical whatever the rows of the call (as the forms above).
// AVX2 + FMA only: it runs on AVX-512 CPUs too (a 12-row form with AVX-512VL's 32 registers,
// one pass for 8 rows, was no faster there, measured with L1 prefetches).
constexpr int kPanel = 16, kPanelRows = 6;
#ifndef EAGLE3_PANEL_PREFETCH_HINT
#define EAGLE3_PANEL_PREFETCH_HINT _MM_HINT_T1
#endif
constexpr auto kPanelPrefetchHint = EAGLE3_PANEL_PREFETCH_HINT;
// More rows than this are done in chunks, each streaming the panels of its range again, so
// that a chunk's x (<= 64 rows) stays in L2 while the panels stream.
constexpr int64_t kPanelRowChunk = 64;

template <int RM>
__attribute__((target("avx2,fma"), always_inline)) inline void MicroPanel(
    const float* x, int64_t ldx, const float* w, int64_t in, float* y, int64_t ldy,
    const char* prefetch, int64_t prefetch_step) {
  __m256 lo[RM], hi[RM];  // outputs 0..7 and 8..15 of the panel, per row
  for (int m = 0; m < RM; ++m) lo[m] = _mm256_setzero_ps();
  for (int m = 0; m < RM; ++m) hi[m] = _mm256_setzero_ps();
  int64_t ahead = 0;  // in 1/1024 of a cache line
  // in >= 1 (Run). As a do-while with an unconditional prefetch GCC keeps the
  // accumulators in registers; a for loop's zero-trip path, or a branch around the prefetch,
  // made it store them to the stack on every step (up to 3x slower).
  int64_t i = 0;
  do {
    const float* wi = w + i * kPanel;
    const __m256 w0 = _mm256_loadu_ps(wi), w1 = _mm256_loadu_ps(wi + 8);
    _mm_prefetch(prefetch + (ahead >> 10) * 64, kPanelPrefetchHint);
    ahead += prefetch_step;
    for (int m = 0; m < RM; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + i);
      lo[m] = _mm256_fmadd_ps(w0, xb, lo[m]);
      hi[m] = _mm256_fmadd_ps(w1, xb, hi[m]);
    }
  } while (++i < in);
  for (int m = 0; m < RM; ++m) {
    _mm256_storeu_ps(y + m * ldy, lo[m]);
    _mm256_storeu_ps(y + m * ldy + 8, hi[m]);
  }
}

// n <= kPanelRows rows of x against one panel.
__attribute__((target("avx2,fma"))) inline void PanelBlock(const float* x, int64_t n,
                                                           const float* w, int64_t in, float* y,
                                                           int64_t out, const char* prefetch,
                                                           int64_t step) {
  switch (n) {
    case 1: MicroPanel<1>(x, in, w, in, y, out, prefetch, step); break;
    case 2: MicroPanel<2>(x, in, w, in, y, out, prefetch, step); break;
    case 3: MicroPanel<3>(x, in, w, in, y, out, prefetch, step); break;
    case 4: MicroPanel<4>(x, in, w, in, y, out, prefetch, step); break;
    case 5: MicroPanel<5>(x, in, w, in, y, out, prefetch, step); break;
    case 6: MicroPanel<6>(x, in, w, in, y, out, prefetch, step); break;
    default: break;
  }
}

// Panels [begin, end) for every row (`out` = 16 * panels is y's row stride).
__attribute__((target("avx2,fma"))) void PanelRange(const float* x, int64_t rows,
                                                   const float* w, int64_t in, float* y,
                                                   int64_t out, int64_t begin, int64_t end) {
  const int64_t panel_floats = kPanel * in, lines = panel_floats / 16;  // 64-byte lines
  for (int64_t r0 = 0; r0 < rows; r0 += kPanelRowChunk) {
    const int64_t chunk_rows = rows - r0 < kPanelRowChunk ? rows - r0 : kPanelRowChunk;
    const int64_t passes = (chunk_rows + kPanelRows - 1) / kPanelRows;
    const int64_t per_pass = (lines + passes - 1) / passes;  // lines each pass prefetches
    const int64_t step = per_pass * 1024 / in + 1;
    for (int64_t p = begin; p < end; ++p) {
      const float* wp = w + p * panel_floats;
      // The next panel of this range; the last one "prefetches" itself (already in cache).
      const char* next = reinterpret_cast<const char*>(p + 1 < end ? wp + panel_floats : wp);
      int64_t pass = 0;
      EvenBlocks(chunk_rows, kPanelRows, [&](int64_t m, int64_t n) {
        const float* xm = x + (r0 + m) * in;
        float* ym = y + (r0 + m) * out + p * kPanel;
        PanelBlock(xm, n, wp, in, ym, out, next + pass++ * per_pass * 64, step);
      });
    }
  }
}

using OutRangeFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                            int64_t, int64_t);

// The widest variant this CPU runs (decided once; parallel.h's UseAvx512).
OutRangeFn SelectOutRange() {
  if (eagle3::UseAvx512()) return OutRange512;
  return OutRange256<float>;
}

const OutRangeFn kOutRange = SelectOutRange();

OutRangeFn SelectInOutRange() {
  if (eagle3::UseAvx512()) return InOutRange512;
  return InOutRange256;
}

const OutRangeFn kInOutRange = SelectInOutRange();

#endif  // EAGLE3_X86

// Chunks of `out`: about 4 per thread (load balance), at least `unit` outputs and a multiple of
// it (12 weight rows of [out, in]: whole blocks of 4 (AVX-512) and of 3 (AVX2); a 64-column
// panel of [in, out]).
int64_t ChunkSize(int64_t out, int64_t threads, int64_t unit) {
  int64_t chunk = (out + 4 * threads - 1) / (4 * threads);
  if (chunk < 8 * unit) chunk = 8 * unit;
  return (chunk + unit - 1) / unit * unit;
}

// The weight layouts the handlers take: w [out, in], [in, out], panels [P, in, 16], and
// [out, in] in bfloat16 (the AVX2 form on every CPU: AVX-512 ones run it too; at the few rows
// it is used for, a draft step, it is memory-bound).
enum class Layout { kOutIn, kInOut, kPanels, kOutInBf16 };

// y [rows, out] = x [rows, in] times w in `layout` (of element type WT): the shapes checked,
// then `out` cut into tasks run on XLA's intra-op pool.
template <Layout layout, ffi::DataType WT>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<WT>& w,
               ffi::ResultBuffer<ffi::F32>& y) {
#if EAGLE3_X86
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const bool panels = layout == Layout::kPanels;
  const bool out_in = layout == Layout::kOutIn || layout == Layout::kOutInBf16;
  if (x_dims.size() < 1 || (panels ? w_dims.size() != 3 || w_dims[2] != kPanel
                                   : w_dims.size() != 2))
    return ffi::Error::InvalidArgument(
        panels ? "panel_matmul: w must be [P, in, 16] and x [..., in]"
               : "rows_matmul: w must be 2-D and x [..., in]");
  const int64_t in = out_in || panels ? w_dims[1] : w_dims[0];
  const int64_t out = panels ? w_dims[0] * kPanel : (out_in ? w_dims[0] : w_dims[1]);
  if (x_dims[x_dims.size() - 1] != in)
    return ffi::Error::InvalidArgument("rows_matmul: x's last axis must equal w's `in`");
  const int64_t rows = x.element_count() / (in > 0 ? in : 1);
  if (rows == 0 || out == 0) return ffi::Error::Success();
  if (in == 0) {
    std::memset(y->typed_data(), 0, sizeof(float) * rows * out);
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t threads = eagle3::ThreadCount(pool);
  if constexpr (layout == Layout::kOutInBf16) {
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
    const int64_t chunk = ChunkSize(out, threads, 12);
    eagle3::ParallelFor(pool, (out + chunk - 1) / chunk, [&](int64_t c) {
      const int64_t begin = c * chunk;
      OutRange256Bf16(xp, rows, wp, in, yp, out, begin, begin + chunk < out ? begin + chunk : out);
    });
    return ffi::Error::Success();
  }
  const float* wp = reinterpret_cast<const float*>(w.untyped_data());
  if (panels) {
    // 1-4 tasks per thread of at least 8 panels, their sizes within one panel of each other
    // (a 36-panel matrix on 2 threads: 4 tasks of 9, not 8 + 8 + 8 + 8 + 4, whose odd task
    // left one thread idle for a fifth of the call). Each task prefetches its own panels after
    // the first.
    const int64_t count = out / kPanel;
    int64_t per_thread = count / (8 * threads);
    per_thread = per_thread < 1 ? 1 : (per_thread > 4 ? 4 : per_thread);
    const int64_t tasks = count < threads * per_thread ? count : threads * per_thread;
    eagle3::ParallelFor(pool, tasks, [&](int64_t c) {
      PanelRange(xp, rows, wp, in, yp, out, c * count / tasks, (c + 1) * count / tasks);
    });
    return ffi::Error::Success();
  }
  const OutRangeFn range = layout == Layout::kInOut ? kInOutRange : kOutRange;
  const int64_t chunk = ChunkSize(out, threads, layout == Layout::kInOut ? 64 : 12);
  eagle3::ParallelFor(pool, (out + chunk - 1) / chunk, [&](int64_t c) {
    const int64_t begin = c * chunk;
    range(xp, rows, wp, in, yp, out, begin, begin + chunk < out ? begin + chunk : out);
  });
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("rows_matmul: built for a CPU other than x86-64");
#endif
}

template <Layout layout>
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  return Run<layout, ffi::DataType::F32>(pool, x, w, y);
}

ffi::Error MatmulBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  return Run<Layout::kOutInBf16, ffi::DataType::BF16>(pool, x, w, y);
}

}  // namespace

// One binding for the four forms: (thread pool, x, w) -> y, x and y float32, w of `wtype`.
#define EAGLE3_MATMUL_HANDLER(symbol, impl, wtype)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl,                                            \
                                ffi::Ffi::Bind()                                         \
                                    .Ctx<ffi::ThreadPool>()                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()                        \
                                    .Arg<ffi::Buffer<wtype>>()                           \
                                    .Ret<ffi::Buffer<ffi::F32>>())

EAGLE3_MATMUL_HANDLER(Eagle3RowsMatmul, MatmulImpl<Layout::kOutIn>, ffi::F32);
EAGLE3_MATMUL_HANDLER(Eagle3RowsMatmulInOut, MatmulImpl<Layout::kInOut>, ffi::F32);
EAGLE3_MATMUL_HANDLER(Eagle3PanelMatmul, MatmulImpl<Layout::kPanels>, ffi::F32);
EAGLE3_MATMUL_HANDLER(Eagle3RowsMatmulBf16, MatmulBf16Impl, ffi::BF16);

// 1 when the [in, out] form beats the XLA dot on this CPU, so that it is the default there
// (the Python side's "matmul_in_out" family): with AVX-512. On a 2-core AMD EPYC with AVX2
// only, XLA's dot was as fast or faster for the draft head's matrices at 1-16 rows (one draft
// layer, w = 1: 1.58 ms against 1.93; a whole EAGLE round 1.86 -> 1.68 decode steps).
extern "C" int eagle3_rows_matmul_in_out_preferred() {
#if EAGLE3_X86
  return eagle3::UseAvx512() ? 1 : 0;
#else
  return 0;
#endif
}

// 1 when this CPU can run the kernel (x86-64 with AVX2 and FMA), else 0.
extern "C" int eagle3_rows_matmul_supported() {
#if EAGLE3_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
#else
  return 0;
#endif
}
