// The one translation unit that defines the argument checks (see checks.h for why).
#include "checks.h"

#include "blockwise8_checks.h"
#include "blockwise8_checks_impl.h"
#include "checks_impl.h"

namespace optdrift::checks {

void check_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, double gnorm_scale) {
  detail::check_adam_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, gnorm_scale);
}

void check_ademamix_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_fast, const at::Tensor& exp_avg_slow, const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double beta3, double alpha, double eps, double weight_decay, double gnorm_scale) {
  detail::check_ademamix_step(param, grad, exp_avg_fast, exp_avg_slow, exp_avg_sq, step, lr, beta1, beta2, beta3, alpha, eps, weight_decay, gnorm_scale);
}

void check_lion_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, double lr, double beta1, double beta2, double weight_decay, double gnorm_scale) {
  detail::check_lion_step(param, grad, exp_avg, lr, beta1, beta2, weight_decay, gnorm_scale);
}

void check_momentum_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& momentum_buffer, int64_t step, double lr, double momentum, double weight_decay, double gnorm_scale) {
  detail::check_momentum_step(param, grad, momentum_buffer, step, lr, momentum, weight_decay, gnorm_scale);
}

void check_rmsprop_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg, double lr, double alpha, double eps, double weight_decay, double gnorm_scale) {
  detail::check_rmsprop_step(param, grad, square_avg, lr, alpha, eps, weight_decay, gnorm_scale);
}

void check_adagrad_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum, double lr, double eps, double weight_decay, double gnorm_scale) {
  detail::check_adagrad_step(param, grad, state_sum, lr, eps, weight_decay, gnorm_scale);
}

void check_adam_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_codes, const at::Tensor& exp_avg_absmax, const at::Tensor& exp_avg_sq_codes, const at::Tensor& exp_avg_sq_absmax, const at::Tensor& signed_map, const at::Tensor& unsigned_map, int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, double gnorm_scale) {
  detail::check_adam_8bit_blockwise_step(param, grad, exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes, exp_avg_sq_absmax, signed_map, unsigned_map, step, lr, beta1, beta2, eps, weight_decay, gnorm_scale);
}

void check_ademamix_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_fast_codes, const at::Tensor& exp_avg_fast_absmax, const at::Tensor& exp_avg_slow_codes, const at::Tensor& exp_avg_slow_absmax, const at::Tensor& exp_avg_sq_codes, const at::Tensor& exp_avg_sq_absmax, const at::Tensor& signed_map, const at::Tensor& unsigned_map, int64_t step, double lr, double beta1, double beta2, double beta3, double alpha, double eps, double weight_decay, double gnorm_scale) {
  detail::check_ademamix_8bit_blockwise_step(param, grad, exp_avg_fast_codes, exp_avg_fast_absmax, exp_avg_slow_codes, exp_avg_slow_absmax, exp_avg_sq_codes, exp_avg_sq_absmax, signed_map, unsigned_map, step, lr, beta1, beta2, beta3, alpha, eps, weight_decay, gnorm_scale);
}

void check_lion_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_codes, const at::Tensor& exp_avg_absmax, const at::Tensor& signed_map, double lr, double beta1, double beta2, double weight_decay, double gnorm_scale) {
  detail::check_lion_8bit_blockwise_step(param, grad, exp_avg_codes, exp_avg_absmax, signed_map, lr, beta1, beta2, weight_decay, gnorm_scale);
}

void check_momentum_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& momentum_buffer_codes, const at::Tensor& momentum_buffer_absmax, const at::Tensor& signed_map, int64_t step, double lr, double momentum, double weight_decay, double gnorm_scale) {
  detail::check_momentum_8bit_blockwise_step(param, grad, momentum_buffer_codes, momentum_buffer_absmax, signed_map, step, lr, momentum, weight_decay, gnorm_scale);
}

void check_rmsprop_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg_codes, const at::Tensor& square_avg_absmax, const at::Tensor& unsigned_map, double lr, double alpha, double eps, double weight_decay, double gnorm_scale) {
  detail::check_rmsprop_8bit_blockwise_step(param, grad, square_avg_codes, square_avg_absmax, unsigned_map, lr, alpha, eps, weight_decay, gnorm_scale);
}

void check_adagrad_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum_codes, const at::Tensor& state_sum_absmax, const at::Tensor& unsigned_map, double lr, double eps, double weight_decay, double gnorm_scale) {
  detail::check_adagrad_8bit_blockwise_step(param, grad, state_sum_codes, state_sum_absmax, unsigned_map, lr, eps, weight_decay, gnorm_scale);
}

}  // namespace optdrift::checks
