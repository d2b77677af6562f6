// The od2 digest's per-element arithmetic (worker/engine/digest.py states the scheme), shared by
// the CPU loop (od2_ops.cpp) and the CUDA kernel (od2_cuda.cu). Everything is unsigned 64-bit
// arithmetic, which wraps modulo 2^64 exactly as the int64 torch ops of digest.py do, so the sums
// are the same bits whatever the order, the device or the launch shape.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define OD2_INLINE __host__ __device__ __forceinline__
#else
#define OD2_INLINE inline
#endif

namespace optdrift_od2 {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kSlot = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;

// splitmix64's finaliser (digest.mix64).
OD2_INLINE uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= kMix1;
  z ^= z >> 27;
  z *= kMix2;
  return z ^ (z >> 31);
}

// salt_s(j) = mix64(j * golden + (s + 1) * slot); `slot_term` is (s + 1) * slot, made once.
OD2_INLINE uint64_t salt(uint64_t slot_term, uint64_t j) { return mix64(j * kGolden + slot_term); }

// What one row adds to the case's three counters: non-finite elements, lane a, lane b.
struct RowSums {
  uint64_t nonfinite = 0;
  uint64_t lane_a = 0;
  uint64_t lane_b = 0;
};

// Element j's raw bits `x` (zero-extended) into the lanes.
OD2_INLINE void add_lanes(RowSums& sums, uint64_t x, uint64_t salt_j) {
  sums.lane_a += x * (salt_j | 1ULL);
  sums.lane_b += mix64(x ^ salt_j);
}

// torch.isfinite on the element's bits: a float is non-finite when its exponent bits are all
// ones. `exponent_mask` is 0 for integer and bool tensors, which are always finite.
OD2_INLINE bool nonfinite(uint64_t x, uint64_t exponent_mask) {
  return exponent_mask != 0 && (x & exponent_mask) == exponent_mask;
}

}  // namespace optdrift_od2
