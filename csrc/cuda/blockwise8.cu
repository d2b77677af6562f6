// CUDA implementations of the 8-bit blockwise optimizers. The step on one block (dequantize, the
// float32 rule of optimizer_math.h, new absmax, requantize to the nearest code) is described in
// quant_map.h and is the same function the CPU kernels call, element for element.
//
// One CUDA block of kBlockSize threads handles one quantization block at a time (a grid-stride
// loop over blocks), one element per thread: the maps sit in shared memory for the binary search,
// the block's absmax is a warp-shuffle max then a max over the warps' maxima. Max is exact and
// order-free, so the absmax (and with it every code) is the CPU's whenever the float32 states are.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <array>

#include "../blockwise8_checks.h"
#include "../optimizer_math.h"
#include "../quant_map.h"

namespace optdrift::cuda {
namespace {

using blockwise8::kBlockSize;
using blockwise8::kMapSize;
static_assert(kMapSize == kBlockSize, "each thread loads one map entry per state");

constexpr int kWarps = kBlockSize / 32;
// Enough CUDA blocks to fill an H200 many times over; larger tensors loop.
constexpr int64_t kMaxGrid = 1 << 16;

template <typename Rule, typename param_t>
__global__ void __launch_bounds__(kBlockSize)
    blockwise8_kernel(const Rule rule, param_t* __restrict__ param,
                      const param_t* __restrict__ grad,
                      const blockwise8::QuantizedStates<Rule::kStates> states,
                      const int64_t numel, const int64_t blocks) {
  constexpr int kStates = Rule::kStates;
  __shared__ float maps[kStates][kMapSize];
  __shared__ float warp_max[kStates][kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;

#pragma unroll
  for (int k = 0; k < kStates; ++k) maps[k][threadIdx.x] = states.map[k][threadIdx.x];
  __syncthreads();

  for (int64_t block = blockIdx.x; block < blocks; block += gridDim.x) {
    const int64_t i = block * kBlockSize + threadIdx.x;
    const bool active = i < numel;
    float state[kStates];
#pragma unroll
    for (int k = 0; k < kStates; ++k)
      state[k] = active ? maps[k][states.codes[k][i]] * states.absmax[k][block] : 0.0f;
    if (active) {
      float value = static_cast<float>(param[i]);
      if (blockwise8::update_element(rule, value, static_cast<float>(grad[i]), state))
        param[i] = static_cast<param_t>(value);
    }

    // Every thread has read the old absmax above, before this barrier; it is written after.
#pragma unroll
    for (int k = 0; k < kStates; ++k) {
      float local = fabsf(state[k]);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1)
        local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
      if (lane == 0) warp_max[k][warp] = local;
    }
    __syncthreads();

#pragma unroll
    for (int k = 0; k < kStates; ++k) {
      float block_absmax = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) block_absmax = fmaxf(block_absmax, warp_max[k][w]);
      if (threadIdx.x == 0) states.absmax[k][block] = block_absmax;
      if (active)
        states.codes[k][i] =
            blockwise8::quantize_nearest(maps[k], blockwise8::normalise(state[k], block_absmax));
    }
    __syncthreads();  // warp_max is reused by the next block
  }
}

struct StateTensors {
  const at::Tensor* codes;
  const at::Tensor* absmax;
  const at::Tensor* map;
};

template <typename Rule, typename param_t>
void launch_typed(const Rule& rule, const at::Tensor& param, const at::Tensor& grad,
                  const std::array<StateTensors, Rule::kStates>& tensors) {
  const int64_t numel = param.numel();
  const int64_t blocks = (numel + kBlockSize - 1) / kBlockSize;
  blockwise8::QuantizedStates<Rule::kStates> states;
  for (int k = 0; k < Rule::kStates; ++k) {
    states.codes[k] = tensors[k].codes->template data_ptr<uint8_t>();
    states.absmax[k] = tensors[k].absmax->template data_ptr<float>();
    states.map[k] = tensors[k].map->template data_ptr<float>();
  }
  const int grid = static_cast<int>(std::min<int64_t>(blocks, kMaxGrid));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(param.get_device()).stream();
  blockwise8_kernel<Rule, param_t><<<grid, kBlockSize, 0, stream>>>(
      rule, param.data_ptr<param_t>(), grad.data_ptr<param_t>(), states, numel, blocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Rule>
void apply_blockwise(const char* op, const Rule& rule, const at::Tensor& param,
                     const at::Tensor& grad,
                     const std::array<StateTensors, Rule::kStates>& tensors) {
  TORCH_CHECK(param.is_cuda(), op, ": argument 'param' is on ", param.device(),
              "; the CUDA kernel needs every tensor on a CUDA device");
  if (param.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(param.device());
  // The dispatch name must be a literal (torch makes it constexpr); `op` names the caller.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(),
                                  "blockwise8_step", [&] {
    launch_typed<Rule, scalar_t>(rule, param, grad, tensors);
  });
}

void adam_8bit_blockwise_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                                  const at::Tensor& exp_avg_codes,
                                  const at::Tensor& exp_avg_absmax,
                                  const at::Tensor& exp_avg_sq_codes,
                                  const at::Tensor& exp_avg_sq_absmax,
                                  const at::Tensor& signed_map, const at::Tensor& unsigned_map,
                                  int64_t step, double lr, double beta1, double beta2, double eps,
                                  double weight_decay, double gnorm_scale, bool skip_zeros) {
  checks::check_adam_8bit_blockwise_step(param, grad, exp_avg_codes, exp_avg_absmax,
                                         exp_avg_sq_codes, exp_avg_sq_absmax, signed_map,
                                         unsigned_map, step, lr, beta1, beta2, eps, weight_decay,
                                         gnorm_scale);
  const AdamRule rule =
      make_adam_rule(step, lr, beta1, beta2, eps, weight_decay, gnorm_scale, skip_zeros);
  apply_blockwise("adam_8bit_blockwise_step_cuda", rule, param, grad,
                  {{{&exp_avg_codes, &exp_avg_absmax, &signed_map},
                    {&exp_avg_sq_codes, &exp_avg_sq_absmax, &unsigned_map}}});
}

void ademamix_8bit_blockwise_step_cuda(
    const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_fast_codes,
    const at::Tensor& exp_avg_fast_absmax, const at::Tensor& exp_avg_slow_codes,
    const at::Tensor& exp_avg_slow_absmax, const at::Tensor& exp_avg_sq_codes,
    const at::Tensor& exp_avg_sq_absmax, const at::Tensor& signed_map,
    const at::Tensor& unsigned_map, int64_t step, double lr, double beta1, double beta2,
    double beta3, double alpha, double eps, double weight_decay, double gnorm_scale) {
  checks::check_ademamix_8bit_blockwise_step(
      param, grad, exp_avg_fast_codes, exp_avg_fast_absmax, exp_avg_slow_codes,
      exp_avg_slow_absmax, exp_avg_sq_codes, exp_avg_sq_absmax, signed_map, unsigned_map, step,
      lr, beta1, beta2, beta3, alpha, eps, weight_decay, gnorm_scale);
  const AdemamixRule rule = make_ademamix_rule(step, lr, beta1, beta2, beta3, alpha, eps,
                                               weight_decay, gnorm_scale);
  apply_blockwise("ademamix_8bit_blockwise_step_cuda", rule, param, grad,
                  {{{&exp_avg_fast_codes, &exp_avg_fast_absmax, &signed_map},
                    {&exp_avg_slow_codes, &exp_avg_slow_absmax, &signed_map},
                    {&exp_avg_sq_codes, &exp_avg_sq_absmax, &unsigned_map}}});
}

void lion_8bit_blockwise_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                                  const at::Tensor& exp_avg_codes,
                                  const at::Tensor& exp_avg_absmax, const at::Tensor& signed_map,
                                  double lr, double beta1, double beta2, double weight_decay,
                                  double gnorm_scale) {
  checks::check_lion_8bit_blockwise_step(param, grad, exp_avg_codes, exp_avg_absmax, signed_map,
                                         lr, beta1, beta2, weight_decay, gnorm_scale);
  const LionRule rule = make_lion_rule(lr, beta1, beta2, weight_decay, gnorm_scale);
  apply_blockwise("lion_8bit_blockwise_step_cuda", rule, param, grad,
                  {{{&exp_avg_codes, &exp_avg_absmax, &signed_map}}});
}

void momentum_8bit_blockwise_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                                      const at::Tensor& momentum_buffer_codes,
                                      const at::Tensor& momentum_buffer_absmax,
                                      const at::Tensor& signed_map, int64_t step, double lr,
                                      double momentum, double weight_decay, double gnorm_scale) {
  checks::check_momentum_8bit_blockwise_step(param, grad, momentum_buffer_codes,
                                             momentum_buffer_absmax, signed_map, step, lr,
                                             momentum, weight_decay, gnorm_scale);
  const MomentumRule rule = make_momentum_rule(step, lr, momentum, weight_decay, gnorm_scale);
  apply_blockwise("momentum_8bit_blockwise_step_cuda", rule, param, grad,
                  {{{&momentum_buffer_codes, &momentum_buffer_absmax, &signed_map}}});
}

void rmsprop_8bit_blockwise_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                                     const at::Tensor& square_avg_codes,
                                     const at::Tensor& square_avg_absmax,
                                     const at::Tensor& unsigned_map, double lr, double alpha,
                                     double eps, double weight_decay, double gnorm_scale) {
  checks::check_rmsprop_8bit_blockwise_step(param, grad, square_avg_codes, square_avg_absmax,
                                            unsigned_map, lr, alpha, eps, weight_decay,
                                            gnorm_scale);
  const RmspropRule rule = make_rmsprop_rule(lr, alpha, eps, weight_decay, gnorm_scale);
  apply_blockwise("rmsprop_8bit_blockwise_step_cuda", rule, param, grad,
                  {{{&square_avg_codes, &square_avg_absmax, &unsigned_map}}});
}

void adagrad_8bit_blockwise_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                                     const at::Tensor& state_sum_codes,
                                     const at::Tensor& state_sum_absmax,
                                     const at::Tensor& unsigned_map, double lr, double eps,
                                     double weight_decay, double gnorm_scale) {
  checks::check_adagrad_8bit_blockwise_step(param, grad, state_sum_codes, state_sum_absmax,
                                            unsigned_map, lr, eps, weight_decay, gnorm_scale);
  const AdagradRule rule = make_adagrad_rule(lr, eps, weight_decay, gnorm_scale);
  apply_blockwise("adagrad_8bit_blockwise_step_cuda", rule, param, grad,
                  {{{&state_sum_codes, &state_sum_absmax, &unsigned_map}}});
}

}  // namespace

TORCH_LIBRARY_IMPL(optdrift, CUDA, m) {
  m.impl("adam_8bit_blockwise_step", &adam_8bit_blockwise_step_cuda);
  m.impl("ademamix_8bit_blockwise_step", &ademamix_8bit_blockwise_step_cuda);
  m.impl("lion_8bit_blockwise_step", &lion_8bit_blockwise_step_cuda);
  m.impl("momentum_8bit_blockwise_step", &momentum_8bit_blockwise_step_cuda);
  m.impl("rmsprop_8bit_blockwise_step", &rmsprop_8bit_blockwise_step_cuda);
  m.impl("adagrad_8bit_blockwise_step", &adagrad_8bit_blockwise_step_cuda);
}

}  // namespace optdrift::cuda
