// Work spread over XLA's intra-op thread pool, shared by the CPU handlers (attention_cpu.cc,
// grouped_matmul_cpu.cc): `workers - 1` pool tasks and the calling thread take items in turn, so
// the call never waits on a pool that is busy elsewhere (the caller alone finishes the work).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace zaya {

// Runs work(item, worker) for every item in [0, items) on `workers` workers (worker indices
// 0 .. workers - 1, the caller the last); returns after all. A pool task that starts after the
// items ran out touches nothing.
template <typename Work>
void parallel_items(xla::ffi::ThreadPool& pool, int64_t items, int workers, Work work) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int active = 0;
    bool closed = false;
  };
  auto shared = std::make_shared<Shared>();
  auto run = [shared, items, &work](int worker) {
    {
      std::lock_guard<std::mutex> lock(shared->mu);
      if (shared->closed) return;
      ++shared->active;
    }
    for (int64_t i = shared->next++; i < items; i = shared->next++) work(i, worker);
    std::lock_guard<std::mutex> lock(shared->mu);
    --shared->active;
    shared->cv.notify_all();
  };
  for (int w = 0; w + 1 < workers; ++w) pool.Schedule([run, w] { run(w); });
  run(workers - 1);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->closed = true;
  shared->cv.wait(lock, [&] { return shared->active == 0; });
}

// min(items, the pool's threads + extra), at least 1.
inline int worker_count(xla::ffi::ThreadPool& pool, int64_t items, int extra) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, pool.num_threads() + extra)));
}

}  // namespace zaya
