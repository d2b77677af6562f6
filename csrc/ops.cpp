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

// ---- 8-bit blockwise ops (issue 6; cpu/blockwise8.cpp, cuda/blockwise8.cu) ----
//
// The same optimizers with each state stored as uint8 codes into a 256-value quantization map plus
// one float32 absmax per block of 256 elements (value = map[code] * absmax[block]); see
// quant_map.h for the step (dequantize, float32 update with optimizer_math.h, new absmax, param
// from the float32 states, requantize to the nearest code) and the non-finite gradient rule.
// First moments (exp_avg, exp_avg_fast, exp_avg_slow, momentum_buffer) use the signed map, second
// moments and sums (exp_avg_sq, square_avg, state_sum) the unsigned one. The maps are arguments
// (worker/quant_map.py builds them): 256 strictly increasing float32 values containing 0.
TORCH_LIBRARY_FRAGMENT(optdrift, m) {
  m.def(
      "adam_8bit_blockwise_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg_codes, "
      "Tensor(c!) exp_avg_absmax, Tensor(d!) exp_avg_sq_codes, Tensor(e!) exp_avg_sq_absmax, "
      "Tensor signed_map, Tensor unsigned_map, int step, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, float gnorm_scale=1.0, bool skip_zeros=False) -> ()");
  m.def(
      "ademamix_8bit_blockwise_step(Tensor(a!) param, Tensor grad, "
      "Tensor(b!) exp_avg_fast_codes, Tensor(c!) exp_avg_fast_absmax, "
      "Tensor(d!) exp_avg_slow_codes, Tensor(e!) exp_avg_slow_absmax, "
      "Tensor(f!) exp_avg_sq_codes, Tensor(g!) exp_avg_sq_absmax, Tensor signed_map, "
      "Tensor unsigned_map, int step, float lr, float beta1, float beta2, float beta3, "
      "float alpha, float eps, float weight_decay, float gnorm_scale=1.0) -> ()");
  m.def(
      "lion_8bit_blockwise_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg_codes, "
      "Tensor(c!) exp_avg_absmax, Tensor signed_map, float lr, float beta1, float beta2, "
      "float weight_decay, float gnorm_scale=1.0) -> ()");
  m.def(
      "momentum_8bit_blockwise_step(Tensor(a!) param, Tensor grad, "
      "Tensor(b!) momentum_buffer_codes, Tensor(c!) momentum_buffer_absmax, Tensor signed_map, "
      "int step, float lr, float momentum, float weight_decay, float gnorm_scale=1.0) -> ()");
  m.def(
      "rmsprop_8bit_blockwise_step(Tensor(a!) param, Tensor grad, Tensor(b!) square_avg_codes, "
      "Tensor(c!) square_avg_absmax, Tensor unsigned_map, float lr, float alpha, float eps, "
      "float weight_decay, float gnorm_scale=1.0) -> ()");
  m.def(
      "adagrad_8bit_blockwise_step(Tensor(a!) param, Tensor grad, Tensor(b!) state_sum_codes, "
      "Tensor(c!) state_sum_absmax, Tensor unsigned_map, float lr, float eps, "
      "float weight_decay, float gnorm_scale=1.0) -> ()");
}

// ---- multi-tensor ops (issue 45; multi_tensor.h, cpu/multi_tensor.cpp, cuda/multi_tensor.cu) ----
//
// ONE call steps every tensor of an optimizer, all its param groups, as ATen's fused Adam and
// apex's multi_tensor_apply do: the lists hold tensor i's param, grad and states (the one-tensor
// op's rules and conventions, the lists' tensors on one device, params of one dtype); the
// hyperparameter lists hold one value per param group, and group_of[i] is tensor i's group.
// The op keeps the optimizer's shared state in two CPU tensors (multi_tensor.h):
//   * steps: int64 [tensors], each tensor's own step counter, advanced by the op (+1, then used);
//   * beta_powers (Adam, AdEMAMix): float32 [groups, 3] per group = the step it was made for,
//     beta1^t and beta2^t as float32 running products (zeros when fresh), which the bias
//     corrections come from.
TORCH_LIBRARY_FRAGMENT(optdrift, m) {
  m.def(
      "adam_multi_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!) steps, Tensor(e!) beta_powers, int[] group_of, "
      "float[] lr, float[] beta1, float[] beta2, float[] eps, float[] weight_decay, "
      "float[] gnorm_scale, bool[] skip_zeros) -> ()");
  m.def(
      "ademamix_multi_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avg_fasts, "
      "Tensor(c!)[] exp_avg_slows, Tensor(d!)[] exp_avg_sqs, Tensor(e!) steps, "
      "Tensor(f!) beta_powers, int[] group_of, float[] lr, float[] beta1, float[] beta2, "
      "float[] beta3, float[] alpha, float[] eps, float[] weight_decay, float[] gnorm_scale) -> ()");
  m.def(
      "lion_multi_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!) steps, int[] group_of, float[] lr, float[] beta1, float[] beta2, "
      "float[] weight_decay, float[] gnorm_scale) -> ()");
  m.def(
      "momentum_multi_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(c!) steps, int[] group_of, float[] lr, float[] momentum, float[] weight_decay, "
      "float[] gnorm_scale) -> ()");
  m.def(
      "rmsprop_multi_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] square_avgs, "
      "Tensor(c!) steps, int[] group_of, float[] lr, float[] alpha, float[] eps, "
      "float[] weight_decay, float[] gnorm_scale) -> ()");
  m.def(
      "adagrad_multi_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_sums, "
      "Tensor(c!) steps, int[] group_of, float[] lr, float[] eps, float[] weight_decay, "
      "float[] gnorm_scale) -> ()");
}
