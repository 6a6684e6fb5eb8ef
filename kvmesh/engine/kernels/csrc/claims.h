// A work split that one descheduled thread does not hold up: each thread claims chunks of its
// own share from the front and, when that is done, the others' from the back. So every thread
// streams its share in order, and only a late share's tail changes hands. One compare-and-swap
// per chunk, on a cache line that belongs to the share.
#pragma once

#include <atomic>
#include <cstdint>

namespace kvmesh {

struct alignas(64) Share {
  std::atomic<uint64_t> word{0};  // front << 32 | back: chunks [front, back) not yet claimed
};

// shares[t] = thread t's part of `chunks` chunks over `threads` threads
inline void split(Share* shares, int64_t chunks, int threads) {
  for (int t = 0; t < threads; ++t) {
    const uint64_t front = chunks * t / threads, back = chunks * (t + 1) / threads;
    shares[t].word.store(front << 32 | back, std::memory_order_relaxed);
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

// f(chunk) for every chunk of `shares` (threads of them), run by thread t of a team
template <typename F>
void run_claimed(Share* shares, int threads, int t, F&& f) {
  for (int64_t c; (c = claim(shares[t], true)) >= 0;) f(c);
  for (int o = 1; o < threads; ++o)
    for (int64_t c; (c = claim(shares[(t + o) % threads], false)) >= 0;) f(c);
}

}  // namespace kvmesh
