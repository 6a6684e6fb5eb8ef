// Work that a team of threads runs phase after phase, where one descheduled thread holds no one
// up (on a machine whose cores also run a server and its clients, one is, every few steps):
// - each thread claims chunks of its own share from the front and, when that is done, the
//   others' from the back (one compare-and-swap per chunk, on a cache line of the share's own),
//   so every thread streams its share in order and only a late share's tail changes hands;
// - a thread that finds nothing left to claim waits for the chunks others hold, and after
//   kRedoAfter redoes those not yet done itself.
// A chunk's work must write its outputs' final values only (never an intermediate one), the same
// bits whoever runs it: a late thread then finishing a chunk again changes nothing, and its
// outputs must lie where no later phase writes (decoder_rows.cpp keeps them per layer).
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace kvmesh {

struct alignas(64) Share {
  std::atomic<uint64_t> word{0};  // front << 32 | back: chunks [front, back) not yet claimed
};

struct alignas(64) Done {
  std::atomic<int64_t> count{0};
};

// The first exception a chunk threw (none may leave a parallel region), rethrown after it.
struct Failure {
  std::mutex mutex;
  std::exception_ptr first;
  void rethrow() const {
    if (first) std::rethrow_exception(first);
  }
};

// One phase: `chunks` chunks, a Share per thread, a done flag per chunk and their count.
struct Phase {
  Share* shares;
  std::atomic<uint8_t>* flags;
  Done* done;
  int64_t chunks;
  Failure* failure;
};

// A waiter redoes others' chunks after max(kRedoAfter, twice its own mean chunk this phase).
constexpr auto kRedoAfter = std::chrono::microseconds(50);

// Tests only (set_phase_delay_us op): thread 1 sleeps this long before its first chunk of each
// phase, so the others redo it.
inline std::atomic<int64_t> test_delay_us{0};

// [begin, end) of thread t's part of n units over `threads` threads
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int threads) {
  return {n * t / threads, n * (t + 1) / threads};
}

// shares[t] = thread t's part of `chunks` chunks over `threads` threads
inline void split(Share* shares, int64_t chunks, int threads) {
  for (int t = 0; t < threads; ++t) {
    const auto [front, back] = share(chunks, t, threads);
    shares[t].word.store((uint64_t)front << 32 | (uint64_t)back, std::memory_order_relaxed);
  }
}

// the next chunk from the front (owner) or from the back (others); -1: none left
inline int64_t claim(Share& share, bool front) {
  uint64_t word = share.word.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t f = word >> 32, b = word & 0xFFFFFFFFu;
    if (f >= b) return -1;
    const uint64_t next = front ? (f + 1) << 32 | b : f << 32 | (b - 1);
    if (share.word.compare_exchange_weak(word, next, std::memory_order_acq_rel)) return front ? f : b - 1;
  }
}

// f(chunk) for every chunk of phase p, run by thread t of `threads`; returns once all are done
template <typename F>
void run_phase(const Phase& p, int threads, int t, F&& f) {
  using Clock = std::chrono::steady_clock;
  int64_t ran = 0;
  const auto finish = [&](int64_t c) {
    if (ran++ == 0 && t == 1 && test_delay_us.load(std::memory_order_relaxed) > 0)
      std::this_thread::sleep_for(std::chrono::microseconds(test_delay_us.load()));
    try {
      f(c);
    } catch (...) {
      std::lock_guard<std::mutex> hold(p.failure->mutex);
      if (!p.failure->first) p.failure->first = std::current_exception();
    }
    if (p.flags[c].exchange(1, std::memory_order_acq_rel) == 0)
      p.done->count.fetch_add(1, std::memory_order_acq_rel);
  };
  const auto started = Clock::now();
  for (int64_t c; (c = claim(p.shares[t], true)) >= 0;) finish(c);
  for (int o = 1; o < threads; ++o)
    for (int64_t c; (c = claim(p.shares[(t + o) % threads], false)) >= 0;) finish(c);
  if (p.done->count.load(std::memory_order_acquire) == p.chunks) return;
  const auto since = Clock::now();  // patience: twice this thread's mean chunk, at least kRedoAfter
  const auto patience = std::max<Clock::duration>(kRedoAfter, ran ? 2 * (since - started) / ran
                                                                   : Clock::duration{0});
  while (p.done->count.load(std::memory_order_acquire) < p.chunks) {
    if (Clock::now() - since < patience) {
      _mm_pause();
      continue;
    }
    bool all = true;  // every flag set: the chunks' outputs are visible, whatever the count says
    for (int64_t c = 0; c < p.chunks; ++c)
      if (p.flags[c].load(std::memory_order_acquire) == 0) {
        finish(c);
        all = false;
      }
    if (all) return;
  }
}

// f(chunk) for chunks [0, chunks) as one phase of a parallel region of `threads` threads
template <typename F>
void run_chunks(int64_t chunks, int threads, F&& f) {
  std::vector<Share> shares(threads);
  Done done;
  Failure failure;
  std::unique_ptr<std::atomic<uint8_t>[]> flags(new std::atomic<uint8_t>[chunks]());
  split(shares.data(), chunks, threads);
  const Phase p{shares.data(), flags.get(), &done, chunks, &failure};
#pragma omp parallel num_threads(threads)
  run_phase(p, threads, omp_get_thread_num(), f);
  failure.rethrow();
}

}  // namespace kvmesh
