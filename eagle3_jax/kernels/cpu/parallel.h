// Work split over XLA's intra-op thread pool, shared by the package's CPU kernels.
//
// ParallelFor(pool, tasks, fn) runs fn(i) for every i < tasks: the calling thread and up to
// (pool size - 1) helpers scheduled on the pool take task indices from an atomic counter, and
// the caller returns once every task is done. A helper that starts late finds no task left and
// exits: it touches only the shared counters, never `fn`, after the caller has returned.
// EAGLE3_JAX_CPU_KERNEL_THREADS=N caps the threads used (for benchmarks).
//
// UseAvx512(): whether the kernels run their AVX-512 variants (on a CPU with AVX-512F, unless
// EAGLE3_JAX_CPU_KERNEL_ISA=avx2 asks for the AVX2/FMA ones: to test and time those on an
// AVX-512 machine). Read when the library loads.

#ifndef EAGLE3_JAX_KERNELS_CPU_PARALLEL_H_
#define EAGLE3_JAX_KERNELS_CPU_PARALLEL_H_

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace eagle3 {

// Threads a kernel may use: the pool's size, capped by EAGLE3_JAX_CPU_KERNEL_THREADS.
inline int64_t ThreadCount(xla::ffi::ThreadPool& pool) {
  int64_t threads = pool.num_threads();
  if (threads < 1) threads = 1;
  if (const char* cap = std::getenv("EAGLE3_JAX_CPU_KERNEL_THREADS")) {
    const int64_t n = std::atoll(cap);
    if (n >= 1 && n < threads) threads = n;
  }
  return threads;
}

inline bool UseAvx512() {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512f")) return false;
  const char* isa = std::getenv("EAGLE3_JAX_CPU_KERNEL_ISA");
  return isa == nullptr || std::strcmp(isa, "avx2") != 0;
#else
  return false;
#endif
}

template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t tasks, Fn&& fn) {
  if (tasks <= 0) return;
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto counters = std::make_shared<Counters>();
  // Helpers reach `fn` only after claiming a task, and the caller waits until every claimed
  // task is done, so `fn` (on the caller's stack) outlives every use of it.
  auto* body = &fn;
  auto work = [counters, tasks, body] {
    for (int64_t i = counters->next.fetch_add(1); i < tasks; i = counters->next.fetch_add(1)) {
      (*body)(i);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t threads = ThreadCount(pool);
  const int64_t helpers = tasks - 1 < threads - 1 ? tasks - 1 : threads - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    auto copy = work;
    pool.Schedule(std::move(copy));
  }
  work();
  while (counters->done.load(std::memory_order_acquire) < tasks) {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }
}

}  // namespace eagle3

#endif  // EAGLE3_JAX_KERNELS_CPU_PARALLEL_H_
