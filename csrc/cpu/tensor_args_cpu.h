// The op units' side of kernels_cpu.h: the kernels' arguments filled from tensors (already
// checked by checks.h), and ATen's thread pool as their ParallelFor.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>

#include "kernels_cpu.h"

namespace optdrift::cpu {

inline void aten_parallel_for(int64_t n, int64_t grain, const void* task, RangeBody body) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { body(task, begin, end); });
}

inline ParamType param_type(const char* op, const at::Tensor& param) {
  switch (param.scalar_type()) {
    case at::kFloat: return ParamType::kFloat32;
    case at::kHalf: return ParamType::kFloat16;
    case at::kBFloat16: return ParamType::kBFloat16;
    default: break;
  }
  // checks.h has already refused any other dtype with the message a caller sees.
  TORCH_INTERNAL_ASSERT(false, op, ": parameter dtype ", param.scalar_type(), " passed the checks");
}

inline ElementwiseArgs elementwise_args(const char* op, const at::Tensor& param,
                                        const at::Tensor& grad,
                                        std::initializer_list<const at::Tensor*> states) {
  TORCH_INTERNAL_ASSERT(states.size() <= kMaxStates, op, ": too many state tensors");
  ElementwiseArgs args{param_type(op, param), param.data_ptr(), grad.data_ptr(), param.numel(),
                       static_cast<int>(states.size()), {}, &aten_parallel_for};
  int k = 0;
  for (const at::Tensor* state : states) args.states[k++] = state->data_ptr<float>();
  return args;
}

// One 8-bit state's tensors: its codes, its per-block absmax and its map.
struct StateTensors {
  const at::Tensor* codes;
  const at::Tensor* absmax;
  const at::Tensor* map;
};

inline BlockwiseArgs blockwise_args(const char* op, const at::Tensor& param,
                                    const at::Tensor& grad,
                                    std::initializer_list<StateTensors> states) {
  TORCH_INTERNAL_ASSERT(states.size() <= kMaxStates, op, ": too many state tensors");
  BlockwiseArgs args{param_type(op, param), param.data_ptr(), grad.data_ptr(), param.numel(),
                     static_cast<int>(states.size()), {}, {}, {}, &aten_parallel_for};
  int k = 0;
  for (const StateTensors& state : states) {
    args.codes[k] = state.codes->data_ptr<uint8_t>();
    args.absmax[k] = state.absmax->data_ptr<float>();
    args.map[k] = state.map->data_ptr<float>();
    ++k;
  }
  return args;
}

}  // namespace optdrift::cpu
