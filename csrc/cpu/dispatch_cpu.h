// The CPU kernels' dispatch on the parameter type, shared by the 32-bit (apply_cpu.h) and 8-bit
// (blockwise8_kernels.cpp) kernels. No torch header: see kernels_cpu.h.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <stdexcept>
#include <string>

#include "kernels_cpu.h"

namespace optdrift::cpu {

// Calls typed(param_t{}) with the C++ type of args.type (checked to be fp32/fp16/bf16 before a
// kernel is called), after checking that the op passed kStates states; nothing for 0 elements.
template <int kStates, typename Args, typename Typed>
void dispatch_param_type(const char* op, const Args& args, Typed&& typed) {
  // A state list of the wrong length is a bug in the op unit, not a bad call.
  if (args.state_count != kStates)
    throw std::logic_error(std::string(op) + ": the op passed the wrong number of state tensors");
  if (args.numel == 0) return;
  switch (args.type) {
    case ParamType::kFloat32: return typed(float{});
    case ParamType::kFloat16: return typed(c10::Half{});
    case ParamType::kBFloat16: return typed(c10::BFloat16{});
  }
  throw std::logic_error(std::string(op) + ": unknown parameter type");
}

}  // namespace optdrift::cpu
