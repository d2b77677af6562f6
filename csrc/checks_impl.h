// Argument checks shared by the CPU and CUDA implementations. Every failure is a TORCH_CHECK
// (a RuntimeError in Python) that names the op, the offending argument, what it was, and what to
// pass instead: a bad call must never turn into a silent wrong result or a crash in a kernel.
#pragma once
// Definitions behind checks.h. Included ONLY by checks.cpp (a host C++ translation unit): see
// checks.h for why no .cu file may include this.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <initializer_list>
#include <utility>

namespace optdrift::checks::detail {

// A state tensor together with its schema name, for messages.
using NamedTensor = std::pair<const char*, const at::Tensor*>;

inline bool is_supported_param_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.is_contiguous(), op, ": argument '", name,
              "' must be contiguous (got strides ", tensor.strides(),
              "); pass tensor.contiguous() and copy the result back");
}

// param, grad and every state: same device, same numel, contiguous; param fp32/fp16/bf16, grad in
// the param's dtype, states fp32.
inline void check_tensors(const char* op, const at::Tensor& param, const at::Tensor& grad,
                          std::initializer_list<NamedTensor> states) {
  TORCH_CHECK(is_supported_param_dtype(param.scalar_type()), op,
              ": argument 'param' has dtype ", param.scalar_type(),
              "; supported parameter dtypes are float32, float16 and bfloat16");
  TORCH_CHECK(grad.scalar_type() == param.scalar_type(), op, ": argument 'grad' has dtype ",
              grad.scalar_type(), " but 'param' is ", param.scalar_type(),
              "; pass the gradient in the parameter's dtype");
  TORCH_CHECK(grad.device() == param.device(), op, ": argument 'grad' is on ", grad.device(),
              " but 'param' is on ", param.device(), "; put all tensors on one device");
  TORCH_CHECK(grad.numel() == param.numel(), op, ": argument 'grad' has ", grad.numel(),
              " elements but 'param' has ", param.numel());
  check_contiguous(op, "param", param);
  check_contiguous(op, "grad", grad);
  for (const auto& [name, state] : states) {
    TORCH_CHECK(state->scalar_type() == at::kFloat, op, ": state argument '", name,
                "' has dtype ", state->scalar_type(),
                "; optimizer states are float32 whatever the parameter dtype");
    TORCH_CHECK(state->device() == param.device(), op, ": state argument '", name, "' is on ",
                state->device(), " but 'param' is on ", param.device(),
                "; put all tensors on one device");
    TORCH_CHECK(state->numel() == param.numel(), op, ": state argument '", name, "' has ",
                state->numel(), " elements but 'param' has ", param.numel());
    check_contiguous(op, name, *state);
  }
}

inline void check_step(const char* op, int64_t step) {
  TORCH_CHECK(step >= 1, op, ": argument 'step' is ", step,
              "; steps are 1-based, pass step=1 on the first update of a fresh state");
}

// NaN fails every comparison below, so a NaN hyperparameter is rejected too.
inline void check_non_negative(const char* op, const char* name, double value) {
  TORCH_CHECK(value >= 0.0 && std::isfinite(value), op, ": argument '", name, "' is ", value,
              "; it must be a finite number >= 0");
}

inline void check_positive(const char* op, const char* name, double value) {
  TORCH_CHECK(value > 0.0 && std::isfinite(value), op, ": argument '", name, "' is ", value,
              "; it must be a finite number > 0");
}

// Averaging coefficients (betas, RMSprop's alpha, momentum) live in [0, 1).
inline void check_coefficient(const char* op, const char* name, double value) {
  TORCH_CHECK(value >= 0.0 && value < 1.0, op, ": argument '", name, "' is ", value,
              "; it must be in [0, 1)");
}

// ---- one function per optimizer: the hyperparameters, shared by its 32-bit and 8-bit ops ----

inline void check_adam_hyperparameters(const char* op, int64_t step, double lr, double beta1,
                                       double beta2, double eps, double weight_decay,
                                       double gnorm_scale) {
  check_step(op, step);
  check_non_negative(op, "lr", lr);
  check_coefficient(op, "beta1", beta1);
  check_coefficient(op, "beta2", beta2);
  check_positive(op, "eps", eps);
  check_non_negative(op, "weight_decay", weight_decay);
  check_non_negative(op, "gnorm_scale", gnorm_scale);
}

inline void check_ademamix_hyperparameters(const char* op, int64_t step, double lr, double beta1,
                                           double beta2, double beta3, double alpha, double eps,
                                           double weight_decay, double gnorm_scale) {
  check_step(op, step);
  check_non_negative(op, "lr", lr);
  check_coefficient(op, "beta1", beta1);
  check_coefficient(op, "beta2", beta2);
  check_coefficient(op, "beta3", beta3);
  // AdEMAMix's alpha weighs the slow EMA and is typically 5 to 10 (arXiv:2409.03137), so it is
  // only required to be >= 0, unlike RMSprop's alpha.
  check_non_negative(op, "alpha", alpha);
  check_positive(op, "eps", eps);
  check_non_negative(op, "weight_decay", weight_decay);
  check_non_negative(op, "gnorm_scale", gnorm_scale);
}

inline void check_lion_hyperparameters(const char* op, double lr, double beta1, double beta2,
                                       double weight_decay, double gnorm_scale) {
  check_non_negative(op, "lr", lr);
  check_coefficient(op, "beta1", beta1);
  check_coefficient(op, "beta2", beta2);
  check_non_negative(op, "weight_decay", weight_decay);
  check_non_negative(op, "gnorm_scale", gnorm_scale);
}

inline void check_momentum_hyperparameters(const char* op, int64_t step, double lr,
                                           double momentum, double weight_decay,
                                           double gnorm_scale) {
  check_step(op, step);
  check_non_negative(op, "lr", lr);
  check_coefficient(op, "momentum", momentum);
  check_non_negative(op, "weight_decay", weight_decay);
  check_non_negative(op, "gnorm_scale", gnorm_scale);
}

inline void check_rmsprop_hyperparameters(const char* op, double lr, double alpha, double eps,
                                          double weight_decay, double gnorm_scale) {
  check_non_negative(op, "lr", lr);
  check_coefficient(op, "alpha", alpha);
  check_positive(op, "eps", eps);
  check_non_negative(op, "weight_decay", weight_decay);
  check_non_negative(op, "gnorm_scale", gnorm_scale);
}

inline void check_adagrad_hyperparameters(const char* op, double lr, double eps,
                                          double weight_decay, double gnorm_scale) {
  check_non_negative(op, "lr", lr);
  check_positive(op, "eps", eps);
  check_non_negative(op, "weight_decay", weight_decay);
  check_non_negative(op, "gnorm_scale", gnorm_scale);
}

// ---- one function per op: everything the schema's arguments must satisfy ----

inline void check_adam_step(const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t step,
                            double lr, double beta1, double beta2, double eps,
                            double weight_decay, double gnorm_scale) {
  const char* op = "optdrift::adam_step";
  check_tensors(op, param, grad, {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
  check_adam_hyperparameters(op, step, lr, beta1, beta2, eps, weight_decay, gnorm_scale);
}

inline void check_ademamix_step(const at::Tensor& param, const at::Tensor& grad,
                                const at::Tensor& exp_avg_fast, const at::Tensor& exp_avg_slow,
                                const at::Tensor& exp_avg_sq, int64_t step, double lr,
                                double beta1, double beta2, double beta3, double alpha,
                                double eps, double weight_decay, double gnorm_scale) {
  const char* op = "optdrift::ademamix_step";
  check_tensors(op, param, grad,
                {{"exp_avg_fast", &exp_avg_fast},
                 {"exp_avg_slow", &exp_avg_slow},
                 {"exp_avg_sq", &exp_avg_sq}});
  check_ademamix_hyperparameters(op, step, lr, beta1, beta2, beta3, alpha, eps, weight_decay,
                                 gnorm_scale);
}

inline void check_lion_step(const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& exp_avg, double lr, double beta1, double beta2,
                            double weight_decay, double gnorm_scale) {
  const char* op = "optdrift::lion_step";
  check_tensors(op, param, grad, {{"exp_avg", &exp_avg}});
  check_lion_hyperparameters(op, lr, beta1, beta2, weight_decay, gnorm_scale);
}

inline void check_momentum_step(const at::Tensor& param, const at::Tensor& grad,
                                const at::Tensor& momentum_buffer, int64_t step, double lr,
                                double momentum, double weight_decay, double gnorm_scale) {
  const char* op = "optdrift::momentum_step";
  check_tensors(op, param, grad, {{"momentum_buffer", &momentum_buffer}});
  check_momentum_hyperparameters(op, step, lr, momentum, weight_decay, gnorm_scale);
}

inline void check_rmsprop_step(const at::Tensor& param, const at::Tensor& grad,
                               const at::Tensor& square_avg, double lr, double alpha, double eps,
                               double weight_decay, double gnorm_scale) {
  const char* op = "optdrift::rmsprop_step";
  check_tensors(op, param, grad, {{"square_avg", &square_avg}});
  check_rmsprop_hyperparameters(op, lr, alpha, eps, weight_decay, gnorm_scale);
}

inline void check_adagrad_step(const at::Tensor& param, const at::Tensor& grad,
                               const at::Tensor& state_sum, double lr, double eps,
                               double weight_decay, double gnorm_scale) {
  const char* op = "optdrift::adagrad_step";
  check_tensors(op, param, grad, {{"state_sum", &state_sum}});
  check_adagrad_hyperparameters(op, lr, eps, weight_decay, gnorm_scale);
}

}  // namespace optdrift::checks::detail
