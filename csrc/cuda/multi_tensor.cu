// CUDA multi-tensor ops (*_multi_step; the shared part is multi_tensor_ops.h): ONE kernel launch
// over every tensor of the call. The host writes a small table into device memory (per tensor:
// its pointers, its rule, whether its pointers allow vector access; then the chunk list of
// multi_tensor.h), and each block works on one chunk: kPack-element vector loads and stores as
// apply_cuda.cuh's kernel makes them where the tensor's pointers are aligned (chunk starts are
// multiples of kChunkElements, so aligned too), then a scalar loop for the chunk's tail.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../multi_tensor.h"
#include "../multi_tensor_ops.h"
#include "apply_cuda.cuh"

namespace optdrift::cuda {
namespace {

template <typename Rule, typename param_t>
struct DeviceEntry {
  param_t* param;
  const param_t* grad;
  float* states[Rule::kStates];
  Rule rule;
  int packable;  // every pointer aligned for Pack<> access
};

template <typename Rule, typename param_t>
__device__ __forceinline__ void step_element(const DeviceEntry<Rule, param_t>& entry, int64_t i) {
  float value = static_cast<float>(entry.param[i]);
  float state[Rule::kStates];
#pragma unroll
  for (int k = 0; k < Rule::kStates; ++k) state[k] = entry.states[k][i];
  entry.rule(value, static_cast<float>(entry.grad[i]), state);
  entry.param[i] = static_cast<param_t>(value);
#pragma unroll
  for (int k = 0; k < Rule::kStates; ++k) entry.states[k][i] = state[k];
}

template <typename Rule, typename param_t>
__global__ void __launch_bounds__(kThreadsPerBlock)
    multi_tensor_kernel(const DeviceEntry<Rule, param_t>* __restrict__ entries,
                        const multi::Chunk* __restrict__ chunks) {
  constexpr int kStates = Rule::kStates;
  const multi::Chunk chunk = chunks[blockIdx.x];
  const DeviceEntry<Rule, param_t> entry = entries[chunk.tensor];
  const int64_t end = chunk.start + chunk.length;
  const int64_t packed_count = entry.packable ? chunk.length / kPack : 0;

  for (int64_t pack = threadIdx.x; pack < packed_count; pack += blockDim.x) {
    const int64_t base = chunk.start + pack * kPack;
    Pack<param_t> param_pack = *reinterpret_cast<const Pack<param_t>*>(entry.param + base);
    const Pack<param_t> grad_pack = *reinterpret_cast<const Pack<param_t>*>(entry.grad + base);
    Pack<float> state_packs[kStates];
#pragma unroll
    for (int k = 0; k < kStates; ++k)
      state_packs[k] = *reinterpret_cast<const Pack<float>*>(entry.states[k] + base);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      float value = static_cast<float>(param_pack.values[j]);
      float state[kStates];
#pragma unroll
      for (int k = 0; k < kStates; ++k) state[k] = state_packs[k].values[j];
      entry.rule(value, static_cast<float>(grad_pack.values[j]), state);
      param_pack.values[j] = static_cast<param_t>(value);
#pragma unroll
      for (int k = 0; k < kStates; ++k) state_packs[k].values[j] = state[k];
    }
    *reinterpret_cast<Pack<param_t>*>(entry.param + base) = param_pack;
#pragma unroll
    for (int k = 0; k < kStates; ++k)
      *reinterpret_cast<Pack<float>*>(entry.states[k] + base) = state_packs[k];
  }

  // The chunk's tail (length not a multiple of kPack), or all of it when a pointer is misaligned.
  for (int64_t i = chunk.start + packed_count * kPack + threadIdx.x; i < end; i += blockDim.x)
    step_element(entry, i);
}

inline size_t round_up(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

template <typename Rule, typename param_t>
void launch_typed(const std::vector<multi::TensorEntry<Rule>>& entries,
                  const std::vector<multi::Chunk>& chunks, const at::Tensor& first) {
  std::vector<DeviceEntry<Rule, param_t>> table(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    DeviceEntry<Rule, param_t>& out = table[i];
    out.param = static_cast<param_t*>(entries[i].param);
    out.grad = static_cast<const param_t*>(entries[i].grad);
    out.rule = entries[i].rule;
    bool packable = is_aligned(out.param, sizeof(Pack<param_t>)) &&
                    is_aligned(out.grad, sizeof(Pack<param_t>));
    for (int k = 0; k < Rule::kStates; ++k) {
      out.states[k] = entries[i].states[k];
      packable = packable && is_aligned(out.states[k], sizeof(Pack<float>));
    }
    out.packable = packable ? 1 : 0;
  }
  // One host buffer (the entries, then the chunks at an aligned offset) copied to the device in
  // one transfer on the op's stream; the device copy is freed through the caching allocator,
  // stream-ordered after the kernel.
  const size_t entry_bytes = table.size() * sizeof(DeviceEntry<Rule, param_t>);
  const size_t chunk_offset = round_up(entry_bytes, alignof(multi::Chunk) > 16 ? alignof(multi::Chunk) : 16);
  const size_t total = chunk_offset + chunks.size() * sizeof(multi::Chunk);
  std::vector<unsigned char> host(total);
  std::memcpy(host.data(), table.data(), entry_bytes);
  std::memcpy(host.data() + chunk_offset, chunks.data(), chunks.size() * sizeof(multi::Chunk));
  const at::Tensor device_table =
      at::empty({static_cast<int64_t>(total)}, first.options().dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(first.get_device()).stream();
  // From pageable memory: the call returns once `host` has been staged, so it may go out of scope.
  C10_CUDA_CHECK(cudaMemcpyAsync(device_table.data_ptr(), host.data(), total,
                                 cudaMemcpyHostToDevice, stream));
  const auto* device_entries =
      reinterpret_cast<const DeviceEntry<Rule, param_t>*>(device_table.data_ptr<uint8_t>());
  const auto* device_chunks =
      reinterpret_cast<const multi::Chunk*>(device_table.data_ptr<uint8_t>() + chunk_offset);
  const auto kernel = multi_tensor_kernel<Rule, param_t>;
  kernel<<<static_cast<unsigned int>(chunks.size()), kThreadsPerBlock, 0, stream>>>(device_entries,
                                                                                   device_chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct CudaBackend {
  template <typename Rule>
  static void run(const char* op, const std::vector<multi::TensorEntry<Rule>>& entries,
                  const std::vector<multi::Chunk>& chunks, at::TensorList params) {
    const at::Tensor& first = params[0];
    TORCH_CHECK(first.is_cuda(), op, ": the CUDA kernel needs every tensor on a CUDA device");
    if (chunks.empty()) return;
    const c10::cuda::CUDAGuard device_guard(first.device());
    // Params are fp32/fp16/bf16 (checked): only those instantiations are compiled.
    switch (first.scalar_type()) {
      case at::kFloat: return launch_typed<Rule, float>(entries, chunks, first);
      case at::kHalf: return launch_typed<Rule, at::Half>(entries, chunks, first);
      case at::kBFloat16: return launch_typed<Rule, at::BFloat16>(entries, chunks, first);
      default: break;
    }
    TORCH_INTERNAL_ASSERT(false, op, ": a parameter dtype passed the checks that has no kernel");
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(optdrift, CUDA, m) {
  OPTDRIFT_REGISTER_MULTI_OPS(m, CudaBackend);
}

}  // namespace optdrift::cuda
