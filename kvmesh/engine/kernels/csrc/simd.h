// What the kernels share besides the vector type (vec.h): the storage kinds of KV pages and
// scalar bf16 rounding. The Python loader builds the kernels for AVX-512 or for AVX2 + FMA +
// F16C, whichever the CPU has (build.py).
#pragma once

#include <cstdint>

#include "vec.h"

namespace kvmesh {

// Storage kinds of KV pages (kv/layout.py: fp32, bf16, fp8_e4m3 with power-of-two scales).
enum Storage : int { kF32 = 0, kBF16 = 1, kFP8 = 2 };

// fp32 -> bf16 with round-to-nearest-even (inputs are finite).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

}  // namespace kvmesh
