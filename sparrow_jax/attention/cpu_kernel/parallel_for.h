// ParallelFor over XLA:CPU's intra-op thread pool, shared by the CPU kernels.
#ifndef SPARROW_JAX_PARALLEL_FOR_H_
#define SPARROW_JAX_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace sparrow {

namespace ffi = xla::ffi;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Runs fn(i) for i in [0, n) on the caller and up to threads - 1 pool workers. The caller
// waits only for the work items, not for the scheduled tasks to start: a late task finds
// nothing left and returns, touching only the shared counters it co-owns. Out of items, the
// caller first spins a little (what is left is the item a worker holds: at most ~20 us at the
// quickstart's shape), then blocks: sleeping at once adds its own wake-up to every call
// (measured, rollout decode on 2 cores: caller wait 11-17 -> 4-8 us per call). Spinning
// without a bound instead starves a worker that the OS descheduled.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto body = std::make_shared<Fn>(std::move(fn));
  auto worker = [shared, body, n]() {
    for (int64_t i = shared->next++; i < n; i = shared->next++) {
      (*body)(i);
      if (++shared->done == n) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([worker] { worker(); });  // an rvalue: Schedule copies it
  worker();
  const auto out_of_items = std::chrono::steady_clock::now();
  while (shared->done.load() < n && std::chrono::steady_clock::now() - out_of_items < std::chrono::microseconds(25)) {
    CpuRelax();
  }
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == n; });
}

}  // namespace sparrow

#endif  // SPARROW_JAX_PARALLEL_FOR_H_
