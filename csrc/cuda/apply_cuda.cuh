// Walks param, grad and the float32 states on the GPU and applies one rule from optimizer_math.h.
//
// The update is purely bandwidth bound (Adam on fp32 reads 16 and writes 12 bytes a parameter),
// so the kernel is built for memory throughput:
//   * each thread moves kPack = 4 elements at a time: one 16-byte load/store per fp32 stream
//     (8 bytes for fp16/bf16 parameters and gradients) when every pointer is aligned for it,
//     then a scalar loop for the tail (any length works, 1 and 4097 included);
//   * a grid-stride loop over a grid sized to fill the SMs (occupancy x SM count), not one
//     thread per element, so launch size is bounded and every SM stays busy to the end;
//   * no division or modulo in the indexing, only the rule's own arithmetic;
//   * launched on the current stream, C10_CUDA_KERNEL_LAUNCH_CHECK after each launch.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "../optimizer_math.h"

namespace optdrift::cuda {

constexpr int kThreadsPerBlock = 256;
constexpr int kPack = 4;  // elements a thread moves per vector access

// kPack values of T as one aligned memory transaction.
template <typename T>
struct alignas(sizeof(T) * kPack) Pack {
  T values[kPack];
};

template <int kStates>
struct StatePointers {
  float* data[kStates];
};

template <typename Rule, typename param_t>
__global__ void __launch_bounds__(kThreadsPerBlock)
    apply_rule_kernel(const Rule rule, param_t* __restrict__ param,
                      const param_t* __restrict__ grad, const StatePointers<Rule::kStates> states,
                      const int64_t packed_count, const int64_t numel) {
  constexpr int kStates = Rule::kStates;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  for (int64_t pack = first; pack < packed_count; pack += stride) {
    const int64_t base = pack * kPack;
    Pack<param_t> param_pack = *reinterpret_cast<const Pack<param_t>*>(param + base);
    const Pack<param_t> grad_pack = *reinterpret_cast<const Pack<param_t>*>(grad + base);
    Pack<float> state_packs[kStates];
#pragma unroll
    for (int k = 0; k < kStates; ++k)
      state_packs[k] = *reinterpret_cast<const Pack<float>*>(states.data[k] + base);

#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      float value = static_cast<float>(param_pack.values[j]);
      float state[kStates];
#pragma unroll
      for (int k = 0; k < kStates; ++k) state[k] = state_packs[k].values[j];
      rule(value, static_cast<float>(grad_pack.values[j]), state);
      param_pack.values[j] = static_cast<param_t>(value);
#pragma unroll
      for (int k = 0; k < kStates; ++k) state_packs[k].values[j] = state[k];
    }

    *reinterpret_cast<Pack<param_t>*>(param + base) = param_pack;
#pragma unroll
    for (int k = 0; k < kStates; ++k)
      *reinterpret_cast<Pack<float>*>(states.data[k] + base) = state_packs[k];
  }

  // Tail (numel not a multiple of kPack), or everything when a pointer is misaligned.
  for (int64_t i = packed_count * kPack + first; i < numel; i += stride) {
    float value = static_cast<float>(param[i]);
    float state[kStates];
#pragma unroll
    for (int k = 0; k < kStates; ++k) state[k] = states.data[k][i];
    rule(value, static_cast<float>(grad[i]), state);
    param[i] = static_cast<param_t>(value);
#pragma unroll
    for (int k = 0; k < kStates; ++k) states.data[k][i] = state[k];
  }
}

inline bool is_aligned(const void* pointer, size_t alignment) {
  return reinterpret_cast<uintptr_t>(pointer) % alignment == 0;
}

inline int multiprocessor_count(int device) {
  // Queried once per device; the attribute never changes for a process.
  static int cached[64] = {0};
  if (device < 64 && cached[device] > 0) return cached[device];
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device < 64) cached[device] = count;
  return count;
}

template <typename Rule, typename param_t>
void launch_typed(const Rule& rule, const at::Tensor& param, const at::Tensor& grad,
                  const std::array<const at::Tensor*, Rule::kStates>& states) {
  const int64_t numel = param.numel();
  auto* param_data = param.data_ptr<param_t>();
  const auto* grad_data = grad.data_ptr<param_t>();
  StatePointers<Rule::kStates> state_pointers;
  bool packable = is_aligned(param_data, sizeof(Pack<param_t>)) &&
                  is_aligned(grad_data, sizeof(Pack<param_t>));
  for (int k = 0; k < Rule::kStates; ++k) {
    state_pointers.data[k] = states[k]->template data_ptr<float>();
    packable = packable && is_aligned(state_pointers.data[k], sizeof(Pack<float>));
  }
  const int64_t packed_count = packable ? numel / kPack : 0;
  const int64_t work_items = std::max<int64_t>(packed_count, numel - packed_count * kPack);

  const int device = param.get_device();
  // Named first: a template-id's comma would split the C10_CUDA_CHECK macro argument.
  const auto kernel = apply_rule_kernel<Rule, param_t>;
  // Occupancy of this kernel instantiation, asked once per device: it depends only on the kernel
  // and the device, and asking the runtime on every launch cost host time on each of the ~10^5
  // launches of a battery (docs/PERFORMANCE.md, round 8).
  static int occupancy[64] = {0};
  int blocks_per_sm = device < 64 ? occupancy[device] : 0;
  if (blocks_per_sm == 0) {
    C10_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kThreadsPerBlock, 0));
    if (device < 64) occupancy[device] = blocks_per_sm;
  }
  const int64_t full_grid =
      static_cast<int64_t>(std::max(blocks_per_sm, 1)) * multiprocessor_count(device);
  const int64_t needed = (work_items + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min(full_grid, needed)));

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  kernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
      rule, param_data, grad_data, state_pointers, packed_count, numel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Dispatches on the parameter dtype (checked to be fp32/fp16/bf16 before this is called).
template <typename Rule>
void apply_rule(const char* op, const Rule& rule, const at::Tensor& param, const at::Tensor& grad,
                const std::array<const at::Tensor*, Rule::kStates>& states) {
  TORCH_CHECK(param.is_cuda(), op, ": argument 'param' is on ", param.device(),
              "; the CUDA kernel needs every tensor on a CUDA device");
  // A brace list shorter than kStates would compile (std::array pads with nullptr).
  for (const at::Tensor* state : states)
    TORCH_INTERNAL_ASSERT(state != nullptr, op, ": a state tensor was not passed to apply_rule");
  if (param.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(param.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "optdrift_apply_rule_cuda", [&] {
    launch_typed<Rule, scalar_t>(rule, param, grad, states);
  });
}

}  // namespace optdrift::cuda
