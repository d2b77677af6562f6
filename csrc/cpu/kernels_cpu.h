// The CPU kernels' interface: plain C++ with raw pointers, no torch header. The kernels
// (*_kernels.cpp, which hold the update math of optimizer_math.h and quant_map.h) include only
// this, c10's 16-bit float types and the math; the op units (one_state.cpp, two_state.cpp,
// blockwise8.cpp) check the tensors, fill these arguments from them (tensor_args_cpu.h) and
// register the ops with torch. The split keeps the torch headers, which take most of a compile,
// out of the files a change to the math recompiles.
#pragma once

#include <cstdint>

namespace optdrift::cpu {

// The parameter's (and gradient's) element type; states are always float32.
enum class ParamType { kFloat32, kFloat16, kBFloat16 };

// Runs body(task, begin, end) over chunks covering [0, n), each at least `grain` long (but the
// last), possibly on several threads at once. The op units pass ATen's at::parallel_for.
using RangeBody = void (*)(const void* task, int64_t begin, int64_t end);
using ParallelFor = void (*)(int64_t n, int64_t grain, const void* task, RangeBody body);

constexpr int kMaxStates = 3;

// A 32-bit-state op's tensors: param and grad of `type`, `state_count` float32 states, all
// `numel` elements long and contiguous (checked by the op units before a kernel is called).
struct ElementwiseArgs {
  ParamType type;
  void* param;
  const void* grad;
  int64_t numel;
  int state_count;
  float* states[kMaxStates];
  ParallelFor parallel_for;
};

// An 8-bit blockwise op's tensors: per state, its uint8 codes (numel), its float32 absmax (one
// per block of quant_map.h's kBlockSize) and its 256-value float32 map.
struct BlockwiseArgs {
  ParamType type;
  void* param;
  const void* grad;
  int64_t numel;
  int state_count;
  uint8_t* codes[kMaxStates];
  float* absmax[kMaxStates];
  const float* map[kMaxStates];
  ParallelFor parallel_for;
};

namespace kernels {
// 32-bit states (two_state_kernels.cpp, one_state_kernels.cpp)
void adam_step(const ElementwiseArgs& args, int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, double gnorm_scale, bool skip_zeros);
void ademamix_step(const ElementwiseArgs& args, int64_t step, double lr, double beta1, double beta2, double beta3, double alpha, double eps, double weight_decay, double gnorm_scale);
void lion_step(const ElementwiseArgs& args, double lr, double beta1, double beta2, double weight_decay, double gnorm_scale);
void momentum_step(const ElementwiseArgs& args, int64_t step, double lr, double momentum, double weight_decay, double gnorm_scale);
void rmsprop_step(const ElementwiseArgs& args, double lr, double alpha, double eps, double weight_decay, double gnorm_scale);
void adagrad_step(const ElementwiseArgs& args, double lr, double eps, double weight_decay, double gnorm_scale);

// 8-bit blockwise states (blockwise8_kernels.cpp)
void adam_8bit_blockwise_step(const BlockwiseArgs& args, int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, double gnorm_scale, bool skip_zeros);
void ademamix_8bit_blockwise_step(const BlockwiseArgs& args, int64_t step, double lr, double beta1, double beta2, double beta3, double alpha, double eps, double weight_decay, double gnorm_scale);
void lion_8bit_blockwise_step(const BlockwiseArgs& args, double lr, double beta1, double beta2, double weight_decay, double gnorm_scale);
void momentum_8bit_blockwise_step(const BlockwiseArgs& args, int64_t step, double lr, double momentum, double weight_decay, double gnorm_scale);
void rmsprop_8bit_blockwise_step(const BlockwiseArgs& args, double lr, double alpha, double eps, double weight_decay, double gnorm_scale);
void adagrad_8bit_blockwise_step(const BlockwiseArgs& args, double lr, double eps, double weight_decay, double gnorm_scale);
}  // namespace kernels

}  // namespace optdrift::cpu
