// 8-bit blockwise states: quantization to a 256-entry map and the per-element step, shared by the
// CPU (cpu/blockwise8.cpp) and CUDA (cuda/blockwise8.cu) kernels.
//
// A state element is a uint8 code, an index into a sorted float32 map of 256 values in [-1, 1]
// (worker/quant_map.py builds the "dynamic" maps); its value is map[code] * absmax[block], blocks
// being kBlockSize consecutive elements (the last one may be partial). One optimizer step on a
// block:
//   1. dequantize every state element with the block's current absmax (float32 product);
//   2. apply the 32-bit rule of optimizer_math.h in float32: it updates the float32 states and
//      then the parameter *from those float32 states* (not from their requantized values);
//   3. the block's new absmax per state = max |float32 state| over the block;
//   4. requantize: code = nearest map value to state / absmax (division in float32; an all-zero
//      block, absmax 0, gets the code of 0 everywhere).
//
// Nearest code and ties: with below <= x < above the two map values around x, the code of below
// is taken when x - below < above - x, the code of above when it is greater; when the two float32
// differences are equal the code with the smaller magnitude wins (ties toward zero), so the rule
// is symmetric in sign. x below map[0] or above map[255] clamps to the end code. A NaN x gets code
// 0 (every comparison with NaN is false): the non-finite gradient rule below keeps NaN out of the
// states, so this only happens when a finite gradient overflows float32 (|g| > ~1.8e19 squared).
//
// Non-finite gradients: an element whose raw gradient (before gnorm_scale) is NaN or +-Inf is
// skipped: its parameter is left untouched and its states keep their dequantized values, which are
// requantized with the block's new absmax like every other element (so its code can change when
// the absmax does, by at most the rounding to the nearest code). Why: a NaN or Inf in a state
// would become the block's absmax and destroy the other 255 elements' states; skipping confines
// the damage to the element whose gradient was bad, as an overflow-skipping scaler does.
#pragma once

#include <cstdint>

#include "blockwise8_layout.h"
#include "optimizer_math.h"

namespace optdrift::blockwise8 {

// True for finite x, false for NaN and +-Inf (Inf - Inf and NaN - NaN are NaN, and NaN != 0).
// Plain IEEE arithmetic, the same on host and device (the build does not use fast-math).
OPTDRIFT_HOST_DEVICE bool is_finite(float x) { return (x - x) == 0.0f; }

// The code of the map value nearest to x (ties toward zero); `map` is sorted ascending.
OPTDRIFT_HOST_DEVICE uint8_t quantize_nearest(const float* map, float x) {
  // count = number of map values <= x, found by a branch-light binary search over 256 entries.
  int count = 0;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int step = kMapSize / 2; step > 0; step >>= 1) {
    if (map[count + step - 1] <= x) count += step;
  }
  if (count == kMapSize - 1 && map[kMapSize - 1] <= x) count = kMapSize;
  if (count == 0) return 0;
  if (count == kMapSize) return static_cast<uint8_t>(kMapSize - 1);
  const float below = map[count - 1];
  const float above = map[count];
  const float to_below = x - below;
  const float to_above = above - x;
  int code;
  if (to_below < to_above) {
    code = count - 1;
  } else if (to_above < to_below) {
    code = count;
  } else {
    code = (x >= 0.0f) ? count - 1 : count;  // tie: toward zero
  }
  return static_cast<uint8_t>(code);
}

// The normalised value that is quantized: state / absmax, or 0 for an all-zero block.
OPTDRIFT_HOST_DEVICE float normalise(float state, float absmax) {
  return absmax > 0.0f ? state / absmax : 0.0f;
}

// Step 2 for one element: the 32-bit rule, unless the gradient is not finite. Returns whether the
// element was updated.
template <typename Rule>
OPTDRIFT_HOST_DEVICE bool update_element(const Rule& rule, float& param, float raw_grad,
                                         float (&state)[Rule::kStates]) {
  if (!is_finite(raw_grad)) return false;
  rule(param, raw_grad, state);
  return true;
}

}  // namespace optdrift::blockwise8

namespace optdrift::blockwise8 {

// Raw pointers to one op's quantized states: codes, per-block absmax and the map of each state.
template <int kStates>
struct QuantizedStates {
  uint8_t* codes[kStates];
  float* absmax[kStates];
  const float* map[kStates];
};

}  // namespace optdrift::blockwise8
