// The pieces every bf16 linear kernel shares, so that each output's sum is the same bits
// whatever kernel or batch computes it: fp32 accumulators fed 32 k at a time by AVX512-BF16 dot
// products (or an exact emulation), then one horizontal sum in a fixed tree order (vec.h hsum,
// sums.h hsum16x16).
#pragma once

#include "sums.h"
#include "vec.h"

namespace kvmesh {

// acc += w . x over 32 bf16 lanes, with AVX512-BF16's dot product or by widening to fp32.
template <bool kDot>
inline Vec dot32(Vec acc, Bf32 w, Bf32 x);

template <>
inline Vec dot32<false>(Vec acc, Bf32 w, Bf32 x) {
  // odd lanes first, then even: the order AVX512-BF16 adds a pair in
  acc = fmadd(bf16_odd(w), bf16_odd(x), acc);
  return fmadd(bf16_even(w), bf16_even(x), acc);
}

#if defined(__AVX512F__)
template <>
__attribute__((target("avx512bf16"))) inline Vec dot32<true>(Vec acc, Bf32 w, Bf32 x) {
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)w.v, (__m512bh)x.v)};
}
#define KVMESH_BF16_DOT_TARGET __attribute__((target("avx512bf16")))
#else
template <>
inline Vec dot32<true>(Vec acc, Bf32 w, Bf32 x) {  // never chosen: no AVX512-BF16 in this build
  return dot32<false>(acc, w, x);
}
#define KVMESH_BF16_DOT_TARGET
#endif

}  // namespace kvmesh
