// Argument checks of the 8-bit blockwise ops (TORCH_CHECK naming the op and the argument), in
// addition to the parameter/gradient/hyperparameter checks of checks.h that the 32-bit ops share.
#pragma once
// Definitions behind blockwise8_checks.h, included only by checks.cpp (see checks.h).

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <mutex>
#include <tuple>

#include "checks_impl.h"
#include "blockwise8_layout.h"

namespace optdrift::checks::detail {

// (name of the codes argument, codes, name of the absmax argument, absmax)
using QuantizedState = std::tuple<const char*, const at::Tensor*, const char*, const at::Tensor*>;

inline int64_t blockwise8_num_blocks(int64_t numel) {
  return (numel + blockwise8::kBlockSize - 1) / blockwise8::kBlockSize;
}

inline void check_param_and_grad(const char* op, const at::Tensor& param, const at::Tensor& grad) {
  check_tensors(op, param, grad, {});
}

inline void check_quantized_states(const char* op, const at::Tensor& param,
                                   std::initializer_list<QuantizedState> states) {
  const int64_t blocks = blockwise8_num_blocks(param.numel());
  for (const auto& [codes_name, codes, absmax_name, absmax] : states) {
    TORCH_CHECK(codes->scalar_type() == at::kByte, op, ": state argument '", codes_name,
                "' has dtype ", codes->scalar_type(),
                "; 8-bit states are uint8 codes (torch.uint8), one per parameter element");
    TORCH_CHECK(codes->numel() == param.numel(), op, ": state argument '", codes_name, "' has ",
                codes->numel(), " elements but 'param' has ", param.numel(),
                "; pass one code per parameter element");
    TORCH_CHECK(codes->device() == param.device(), op, ": state argument '", codes_name,
                "' is on ", codes->device(), " but 'param' is on ", param.device(),
                "; put all tensors on one device");
    check_contiguous(op, codes_name, *codes);
    TORCH_CHECK(absmax->scalar_type() == at::kFloat, op, ": argument '", absmax_name,
                "' has dtype ", absmax->scalar_type(), "; block absmax values are float32");
    TORCH_CHECK(absmax->numel() == blocks, op, ": argument '", absmax_name, "' has ",
                absmax->numel(), " elements but 'param' has ", param.numel(),
                " elements, which is ", blocks, " blocks of ", blockwise8::kBlockSize,
                "; pass one absmax per block (ceil(numel / ", blockwise8::kBlockSize, "))");
    TORCH_CHECK(absmax->device() == param.device(), op, ": argument '", absmax_name, "' is on ",
                absmax->device(), " but 'param' is on ", param.device(),
                "; put all tensors on one device");
    check_contiguous(op, absmax_name, *absmax);
  }
}

// Maps whose values have been checked. Reading a CUDA map's values back is a synchronising copy,
// and the engine passes the same two map tensors to every call (10^4..10^5 a battery), so a map
// whose values passed is remembered with the version counter it had then: an in-place change
// (which bumps the counter, through any view) is checked again. The entry holds a reference to
// the TensorImpl, so it cannot be freed and its address reused by another tensor. Inference
// tensors have no version counter and are always checked.
struct CheckedMap {
  c10::intrusive_ptr<c10::TensorImpl> impl;
  uint32_t version;
  bool is_signed;
};
constexpr size_t kCheckedMapsKept = 16;

inline std::mutex& checked_maps_mutex() {
  static std::mutex mutex;
  return mutex;
}

inline std::deque<CheckedMap>& checked_maps() {
  static std::deque<CheckedMap> maps;
  return maps;
}

inline bool map_values_checked(const at::Tensor& map, bool is_signed) {
  if (map.is_inference()) return false;
  const uint32_t version = map.unsafeGetTensorImpl()->version_counter().current_version();
  std::lock_guard<std::mutex> lock(checked_maps_mutex());
  for (const CheckedMap& entry : checked_maps()) {
    if (entry.impl.get() == map.unsafeGetTensorImpl() && entry.version == version &&
        entry.is_signed == is_signed)
      return true;
  }
  return false;
}

inline void remember_map_values_checked(const at::Tensor& map, bool is_signed) {
  if (map.is_inference()) return;
  const uint32_t version = map.unsafeGetTensorImpl()->version_counter().current_version();
  std::lock_guard<std::mutex> lock(checked_maps_mutex());
  checked_maps().push_back(CheckedMap{map.getIntrusivePtr(), version, is_signed});
  if (checked_maps().size() > kCheckedMapsKept) checked_maps().pop_front();
}

// A map is 256 strictly increasing, finite float32 values in [-1, 1] (in [0, 1] when unsigned)
// containing an exact 0, on the parameter's device. Checking the values reads the 1 KB map back to
// the host (a synchronising copy on CUDA), once per map tensor and version (see CheckedMap).
inline void check_quant_map(const char* op, const char* name, const at::Tensor& map,
                            const at::Tensor& param, bool is_signed) {
  TORCH_CHECK(map.scalar_type() == at::kFloat, op, ": argument '", name, "' has dtype ",
              map.scalar_type(), "; a quantization map is 256 float32 values (worker.quant_map)");
  TORCH_CHECK(map.dim() == 1 && map.numel() == blockwise8::kMapSize, op, ": argument '", name,
              "' has shape ", map.sizes(), "; a quantization map is a 1-d tensor of ",
              blockwise8::kMapSize, " float32 values (worker.quant_map.dynamic_map)");
  TORCH_CHECK(map.device() == param.device(), op, ": argument '", name, "' is on ", map.device(),
              " but 'param' is on ", param.device(), "; put the map on the parameter's device");
  check_contiguous(op, name, map);
  if (map_values_checked(map, is_signed)) return;
  const at::Tensor host = map.cpu();
  const float* values = host.data_ptr<float>();
  bool has_zero = false;
  for (int i = 0; i < blockwise8::kMapSize; ++i) {
    TORCH_CHECK(std::isfinite(values[i]) && values[i] >= (is_signed ? -1.0f : 0.0f) &&
                    values[i] <= 1.0f,
                op, ": argument '", name, "' has value ", values[i], " at index ", i,
                "; map values must lie in ", (is_signed ? "[-1, 1]" : "[0, 1]"),
                (is_signed ? "" : " (this argument takes the unsigned map)"));
    TORCH_CHECK(i == 0 || values[i - 1] < values[i], op, ": argument '", name,
                "' is not sorted strictly ascending: value ", values[i], " at index ", i,
                " follows ", values[i - 1], "; pass the map sorted (torch.sort) without repeats");
    has_zero = has_zero || values[i] == 0.0f;
  }
  TORCH_CHECK(has_zero, op, ": argument '", name,
              "' has no exact 0, so a fresh (zero) state cannot be represented; use "
              "worker.quant_map.dynamic_map");
  remember_map_values_checked(map, is_signed);
}

// ---- one function per 8-bit op: tensors, maps and hyperparameters ----

inline void check_adam_8bit_blockwise_step(
    const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_codes,
    const at::Tensor& exp_avg_absmax, const at::Tensor& exp_avg_sq_codes,
    const at::Tensor& exp_avg_sq_absmax, const at::Tensor& signed_map,
    const at::Tensor& unsigned_map, int64_t step, double lr, double beta1, double beta2,
    double eps, double weight_decay, double gnorm_scale) {
  const char* op = "optdrift::adam_8bit_blockwise_step";
  check_param_and_grad(op, param, grad);
  check_quantized_states(op, param,
                         {{"exp_avg_codes", &exp_avg_codes, "exp_avg_absmax", &exp_avg_absmax},
                          {"exp_avg_sq_codes", &exp_avg_sq_codes, "exp_avg_sq_absmax",
                           &exp_avg_sq_absmax}});
  check_quant_map(op, "signed_map", signed_map, param, /*is_signed=*/true);
  check_quant_map(op, "unsigned_map", unsigned_map, param, /*is_signed=*/false);
  check_adam_hyperparameters(op, step, lr, beta1, beta2, eps, weight_decay, gnorm_scale);
}

inline void check_ademamix_8bit_blockwise_step(
    const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_fast_codes,
    const at::Tensor& exp_avg_fast_absmax, const at::Tensor& exp_avg_slow_codes,
    const at::Tensor& exp_avg_slow_absmax, const at::Tensor& exp_avg_sq_codes,
    const at::Tensor& exp_avg_sq_absmax, const at::Tensor& signed_map,
    const at::Tensor& unsigned_map, int64_t step, double lr, double beta1, double beta2,
    double beta3, double alpha, double eps, double weight_decay, double gnorm_scale) {
  const char* op = "optdrift::ademamix_8bit_blockwise_step";
  check_param_and_grad(op, param, grad);
  check_quantized_states(
      op, param,
      {{"exp_avg_fast_codes", &exp_avg_fast_codes, "exp_avg_fast_absmax", &exp_avg_fast_absmax},
       {"exp_avg_slow_codes", &exp_avg_slow_codes, "exp_avg_slow_absmax", &exp_avg_slow_absmax},
       {"exp_avg_sq_codes", &exp_avg_sq_codes, "exp_avg_sq_absmax", &exp_avg_sq_absmax}});
  check_quant_map(op, "signed_map", signed_map, param, /*is_signed=*/true);
  check_quant_map(op, "unsigned_map", unsigned_map, param, /*is_signed=*/false);
  check_ademamix_hyperparameters(op, step, lr, beta1, beta2, beta3, alpha, eps, weight_decay,
                                 gnorm_scale);
}

inline void check_lion_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad,
                                           const at::Tensor& exp_avg_codes,
                                           const at::Tensor& exp_avg_absmax,
                                           const at::Tensor& signed_map, double lr, double beta1,
                                           double beta2, double weight_decay,
                                           double gnorm_scale) {
  const char* op = "optdrift::lion_8bit_blockwise_step";
  check_param_and_grad(op, param, grad);
  check_quantized_states(op, param,
                         {{"exp_avg_codes", &exp_avg_codes, "exp_avg_absmax", &exp_avg_absmax}});
  check_quant_map(op, "signed_map", signed_map, param, /*is_signed=*/true);
  check_lion_hyperparameters(op, lr, beta1, beta2, weight_decay, gnorm_scale);
}

inline void check_momentum_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad,
                                               const at::Tensor& momentum_buffer_codes,
                                               const at::Tensor& momentum_buffer_absmax,
                                               const at::Tensor& signed_map, int64_t step,
                                               double lr, double momentum, double weight_decay,
                                               double gnorm_scale) {
  const char* op = "optdrift::momentum_8bit_blockwise_step";
  check_param_and_grad(op, param, grad);
  check_quantized_states(op, param,
                         {{"momentum_buffer_codes", &momentum_buffer_codes,
                           "momentum_buffer_absmax", &momentum_buffer_absmax}});
  check_quant_map(op, "signed_map", signed_map, param, /*is_signed=*/true);
  check_momentum_hyperparameters(op, step, lr, momentum, weight_decay, gnorm_scale);
}

inline void check_rmsprop_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad,
                                              const at::Tensor& square_avg_codes,
                                              const at::Tensor& square_avg_absmax,
                                              const at::Tensor& unsigned_map, double lr,
                                              double alpha, double eps, double weight_decay,
                                              double gnorm_scale) {
  const char* op = "optdrift::rmsprop_8bit_blockwise_step";
  check_param_and_grad(op, param, grad);
  check_quantized_states(
      op, param,
      {{"square_avg_codes", &square_avg_codes, "square_avg_absmax", &square_avg_absmax}});
  check_quant_map(op, "unsigned_map", unsigned_map, param, /*is_signed=*/false);
  check_rmsprop_hyperparameters(op, lr, alpha, eps, weight_decay, gnorm_scale);
}

inline void check_adagrad_8bit_blockwise_step(const at::Tensor& param, const at::Tensor& grad,
                                              const at::Tensor& state_sum_codes,
                                              const at::Tensor& state_sum_absmax,
                                              const at::Tensor& unsigned_map, double lr,
                                              double eps, double weight_decay,
                                              double gnorm_scale) {
  const char* op = "optdrift::adagrad_8bit_blockwise_step";
  check_param_and_grad(op, param, grad);
  check_quantized_states(
      op, param,
      {{"state_sum_codes", &state_sum_codes, "state_sum_absmax", &state_sum_absmax}});
  check_quant_map(op, "unsigned_map", unsigned_map, param, /*is_signed=*/false);
  check_adagrad_hyperparameters(op, lr, eps, weight_decay, gnorm_scale);
}

}  // namespace optdrift::checks::detail
