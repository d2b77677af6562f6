// Walks param, grad and the float32 states element by element on the CPU and applies one rule
// from optimizer_math.h. Elements are independent, so the range is split into chunks freely (the
// op units run them through at::parallel_for); the result does not depend on the thread count.
// No torch header: see kernels_cpu.h.
#pragma once

#include <cstdint>

#include "../optimizer_math.h"
#include "dispatch_cpu.h"
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

template <typename Rule>
void apply_rule(const char* op, const Rule& rule, const ElementwiseArgs& args) {
  dispatch_param_type<Rule::kStates>(op, args, [&](auto zero) {
    apply_rule_typed<Rule, decltype(zero)>(rule, args);
  });
}

}  // namespace optdrift::cpu
