// CUDA implementations of the 1-state optimizers: Lion, Momentum, RMSprop, Adagrad.
#include <torch/library.h>

#include "../checks.h"
#include "../optimizer_math.h"
#include "apply_cuda.cuh"

namespace optdrift::cuda {
namespace {

void lion_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   double lr, double beta1, double beta2, double weight_decay,
                   double gnorm_scale) {
  checks::check_lion_step(param, grad, exp_avg, lr, beta1, beta2, weight_decay, gnorm_scale);
  apply_rule("lion_step_cuda", make_lion_rule(lr, beta1, beta2, weight_decay, gnorm_scale), param,
             grad, {&exp_avg});
}

void momentum_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                       const at::Tensor& momentum_buffer, int64_t step, double lr,
                       double momentum, double weight_decay, double gnorm_scale) {
  checks::check_momentum_step(param, grad, momentum_buffer, step, lr, momentum, weight_decay,
                              gnorm_scale);
  apply_rule("momentum_step_cuda",
             make_momentum_rule(step, lr, momentum, weight_decay, gnorm_scale), param, grad,
             {&momentum_buffer});
}

void rmsprop_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                      const at::Tensor& square_avg, double lr, double alpha, double eps,
                      double weight_decay, double gnorm_scale) {
  checks::check_rmsprop_step(param, grad, square_avg, lr, alpha, eps, weight_decay, gnorm_scale);
  apply_rule("rmsprop_step_cuda", make_rmsprop_rule(lr, alpha, eps, weight_decay, gnorm_scale),
             param, grad, {&square_avg});
}

void adagrad_step_cuda(const at::Tensor& param, const at::Tensor& grad,
                      const at::Tensor& state_sum, double lr, double eps, double weight_decay,
                      double gnorm_scale) {
  checks::check_adagrad_step(param, grad, state_sum, lr, eps, weight_decay, gnorm_scale);
  apply_rule("adagrad_step_cuda", make_adagrad_rule(lr, eps, weight_decay, gnorm_scale), param,
             grad, {&state_sum});
}

}  // namespace

TORCH_LIBRARY_IMPL(optdrift, CUDA, m) {
  m.impl("lion_step", &lion_step_cuda);
  m.impl("momentum_step", &momentum_step_cuda);
  m.impl("rmsprop_step", &rmsprop_step_cuda);
  m.impl("adagrad_step", &adagrad_step_cuda);
}

}  // namespace optdrift::cuda
