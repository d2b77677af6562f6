// Walks param, grad and the float32 states element by element on the CPU and applies one rule
// from optimizer_math.h. Elements are independent, so the range is split into chunks freely (the
// op units run them through at::parallel_for); the result does not depend on the thread count.
// No torch header: see kernels_cpu.h.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../optimizer_math.h"
#include "kernels_cpu.h"

namespace optdrift::cpu {

// Large enough that the per-chunk overhead vanishes, small enough that 65536 elements still
// spread over a few threads.
constexpr int64_t kGrainSize = 16384;

template <typename Rule, typename param_t>
struct ElementwiseTask {
  const Rule& rule;
  const ElementwiseArgs& args;

  static void run(const void* task, int64_t begin, int64_t end) {
    static_cast<const ElementwiseTask*>(task)->apply(begin, end);
  }

  void apply(int64_t begin, int64_t end) const {
    param_t* param_data = static_cast<param_t*>(args.param);
    const param_t* grad_data = static_cast<const param_t*>(args.grad);
    float* const* state_data = args.states;
    for (int64_t i = begin; i < end; ++i) {
      float value = static_cast<float>(param_data[i]);
      float state[Rule::kStates];
      for (int k = 0; k < Rule::kStates; ++k) state[k] = state_data[k][i];
      rule(value, static_cast<float>(grad_data[i]), state);
      param_data[i] = static_cast<param_t>(value);
      for (int k = 0; k < Rule::kStates; ++k) state_data[k][i] = state[k];
    }
  }
};

template <typename Rule, typename param_t>
void apply_rule_typed(const Rule& rule, const ElementwiseArgs& args) {
  const ElementwiseTask<Rule, param_t> task{rule, args};
  args.parallel_for(args.numel, kGrainSize, &task, &ElementwiseTask<Rule, param_t>::run);
}

// Dispatches on the parameter type (checked to be fp32/fp16/bf16 before this is called).
template <typename Rule>
void apply_rule(const char* op, const Rule& rule, const ElementwiseArgs& args) {
  // A state list of the wrong length is a bug in the op unit, not a bad call.
  if (args.state_count != Rule::kStates)
    throw std::logic_error(std::string(op) + ": the op passed the wrong number of state tensors");
  if (args.numel == 0) return;
  switch (args.type) {
    case ParamType::kFloat32: return apply_rule_typed<Rule, float>(rule, args);
    case ParamType::kFloat16: return apply_rule_typed<Rule, c10::Half>(rule, args);
    case ParamType::kBFloat16: return apply_rule_typed<Rule, c10::BFloat16>(rule, args);
  }
  throw std::logic_error(std::string(op) + ": unknown parameter type");
}

}  // namespace optdrift::cpu
