// CPU ops of the 1-state optimizers, Lion, Momentum, RMSprop and Adagrad: the checks, then the
// kernels of one_state_kernels.cpp.
#include <torch/library.h>

#include "../checks.h"
#include "kernels_cpu.h"
#include "tensor_args_cpu.h"

namespace optdrift::cpu {
namespace {

void lion_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   double lr, double beta1, double beta2, double weight_decay,
                   double gnorm_scale) {
  checks::check_lion_step(param, grad, exp_avg, lr, beta1, beta2, weight_decay, gnorm_scale);
  kernels::lion_step(elementwise_args("lion_step_cpu", param, grad, {&exp_avg}), lr, beta1, beta2,
                     weight_decay, gnorm_scale);
}

void momentum_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                       const at::Tensor& momentum_buffer, int64_t step, double lr,
                       double momentum, double weight_decay, double gnorm_scale) {
  checks::check_momentum_step(param, grad, momentum_buffer, step, lr, momentum, weight_decay,
                              gnorm_scale);
  kernels::momentum_step(elementwise_args("momentum_step_cpu", param, grad, {&momentum_buffer}),
                         step, lr, momentum, weight_decay, gnorm_scale);
}

void rmsprop_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                      const at::Tensor& square_avg, double lr, double alpha, double eps,
                      double weight_decay, double gnorm_scale) {
  checks::check_rmsprop_step(param, grad, square_avg, lr, alpha, eps, weight_decay, gnorm_scale);
  kernels::rmsprop_step(elementwise_args("rmsprop_step_cpu", param, grad, {&square_avg}), lr,
                        alpha, eps, weight_decay, gnorm_scale);
}

void adagrad_step_cpu(const at::Tensor& param, const at::Tensor& grad,
                      const at::Tensor& state_sum, double lr, double eps, double weight_decay,
                      double gnorm_scale) {
  checks::check_adagrad_step(param, grad, state_sum, lr, eps, weight_decay, gnorm_scale);
  kernels::adagrad_step(elementwise_args("adagrad_step_cpu", param, grad, {&state_sum}), lr, eps,
                        weight_decay, gnorm_scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(optdrift, CPU, m) {
  m.impl("lion_step", &lion_step_cpu);
  m.impl("momentum_step", &momentum_step_cpu);
  m.impl("rmsprop_step", &rmsprop_step_cpu);
  m.impl("adagrad_step", &adagrad_step_cpu);
}

}  // namespace optdrift::cpu
