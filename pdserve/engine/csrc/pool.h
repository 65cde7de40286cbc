// A parallel loop that never waits for a thread that has not started.
//
// at::parallel_for (OpenMP) splits a loop into one static share per thread and
// ends in a barrier. On these 2-core machines, shared with other jobs, the
// second thread is often descheduled: each barrier then waits for its next time
// slice, and a batch-1 decode step (~150 parallel loops) took 3-15x longer with
// 2 threads than with 1. Here the loop is cut into small chunks that the caller
// and the helper threads claim from one atomic counter. The caller works too,
// and waits only for chunks a helper has claimed and not finished; chunks no
// helper got to, the caller runs itself. So 2 threads are never much slower
// than 1, and as fast as OpenMP when both cores are free.
//
// Steps that also run oneDNN GEMMs (prefill chunks, decode batches past the fused
// layer's rows) run these loops on OpenMP's threads instead, the team the GEMMs use:
// OpenMP's threads spin for a while after each GEMM, and the pool's helpers then took
// turns with them on the same two cores (a batch-64 bf16 decode step 107 ms with the
// pool, 85 ms on OpenMP's team; its attention 1.14 -> 0.71 ms a layer). The chunks
// are still claimed from a counter, so uneven work (prefill items heaviest first)
// balances as in the pool. The model picks per step (`set_parallel_mode`);
// PDSERVE_PARALLEL=omp or =pool fixes one for every loop.
//
// Correctness never depends on a helper running (after a fork, say: the caller
// then runs every chunk). Helpers spin briefly between loops, then sleep.
//
// The ticket word holds the job's generation, its chunk count and the next
// chunk, so one compare-and-swap both claims a chunk and proves the job is
// still the one the helper saw. (With the chunk count in a word of its own, a
// helper late from the previous job could read the next job's count, claim a
// chunk on the old ticket and count it done twice: the caller then returned
// with a chunk still running, and a fused layer read half-written rows.)
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PDS_PAUSE() _mm_pause()
#else
#define PDS_PAUSE() std::this_thread::yield()
#endif

namespace pds {

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers are detached and die with the process
    return *pool;
  }

  // fn(b, e) over [begin, end) in chunks of at least `grain`. fn must not throw.
  void run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t range = end - begin;
    const int threads = at::get_num_threads();
    if (range <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    // ~8 chunks per thread: small enough that a late helper leaves little for the caller to wait on
    const int64_t chunk = std::max<int64_t>(grain, (range + threads * 8 - 1) / (threads * 8));
    const int64_t n_chunks = (range + chunk - 1) / chunk;  // <= threads * 8, far below kMaxChunks
    if (threads <= 1 || n_chunks <= 1 || n_chunks >= kMaxChunks || !busy_.try_lock()) {
      fn(begin, end);  // one thread, a tiny loop, or another caller holds the pool
      return;
    }
    ensure_helpers(threads - 1);
    fn_ = &fn;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    want_helpers_.store(threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ++gen_counter_;  // 32 bits, wrapping: the ticket's top half
    ticket_.store((gen << 32) | (static_cast<uint64_t>(n_chunks) << 16), std::memory_order_release);
    generation_.store(gen, std::memory_order_release);
    if (sleepers_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lk(sleep_mu_);
      sleep_cv_.notify_all();
    }
    work(gen);
    // what is left is in flight on a helper; yield now and then in case it waits for this core
    for (int spins = 0; done_.load(std::memory_order_acquire) < n_chunks; ++spins) {
      if (spins % 1024 == 1023) std::this_thread::yield();
      else PDS_PAUSE();
    }
    busy_.unlock();
  }

 private:
  Pool() = default;

  void ensure_helpers(int n) {
    while (static_cast<int>(helpers_) < n) {
      const int idx = helpers_++;
      std::thread([this, idx] { helper(idx); }).detach();
    }
  }

  // Claim and run chunks of job `gen` until none are left (or a newer job started).
  void work(uint64_t gen) {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if ((t >> 32) != gen) return;
      const int64_t n = static_cast<int64_t>((t >> 16) & 0xffffu), c = static_cast<int64_t>(t & 0xffffu);
      if (c >= n) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      const int64_t b = begin_ + c * chunk_;
      (*fn_)(b, std::min(end_, b + chunk_));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper(int idx) {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      uint64_t gen = seen;
      // spin ~100 us for the next loop (a decode step runs one every ~10-100 us), then sleep
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
      while ((gen = generation_.load(std::memory_order_acquire)) == seen) {
        for (int i = 0; i < 64; ++i) PDS_PAUSE();
        if (std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lk(sleep_mu_);
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          sleep_cv_.wait_for(lk, std::chrono::milliseconds(50),
                             [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      seen = gen;
      if (idx < want_helpers_.load(std::memory_order_relaxed)) work(gen);
    }
  }

  static constexpr int64_t kMaxChunks = 1 << 16;

  std::mutex busy_;
  std::atomic<uint64_t> ticket_{0};      // (generation << 32) | (chunk count << 16) | next chunk
  std::atomic<uint64_t> generation_{0};  // the job helpers should join
  std::atomic<int64_t> done_{0};
  uint32_t gen_counter_ = 0;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;  // read only by whoever holds a claimed chunk
  std::atomic<int> want_helpers_{0};
  std::atomic<int> helpers_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
};

// -1: PDSERVE_PARALLEL fixed nothing, the model's per-step choice holds; 0: pool; 1: OpenMP
inline int forced_mode() {
  static const int forced = [] {
    const char* v = std::getenv("PDSERVE_PARALLEL");
    if (v == nullptr) return -1;
    const std::string s(v);
    return s == "omp" ? 1 : s == "pool" ? 0 : -1;
  }();
  return forced;
}

inline std::atomic<int>& step_mode() {  // the model's choice for the current step: 0 pool, 1 OpenMP
  static std::atomic<int> mode{0};
  return mode;
}

inline bool use_openmp() {
  const int forced = forced_mode();
  return forced >= 0 ? forced == 1 : step_mode().load(std::memory_order_relaxed) == 1;
}

// fn over [begin, end) on OpenMP's team, chunks claimed from a counter as in the pool.
inline void omp_dynamic_for(int64_t begin, int64_t end, int64_t grain,
                            const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t range = end - begin;
  const int threads = at::get_num_threads();
  if (range <= 0) return;
  const int64_t chunk = std::max<int64_t>(std::max<int64_t>(grain, 1), (range + threads * 8 - 1) / (threads * 8));
  const int64_t n_chunks = (range + chunk - 1) / chunk;
  if (threads <= 1 || n_chunks <= 1 || at::in_parallel_region()) {
    fn(begin, end);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < n_chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t b = begin + c * chunk;
      fn(b, std::min(end, b + chunk));
    }
  }
}

// Drop-in for at::parallel_for in the kernels of this directory.
inline void parallel_for(int64_t begin, int64_t end, int64_t grain,
                         const std::function<void(int64_t, int64_t)>& fn) {
  if (use_openmp()) {
    omp_dynamic_for(begin, end, grain, fn);
    return;
  }
  Pool::get().run(begin, end, grain, fn);
}

}  // namespace pds
