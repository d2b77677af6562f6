// CPU ops of the 8-bit blockwise optimizers: the checks, then the kernels of
// blockwise8_kernels.cpp (where the step on one block is).
#include <torch/library.h>

#include "../blockwise8_checks.h"
#include "kernels_cpu.h"
#include "tensor_args_cpu.h"

namespace optdrift::cpu {
namespace {

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
  kernels::adam_8bit_blockwise_step(
      blockwise_args("adam_8bit_blockwise_step_cpu", param, grad,
                     {{&exp_avg_codes, &exp_avg_absmax, &signed_map},
                      {&exp_avg_sq_codes, &exp_avg_sq_absmax, &unsigned_map}}),
      step, lr, beta1, beta2, eps, weight_decay, gnorm_scale, skip_zeros);
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
  kernels::ademamix_8bit_blockwise_step(
      blockwise_args("ademamix_8bit_blockwise_step_cpu", param, grad,
                     {{&exp_avg_fast_codes, &exp_avg_fast_absmax, &signed_map},
                      {&exp_avg_slow_codes, &exp_avg_slow_absmax, &signed_map},
                      {&exp_avg_sq_codes, &exp_avg_sq_absmax, &unsigned_map}}),
      step, lr, beta1, beta2, beta3, alpha, eps, weight_decay, gnorm_scale);
}

void lion_8bit_blockwise_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                                  const at::Tensor& exp_avg_codes,
                                  const at::Tensor& exp_avg_absmax, const at::Tensor& signed_map,
                                  double lr, double beta1, double beta2, double weight_decay,
                                  double gnorm_scale) {
  checks::check_lion_8bit_blockwise_step(param, grad, exp_avg_codes, exp_avg_absmax, signed_map,
                                         lr, beta1, beta2, weight_decay, gnorm_scale);
  kernels::lion_8bit_blockwise_step(
      blockwise_args("lion_8bit_blockwise_step_cpu", param, grad,
                     {{&exp_avg_codes, &exp_avg_absmax, &signed_map}}),
      lr, beta1, beta2, weight_decay, gnorm_scale);
}

void momentum_8bit_blockwise_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                                      const at::Tensor& momentum_buffer_codes,
                                      const at::Tensor& momentum_buffer_absmax,
                                      const at::Tensor& signed_map, int64_t step, double lr,
                                      double momentum, double weight_decay, double gnorm_scale) {
  checks::check_momentum_8bit_blockwise_step(param, grad, momentum_buffer_codes,
                                             momentum_buffer_absmax, signed_map, step, lr,
                                             momentum, weight_decay, gnorm_scale);
  kernels::momentum_8bit_blockwise_step(
      blockwise_args("momentum_8bit_blockwise_step_cpu", param, grad,
                     {{&momentum_buffer_codes, &momentum_buffer_absmax, &signed_map}}),
      step, lr, momentum, weight_decay, gnorm_scale);
}

void rmsprop_8bit_blockwise_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                                     const at::Tensor& square_avg_codes,
                                     const at::Tensor& square_avg_absmax,
                                     const at::Tensor& unsigned_map, double lr, double alpha,
                                     double eps, double weight_decay, double gnorm_scale) {
  checks::check_rmsprop_8bit_blockwise_step(param, grad, square_avg_codes, square_avg_absmax,
                                            unsigned_map, lr, alpha, eps, weight_decay,
                                            gnorm_scale);
  kernels::rmsprop_8bit_blockwise_step(
      blockwise_args("rmsprop_8bit_blockwise_step_cpu", param, grad,
                     {{&square_avg_codes, &square_avg_absmax, &unsigned_map}}),
      lr, alpha, eps, weight_decay, gnorm_scale);
}

void adagrad_8bit_blockwise_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                                     const at::Tensor& state_sum_codes,
                                     const at::Tensor& state_sum_absmax,
                                     const at::Tensor& unsigned_map, double lr, double eps,
                                     double weight_decay, double gnorm_scale) {
  checks::check_adagrad_8bit_blockwise_step(param, grad, state_sum_codes, state_sum_absmax,
                                            unsigned_map, lr, eps, weight_decay, gnorm_scale);
  kernels::adagrad_8bit_blockwise_step(
      blockwise_args("adagrad_8bit_blockwise_step_cpu", param, grad,
                     {{&state_sum_codes, &state_sum_absmax, &unsigned_map}}),
      lr, eps, weight_decay, gnorm_scale);
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
