// CPU implementations of the 8-bit blockwise optimizers. The step on one block (dequantize, the
// float32 rule of optimizer_math.h, new absmax, requantize to the nearest code) is described in
// quant_map.h; blocks are independent, so at::parallel_for splits them freely and the result does
// not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "../blockwise8_checks.h"
#include "../optimizer_math.h"
#include "../quant_map.h"

namespace optdrift::cpu {
namespace {

using blockwise8::kBlockSize;
using blockwise8::kMapSize;

// Each parallel task takes at least this many blocks (16 * 256 = 4096 elements).
constexpr int64_t kBlocksPerTask = 16;

struct StateTensors {
  const at::Tensor* codes;
  const at::Tensor* absmax;
  const at::Tensor* map;
};

template <typename Rule, typename param_t>
void apply_blockwise_typed(const Rule& rule, const at::Tensor& param, const at::Tensor& grad,
                           const std::array<StateTensors, Rule::kStates>& tensors) {
  constexpr int kStates = Rule::kStates;
  const int64_t numel = param.numel();
  const int64_t blocks = (numel + kBlockSize - 1) / kBlockSize;
  param_t* param_data = param.data_ptr<param_t>();
  const param_t* grad_data = grad.data_ptr<param_t>();
  blockwise8::QuantizedStates<kStates> states;
  for (int k = 0; k < kStates; ++k) {
    states.codes[k] = tensors[k].codes->template data_ptr<uint8_t>();
    states.absmax[k] = tensors[k].absmax->template data_ptr<float>();
    states.map[k] = tensors[k].map->template data_ptr<float>();
  }

  at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t first_block, int64_t end_block) {
    float values[kStates][kBlockSize];
    for (int64_t block = first_block; block < end_block; ++block) {
      const int64_t begin = block * kBlockSize;
      const int count = static_cast<int>(std::min<int64_t>(kBlockSize, numel - begin));
      float old_absmax[kStates];
      float new_absmax[kStates];
      for (int k = 0; k < kStates; ++k) {
        old_absmax[k] = states.absmax[k][block];
        new_absmax[k] = 0.0f;
      }
      for (int j = 0; j < count; ++j) {
        const int64_t i = begin + j;
        float state[kStates];
        for (int k = 0; k < kStates; ++k)
          state[k] = states.map[k][states.codes[k][i]] * old_absmax[k];
        float value = static_cast<float>(param_data[i]);
        if (blockwise8::update_element(rule, value, static_cast<float>(grad_data[i]), state))
          param_data[i] = static_cast<param_t>(value);
        for (int k = 0; k < kStates; ++k) {
          values[k][j] = state[k];
          // fmaxf drops a NaN operand, on the host as on the device.
          new_absmax[k] = std::fmax(new_absmax[k], std::fabs(state[k]));
        }
      }
      for (int k = 0; k < kStates; ++k) {
        states.absmax[k][block] = new_absmax[k];
        for (int j = 0; j < count; ++j)
          states.codes[k][begin + j] = blockwise8::quantize_nearest(
              states.map[k], blockwise8::normalise(values[k][j], new_absmax[k]));
      }
    }
  });
}

template <typename Rule>
void apply_blockwise(const char* /*op*/, const Rule& rule, const at::Tensor& param,
                     const at::Tensor& grad,
                     const std::array<StateTensors, Rule::kStates>& tensors) {
  if (param.numel() == 0) return;
  // The dispatch name must be a literal (torch makes it constexpr); `op` names the caller.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(),
                                  "blockwise8_step", [&] {
    apply_blockwise_typed<Rule, scalar_t>(rule, param, grad, tensors);
  });
}

void adam_8bit_blockwise_step_cpu(const at::Tensor& param, const at::Tensor& grad,
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
  apply_blockwise("adam_8bit_blockwise_step_cpu", rule, param, grad,
                  {{{&exp_avg_codes, &exp_avg_absmax, &signed_map},
                    {&exp_avg_sq_codes, &exp_avg_sq_absmax, &unsigned_map}}});
}

void ademamix_8bit_blockwise_step_cpu(
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
  apply_blockwise("ademamix_8bit_blockwise_step_cpu", rule, param, grad,
                  {{{&exp_avg_fast_codes, &exp_avg_fast_absmax, &signed_map},
                    {&exp_avg_slow_codes, &exp_avg_slow_absmax, &signed_map},
                    {&exp_avg_sq_codes, &exp_avg_sq_absmax, &unsigned_map}}});
}

void lion_8bit_blockwise_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                                  const at::Tensor& exp_avg_codes,
                                  const at::Tensor& exp_avg_absmax, const at::Tensor& signed_map,
                                  double lr, double beta1, double beta2, double weight_decay,
                                  double gnorm_scale) {
  checks::check_lion_8bit_blockwise_step(param, grad, exp_avg_codes, exp_avg_absmax, signed_map,
                                         lr, beta1, beta2, weight_decay, gnorm_scale);
  const LionRule rule = make_lion_rule(lr, beta1, beta2, weight_decay, gnorm_scale);
  apply_blockwise("lion_8bit_blockwise_step_cpu", rule, param, grad,
                  {{{&exp_avg_codes, &exp_avg_absmax, &signed_map}}});
}

void momentum_8bit_blockwise_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                                      const at::Tensor& momentum_buffer_codes,
                                      const at::Tensor& momentum_buffer_absmax,
                                      const at::Tensor& signed_map, int64_t step, double lr,
                                      double momentum, double weight_decay, double gnorm_scale) {
  checks::check_momentum_8bit_blockwise_step(param, grad, momentum_buffer_codes,
                                             momentum_buffer_absmax, signed_map, step, lr,
                                             momentum, weight_decay, gnorm_scale);
  const MomentumRule rule = make_momentum_rule(step, lr, momentum, weight_decay, gnorm_scale);
  apply_blockwise("momentum_8bit_blockwise_step_cpu", rule, param, grad,
                  {{{&momentum_buffer_codes, &momentum_buffer_absmax, &signed_map}}});
}

void rmsprop_8bit_blockwise_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                                     const at::Tensor& square_avg_codes,
                                     const at::Tensor& square_avg_absmax,
                                     const at::Tensor& unsigned_map, double lr, double alpha,
                                     double eps, double weight_decay, double gnorm_scale) {
  checks::check_rmsprop_8bit_blockwise_step(param, grad, square_avg_codes, square_avg_absmax,
                                            unsigned_map, lr, alpha, eps, weight_decay,
                                            gnorm_scale);
  const RmspropRule rule = make_rmsprop_rule(lr, alpha, eps, weight_decay, gnorm_scale);
  apply_blockwise("rmsprop_8bit_blockwise_step_cpu", rule, param, grad,
                  {{{&square_avg_codes, &square_avg_absmax, &unsigned_map}}});
}

void adagrad_8bit_blockwise_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                                     const at::Tensor& state_sum_codes,
                                     const at::Tensor& state_sum_absmax,
                                     const at::Tensor& unsigned_map, double lr, double eps,
                                     double weight_decay, double gnorm_scale) {
  checks::check_adagrad_8bit_blockwise_step(param, grad, state_sum_codes, state_sum_absmax,
                                            unsigned_map, lr, eps, weight_decay, gnorm_scale);
  const AdagradRule rule = make_adagrad_rule(lr, eps, weight_decay, gnorm_scale);
  apply_blockwise("adagrad_8bit_blockwise_step_cpu", rule, param, grad,
                  {{{&state_sum_codes, &state_sum_absmax, &unsigned_map}}});
}

}  // namespace

TORCH_LIBRARY_IMPL(optdrift, CPU, m) {
  m.impl("adam_8bit_blockwise_step", &adam_8bit_blockwise_step_cpu);
  m.impl("ademamix_8bit_blockwise_step", &ademamix_8bit_blockwise_step_cpu);
  m.impl("lion_8bit_blockwise_step", &lion_8bit_blockwise_step_cpu);
  m.impl("momentum_8bit_blockwise_step", &momentum_8bit_blockwise_step_cpu);
  m.impl("rmsprop_8bit_blockwise_step", &rmsprop_8bit_blockwise_step_cpu);
  m.impl("adagrad_8bit_blockwise_step", &adagrad_8bit_blockwise_step_cpu);
}

}  // namespace optdrift::cpu
