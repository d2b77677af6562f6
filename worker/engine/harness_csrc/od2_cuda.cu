// optdrift_od2::observe_rows on CUDA (the contract is in od2_ops.cpp). One launch per arena and
// step, captured into the fast engine's observation graph: each block takes a tile of one row,
// each thread walks its elements of the tile once (raw bits, salt computed in registers, nothing
// widened in memory), the block reduces its three sums through warp shuffles and shared memory,
// and one thread adds them to the case's counters with 64-bit atomics. Unsigned 64-bit addition
// wraps, so the counters hold digest.lanes' bits whatever order the blocks finish in.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>

#include "od2.h"
#include "od2_checks.h"

namespace optdrift_od2 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kTile = 16 * kThreads;  // elements of one row per block
constexpr int64_t kMaxGridY = 65535;

__device__ __forceinline__ uint64_t warp_sum(uint64_t value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  return value;
}

template <typename bits_t>
__global__ void __launch_bounds__(kThreads)
    observe_rows_kernel(const bits_t* __restrict__ data, const int64_t* __restrict__ lengths,
                        const int64_t* __restrict__ case_index, const int64_t rows,
                        const int64_t width, const int64_t cases, const uint64_t slot_term,
                        const uint64_t exponent_mask, unsigned long long* __restrict__ counts) {
  __shared__ uint64_t partial[3][kWarps];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t end = begin + kTile < width ? begin + kTile : width;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const bits_t* row = data + r * width;
    const int64_t length = lengths[r];
    const int64_t valid = length < 0 ? 0 : (length > width ? width : length);
    RowSums sums;
    for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
      const uint64_t x = static_cast<uint64_t>(row[j]);
      sums.nonfinite += nonfinite(x, exponent_mask) ? 1 : 0;
      if (j < valid) add_lanes(sums, x, salt(slot_term, static_cast<uint64_t>(j)));
    }
    const uint64_t totals[3] = {warp_sum(sums.nonfinite), warp_sum(sums.lane_a), warp_sum(sums.lane_b)};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
      for (int k = 0; k < 3; ++k) partial[k][warp] = totals[k];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t c = case_index[r];
      for (int k = 0; k < 3; ++k) {
        uint64_t block = 0;
        for (int w = 0; w < kWarps; ++w) block += partial[k][w];
        if (block != 0) atomicAdd(counts + k * cases + c, static_cast<unsigned long long>(block));
      }
    }
    __syncthreads();  // `partial` is reused by the next row
  }
}

void observe_rows_cuda(const at::Tensor& data, const at::Tensor& lengths, int64_t slot,
                       const at::Tensor& case_index, const at::Tensor& counts) {
  check_observe_rows(data, lengths, slot, case_index, counts);
  const auto rows = data.size(0), width = data.size(1);
  if (rows == 0 || width == 0) return;
  // case_index is not range-checked here: that would read it back to the host every step (a
  // synchronisation inside a graph capture). The engine builds it from its own row tables.
  const c10::cuda::CUDAGuard guard(data.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>((width + kTile - 1) / kTile),
                  static_cast<unsigned>(std::min(rows, kMaxGridY)));
  const uint64_t slot_term = (static_cast<uint64_t>(slot) + 1) * kSlot;
  const uint64_t mask = exponent_mask(data.scalar_type());
  auto* out = reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>());
  const auto* lens = lengths.const_data_ptr<int64_t>();
  const auto* index = case_index.const_data_ptr<int64_t>();
  const auto cases = counts.size(1);
  const void* raw = data.const_data_ptr();
  switch (data.element_size()) {
    case 1:
      observe_rows_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(
          static_cast<const uint8_t*>(raw), lens, index, rows, width, cases, slot_term, mask, out);
      break;
    case 2:
      observe_rows_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(
          static_cast<const uint16_t*>(raw), lens, index, rows, width, cases, slot_term, mask, out);
      break;
    case 4:
      observe_rows_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(
          static_cast<const uint32_t*>(raw), lens, index, rows, width, cases, slot_term, mask, out);
      break;
    default:
      observe_rows_kernel<uint64_t><<<grid, kThreads, 0, stream>>>(
          static_cast<const uint64_t*>(raw), lens, index, rows, width, cases, slot_term, mask, out);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(optdrift_od2, CUDA, m) { m.impl("observe_rows", &observe_rows_cuda); }

}  // namespace optdrift_od2
