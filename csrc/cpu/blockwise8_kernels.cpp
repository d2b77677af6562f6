// CPU kernels of the 8-bit blockwise optimizers. The step on one block (dequantize, the float32
// rule of optimizer_math.h, new absmax, requantize to the nearest code) is described in
// quant_map.h; blocks are independent, so they are split into chunks freely (the op units of
// blockwise8.cpp run them through at::parallel_for) and the result does not depend on the thread
// count. No torch header: see kernels_cpu.h.
#include <algorithm>
#include <cmath>

#include "../optimizer_math.h"
#include "../quant_map.h"
#include "dispatch_cpu.h"
#include "kernels_cpu.h"

namespace optdrift::cpu {
namespace {

using blockwise8::kBlockSize;
using blockwise8::kMapSize;

// Each parallel task takes at least this many blocks (16 * 256 = 4096 elements).
constexpr int64_t kBlocksPerTask = 16;

template <typename Rule, typename param_t>
struct BlockwiseTask {
  static constexpr int kStates = Rule::kStates;
  const Rule& rule;
  const BlockwiseArgs& args;

  static void run(const void* task, int64_t first_block, int64_t end_block) {
    static_cast<const BlockwiseTask*>(task)->apply(first_block, end_block);
  }

  void apply(int64_t first_block, int64_t end_block) const {
    const int64_t numel = args.numel;
    param_t* param_data = static_cast<param_t*>(args.param);
    const param_t* grad_data = static_cast<const param_t*>(args.grad);
    blockwise8::QuantizedStates<kStates> states;
    for (int k = 0; k < kStates; ++k) {
      states.codes[k] = args.codes[k];
      states.absmax[k] = args.absmax[k];
      states.map[k] = args.map[k];
    }
    float values[kStates][kBlockSize];
    for (int64_t block = first_block; block < end_block; ++block) {
      const int64_t begin = block * kBlockSize;
      const int count = static_cast<int>(std::min<int64_t>(kBlockSize, numel - begin));
      float old_absmax[kStates];
      float new_absmax[kStates];
      for (int k = 0; k < kStates; ++k) {
        old_absmax[k] = states.absmax[k][block];
        new_absmax[k] = 0.0f;
      }
      for (int j = 0; j < count; ++j) {
        const int64_t i = begin + j;
        float state[kStates];
        for (int k = 0; k < kStates; ++k)
          state[k] = states.map[k][states.codes[k][i]] * old_absmax[k];
        float value = static_cast<float>(param_data[i]);
        if (blockwise8::update_element(rule, value, static_cast<float>(grad_data[i]), state))
          param_data[i] = static_cast<param_t>(value);
        for (int k = 0; k < kStates; ++k) {
          values[k][j] = state[k];
          // fmaxf drops a NaN operand, on the host as on the device.
          new_absmax[k] = std::fmax(new_absmax[k], std::fabs(state[k]));
        }
      }
      for (int k = 0; k < kStates; ++k) {
        states.absmax[k][block] = new_absmax[k];
        for (int j = 0; j < count; ++j)
          states.codes[k][begin + j] = blockwise8::quantize_nearest(
              states.map[k], blockwise8::normalise(values[k][j], new_absmax[k]));
      }
    }
  }
};

template <typename Rule, typename param_t>
void apply_blockwise_typed(const Rule& rule, const BlockwiseArgs& args) {
  const int64_t numel = args.numel;
  const int64_t blocks = (numel + kBlockSize - 1) / kBlockSize;
  const BlockwiseTask<Rule, param_t> task{rule, args};
  args.parallel_for(blocks, kBlocksPerTask, &task, &BlockwiseTask<Rule, param_t>::run);
}

template <typename Rule>
void apply_blockwise(const char* op, const Rule& rule, const BlockwiseArgs& args) {
  dispatch_param_type<Rule::kStates>(op, args, [&](auto zero) {
    apply_blockwise_typed<Rule, decltype(zero)>(rule, args);
  });
}

}  // namespace

namespace kernels {

void adam_8bit_blockwise_step(const BlockwiseArgs& args, int64_t step, double lr, double beta1,
                              double beta2, double eps, double weight_decay, double gnorm_scale,
                              bool skip_zeros) {
  const AdamRule rule =
      make_adam_rule(step, lr, beta1, beta2, eps, weight_decay, gnorm_scale, skip_zeros);
  apply_blockwise("adam_8bit_blockwise_step_cpu", rule, args);
}

void ademamix_8bit_blockwise_step(const BlockwiseArgs& args, int64_t step, double lr,
                                  double beta1, double beta2, double beta3, double alpha,
                                  double eps, double weight_decay, double gnorm_scale) {
  const AdemamixRule rule = make_ademamix_rule(step, lr, beta1, beta2, beta3, alpha, eps,
                                               weight_decay, gnorm_scale);
  apply_blockwise("ademamix_8bit_blockwise_step_cpu", rule, args);
}

void lion_8bit_blockwise_step(const BlockwiseArgs& args, double lr, double beta1, double beta2,
                              double weight_decay, double gnorm_scale) {
  const LionRule rule = make_lion_rule(lr, beta1, beta2, weight_decay, gnorm_scale);
  apply_blockwise("lion_8bit_blockwise_step_cpu", rule, args);
}

void momentum_8bit_blockwise_step(const BlockwiseArgs& args, int64_t step, double lr,
                                  double momentum, double weight_decay, double gnorm_scale) {
  const MomentumRule rule = make_momentum_rule(step, lr, momentum, weight_decay, gnorm_scale);
  apply_blockwise("momentum_8bit_blockwise_step_cpu", rule, args);
}

void rmsprop_8bit_blockwise_step(const BlockwiseArgs& args, double lr, double alpha, double eps,
                                 double weight_decay, double gnorm_scale) {
  const RmspropRule rule = make_rmsprop_rule(lr, alpha, eps, weight_decay, gnorm_scale);
  apply_blockwise("rmsprop_8bit_blockwise_step_cpu", rule, args);
}

void adagrad_8bit_blockwise_step(const BlockwiseArgs& args, double lr, double eps,
                                 double weight_decay, double gnorm_scale) {
  const AdagradRule rule = make_adagrad_rule(lr, eps, weight_decay, gnorm_scale);
  apply_blockwise("adagrad_8bit_blockwise_step_cpu", rule, args);
}

}  // namespace kernels

}  // namespace optdrift::cpu
