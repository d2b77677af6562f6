// Argument checks of the 32-bit ops: each throws (TORCH_CHECK) with a message naming the op and the
// bad argument, before any kernel runs.
//
// Declared here, defined in checks.cpp, so they are always compiled by the host C++ compiler. Code
// compiled by nvcc must not format integers into a c10::str / std::ostream: nvcc's host pass
// instantiates std::num_put locally, with a facet id that is not libstdc++'s, and the first
// TORCH_CHECK that prints a number (a size, a step) segfaults instead of throwing. Seen on the
// H200 (CUDA 13.0, torch 2.11): a size-mismatch check crashed inside _M_insert<long>.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace optdrift::checks {
void check_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, double gnorm_scale);
void check_ademamix_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_fast, const at::Tensor& exp_avg_slow, const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double beta3, double alpha, double eps, double weight_decay, double gnorm_scale);
void check_lion_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, double lr, double beta1, double beta2, double weight_decay, double gnorm_scale);
void check_momentum_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& momentum_buffer, int64_t step, double lr, double momentum, double weight_decay, double gnorm_scale);
void check_rmsprop_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& square_avg, double lr, double alpha, double eps, double weight_decay, double gnorm_scale);
void check_adagrad_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state_sum, double lr, double eps, double weight_decay, double gnorm_scale);

}  // namespace optdrift::checks
