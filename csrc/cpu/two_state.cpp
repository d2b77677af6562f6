// CPU ops of the 2-state (and 3-state) optimizers, Adam and AdEMAMix: the checks, then the
// kernels of two_state_kernels.cpp.
#include <torch/library.h>

#include "../checks.h"
#include "kernels_cpu.h"
#include "tensor_args_cpu.h"

namespace optdrift::cpu {
namespace {

void adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1,
                   double beta2, double eps, double weight_decay, double gnorm_scale,
                   bool skip_zeros) {
  checks::check_adam_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
                          weight_decay, gnorm_scale);
  kernels::adam_step(elementwise_args("adam_step_cpu", param, grad, {&exp_avg, &exp_avg_sq}), step,
                     lr, beta1, beta2, eps, weight_decay, gnorm_scale, skip_zeros);
}

void ademamix_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                       const at::Tensor& exp_avg_fast, const at::Tensor& exp_avg_slow,
                       const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1,
                       double beta2, double beta3, double alpha, double eps, double weight_decay,
                       double gnorm_scale) {
  checks::check_ademamix_step(param, grad, exp_avg_fast, exp_avg_slow, exp_avg_sq, step, lr,
                              beta1, beta2, beta3, alpha, eps, weight_decay, gnorm_scale);
  kernels::ademamix_step(
      elementwise_args("ademamix_step_cpu", param, grad,
                       {&exp_avg_fast, &exp_avg_slow, &exp_avg_sq}),
      step, lr, beta1, beta2, beta3, alpha, eps, weight_decay, gnorm_scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(optdrift, CPU, m) {
  m.impl("adam_step", &adam_step_cpu);
  m.impl("ademamix_step", &ademamix_step_cpu);
}

}  // namespace optdrift::cpu
