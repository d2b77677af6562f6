// Operator schemas of the bundled optimizer kernels: the one place they are declared.
//
// Every op updates its parameter and optimizer states in place (declared with Tensor(x!) so
// functionalization, fake tensors and opcheck see the mutation) and returns nothing. The CPU
// implementations live in cpu/*.cpp and the CUDA ones in cuda/*.cu, each registered with its own
// TORCH_LIBRARY_IMPL; both call the same per-element math in optimizer_math.h.
//
// Conventions (shared with bitsandbytes so one battery drives both):
//   * `step` is 1-based: the first call on a fresh state passes step=1.
//   * `gnorm_scale` multiplies the gradient before anything else uses it.
//   * Adam, AdEMAMix and Lion apply decoupled weight decay to the parameter *before* the update:
//       p <- p * (1 - lr*wd) + update(p_old-independent terms)
//   * Momentum, RMSprop and Adagrad use coupled L2 decay: g <- g + wd * p.
//   * parameters fp32 / fp16 / bf16, states fp32, arithmetic in float32.
#include <torch/library.h>

TORCH_LIBRARY(optdrift, m) {
  m.def(
      "adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "int step, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "float gnorm_scale=1.0, bool skip_zeros=False) -> ()");
  m.def(
      "ademamix_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg_fast, "
      "Tensor(c!) exp_avg_slow, Tensor(d!) exp_avg_sq, int step, float lr, float beta1, "
      "float beta2, float beta3, float alpha, float eps, float weight_decay, "
      "float gnorm_scale=1.0) -> ()");
  m.def(
      "lion_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, float lr, float beta1, "
      "float beta2, float weight_decay, float gnorm_scale=1.0) -> ()");
  m.def(
      "momentum_step(Tensor(a!) param, Tensor grad, Tensor(b!) momentum_buffer, int step, "
      "float lr, float momentum, float weight_decay, float gnorm_scale=1.0) -> ()");
  m.def(
      "rmsprop_step(Tensor(a!) param, Tensor grad, Tensor(b!) square_avg, float lr, "
      "float alpha, float eps, float weight_decay, float gnorm_scale=1.0) -> ()");
  m.def(
      "adagrad_step(Tensor(a!) param, Tensor grad, Tensor(b!) state_sum, float lr, float eps, "
      "float weight_decay, float gnorm_scale=1.0) -> ()");
}
