// Walks param, grad and the float32 states element by element on the CPU and applies one rule
// from optimizer_math.h. Elements are independent, so at::parallel_for splits the range freely;
// the result does not depend on the thread count.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <array>

#include "../optimizer_math.h"

namespace optdrift::cpu {

// Large enough that the per-chunk overhead vanishes, small enough that 65536 elements still
// spread over a few threads.
constexpr int64_t kGrainSize = 16384;

template <typename Rule, typename param_t>
void apply_rule_typed(const Rule& rule, const at::Tensor& param, const at::Tensor& grad,
                      const std::array<const at::Tensor*, Rule::kStates>& states) {
  param_t* param_data = param.data_ptr<param_t>();
  const param_t* grad_data = grad.data_ptr<param_t>();
  std::array<float*, Rule::kStates> state_data;
  for (int k = 0; k < Rule::kStates; ++k) state_data[k] = states[k]->template data_ptr<float>();

  at::parallel_for(0, param.numel(), kGrainSize, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float value = static_cast<float>(param_data[i]);
      float state[Rule::kStates];
      for (int k = 0; k < Rule::kStates; ++k) state[k] = state_data[k][i];
      rule(value, static_cast<float>(grad_data[i]), state);
      param_data[i] = static_cast<param_t>(value);
      for (int k = 0; k < Rule::kStates; ++k) state_data[k][i] = state[k];
    }
  });
}

// Dispatches on the parameter dtype (checked to be fp32/fp16/bf16 before this is called).
template <typename Rule>
void apply_rule(const char* op, const Rule& rule, const at::Tensor& param, const at::Tensor& grad,
                const std::array<const at::Tensor*, Rule::kStates>& states) {
  // A brace list shorter than kStates would compile (std::array pads with nullptr).
  for (const at::Tensor* state : states)
    TORCH_INTERNAL_ASSERT(state != nullptr, op, ": a state tensor was not passed to apply_rule");
  if (param.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "optdrift_apply_rule_cpu", [&] {
    apply_rule_typed<Rule, scalar_t>(rule, param, grad, states);
  });
}

}  // namespace optdrift::cpu
