// A self-check of pds::parallel_for (pool.h) that tests/engine/test_kernels.py runs:
// every index of every loop must run exactly once, and before the loop returns.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "pool.h"

// Runs `loops` parallel loops over [0, n), [0, n / 2), [0, n / 4), ... (the chunk
// count changes from loop to loop, as it does from one matrix product to the next)
// in chunks of at least `grain`; each chunk
// spins `work` iterations per index so that helpers overlap the caller. Returns how
// many indices ran other than once by the time their loop returned.
int64_t pool_check(int64_t n, int64_t grain, int64_t loops, int64_t work) {
  std::vector<int> hits(n);
  int64_t bad = 0;
  for (int64_t l = 0; l < loops; ++l) {
    const int64_t len = std::max<int64_t>(1, n >> (l % 4));
    std::fill(hits.begin(), hits.begin() + len, 0);
    pds::parallel_for(0, len, grain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        volatile int64_t sink = 0;
        for (int64_t w = 0; w < work; ++w) sink = sink + w;
        hits[i] += 1;
      }
    });
    for (int64_t i = 0; i < len; ++i) bad += hits[i] != 1;
  }
  return bad;
}
