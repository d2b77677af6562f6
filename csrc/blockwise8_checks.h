// Argument checks of the 8-bit blockwise ops, declared here and defined in checks.cpp (see
// checks.h for why they are kept out of code compiled by nvcc).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace optdrift::checks {
void check_adam_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_codes, const at::Tensor& exp_avg_absmax, const at::Tensor& exp_avg_sq_codes, const at::Tensor& exp_avg_sq_absmax, const at::Tensor& signed_map, const at::Tensor& unsigned_map, int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, double gnorm_scale);
void check_ademamix_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_fast_codes, const at::Tensor& exp_avg_fast_absmax, const at::Tensor& exp_avg_slow_codes, const at::Tensor& exp_avg_slow_absmax, const at::Tensor& exp_avg_sq_codes, const at::Tensor& exp_avg_sq_absmax, const at::Tensor& signed_map, const at::Tensor& unsigned_map, int64_t step, double lr, double beta1, double beta2, double beta3, double alpha, double eps, double weight_decay, double gnorm_scale);
void check_lion_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_codes, const at::Tensor& exp_avg_absmax, const at::Tensor& signed_map, double lr, double beta1, double beta2, double weight_decay, double gnorm_scale);
void check_momentum_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& momentum_buffer_codes, const at::Tensor& momentum_buffer_absmax, const at::Tensor& signed_map, int64_t step, double lr, double momentum, double weight_decay, double gnorm_scale);
void check_rmsprop_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg_codes, const at::Tensor& square_avg_absmax, const at::Tensor& unsigned_map, double lr, double alpha, double eps, double weight_decay, double gnorm_scale);
void check_adagrad_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum_codes, const at::Tensor& state_sum_absmax, const at::Tensor& unsigned_map, double lr, double eps, double weight_decay, double gnorm_scale);

}  // namespace optdrift::checks
