// Host-side logic of the multi-tensor ops (*_multi_step, schemas in ops.cpp): ONE op call steps
// every tensor of an optimizer (all its param groups), as ATen's fused Adam and apex's
// multi_tensor_apply do. Shared by cpu/multi_tensor.cpp and cuda/multi_tensor.cu, which differ
// only in how they walk the chunk list this file makes; no torch header (nvcc compiles it too).
//
// What the op keeps between calls (the library's shared state, digested by the engines):
//   * `steps`: int64 [tensors], one step counter per tensor; the op advances each tensor's own
//     counter by one and steps that tensor with the new value (so step 1 is a fresh tensor).
//   * `beta_powers` (Adam, AdEMAMix): float32 [groups, 3] per param group = (the step the row was
//     made for, beta1^t, beta2^t) as float32 RUNNING PRODUCTS, as DeepSpeed's CPU Adam keeps them:
//     at the next step (t == cached + 1) each power is multiplied by its beta once; another tensor
//     of the group at the same step reuses the row; anything else (a fresh row, a jump) recomputes
//     it with powf. The bias corrections come from these powers, so they differ from the one-tensor
//     ops' (1 - beta^t in double) by the float32 rounding of the powers (docs/KERNELS.md,
//     "Multi-tensor entry points").
// Everything else (the per-element update) is optimizer_math.h's rules, unchanged.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "optimizer_math.h"

namespace optdrift::multi {

// Elements per chunk: a CUDA block's work (256 threads x 4 elements x 64 iterations) and the CPU's
// unit of parallel work. A chunk never spans two tensors.
constexpr int64_t kChunkElements = 65536;
constexpr int kMaxStates = 3;
constexpr int kPowerColumns = 3;  // beta_powers row: step, beta1^t, beta2^t

struct Chunk {
  int64_t tensor;  // index into the op's lists
  int64_t start;   // first element of the chunk inside that tensor
  int64_t length;  // elements, <= kChunkElements
};

// Every tensor cut into chunks of kChunkElements (its last chunk shorter), tensors in order.
inline std::vector<Chunk> make_chunks(const std::vector<int64_t>& numels) {
  std::vector<Chunk> chunks;
  for (int64_t tensor = 0; tensor < static_cast<int64_t>(numels.size()); ++tensor) {
    const int64_t numel = numels[tensor];
    for (int64_t start = 0; start < numel; start += kChunkElements) {
      const int64_t length = std::min(kChunkElements, numel - start);
      chunks.push_back(Chunk{tensor, start, length});
    }
  }
  return chunks;
}

// The group's row of beta_powers made current for `step` (see the file comment).
inline void beta_powers_for_step(float* row, int64_t step, float beta1, float beta2) {
  const int64_t cached = static_cast<int64_t>(row[0]);
  if (cached == step) return;  // another tensor of this group, same step: reuse
  if (cached >= 1 && step == cached + 1) {
    row[1] *= beta1;  // the next step: one more factor
    row[2] *= beta2;
  } else {
    row[1] = std::pow(beta1, static_cast<float>(step));  // a fresh row or a jump
    row[2] = std::pow(beta2, static_cast<float>(step));
  }
  row[0] = static_cast<float>(step);
}

// ---- one param group's hyperparameters per optimizer, and the rule of one of its tensors ----
// `step` is the tensor's own (already advanced) counter; `powers` its group's beta_powers row.

struct AdamGroup {
  double lr, beta1, beta2, eps, weight_decay, gnorm_scale;
  bool skip_zeros;
  static constexpr bool kUsesPowers = true;
  AdamRule rule(int64_t step, float* powers) const {
    beta_powers_for_step(powers, step, static_cast<float>(beta1), static_cast<float>(beta2));
    AdamRule made = make_adam_rule(step, lr, beta1, beta2, eps, weight_decay, gnorm_scale, skip_zeros);
    // The bias corrections from the cached float32 powers instead of pow() in double.
    const double bias_correction1 = 1.0 - static_cast<double>(powers[1]);
    const double bias_correction2 = 1.0 - static_cast<double>(powers[2]);
    made.step_size = static_cast<float>(lr / bias_correction1);
    made.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
    return made;
  }
};

struct AdemamixGroup {
  double lr, beta1, beta2, beta3, alpha, eps, weight_decay, gnorm_scale;
  static constexpr bool kUsesPowers = true;
  AdemamixRule rule(int64_t step, float* powers) const {
    beta_powers_for_step(powers, step, static_cast<float>(beta1), static_cast<float>(beta2));
    AdemamixRule made =
        make_ademamix_rule(step, lr, beta1, beta2, beta3, alpha, eps, weight_decay, gnorm_scale);
    const double bias_correction1 = 1.0 - static_cast<double>(powers[1]);
    const double bias_correction2 = 1.0 - static_cast<double>(powers[2]);
    made.inv_bias_correction1 = static_cast<float>(1.0 / bias_correction1);
    made.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
    return made;
  }
};

struct LionGroup {
  double lr, beta1, beta2, weight_decay, gnorm_scale;
  static constexpr bool kUsesPowers = false;
  LionRule rule(int64_t, float*) const {
    return make_lion_rule(lr, beta1, beta2, weight_decay, gnorm_scale);
  }
};

struct MomentumGroup {
  double lr, momentum, weight_decay, gnorm_scale;
  static constexpr bool kUsesPowers = false;
  MomentumRule rule(int64_t step, float*) const {
    return make_momentum_rule(step, lr, momentum, weight_decay, gnorm_scale);
  }
};

struct RmspropGroup {
  double lr, alpha, eps, weight_decay, gnorm_scale;
  static constexpr bool kUsesPowers = false;
  RmspropRule rule(int64_t, float*) const {
    return make_rmsprop_rule(lr, alpha, eps, weight_decay, gnorm_scale);
  }
};

struct AdagradGroup {
  double lr, eps, weight_decay, gnorm_scale;
  static constexpr bool kUsesPowers = false;
  AdagradRule rule(int64_t, float*) const {
    return make_adagrad_rule(lr, eps, weight_decay, gnorm_scale);
  }
};

// The op's lists as raw pointers (filled by the op units from checked tensors).
struct RawLists {
  std::vector<void*> params;
  std::vector<const void*> grads;
  std::vector<float*> states[kMaxStates];  // states[k][i]: tensor i's k-th state
  std::vector<int64_t> numels;
  std::vector<int64_t> group_of;
  int64_t* steps = nullptr;        // [tensors], advanced here
  float* beta_powers = nullptr;    // [groups, kPowerColumns]; unused by optimizers without powers
};

// One tensor of a step: where its data lives and the rule that updates it.
template <typename Rule>
struct TensorEntry {
  void* param;
  const void* grad;
  float* states[Rule::kStates];
  Rule rule;
};

// The shared-state part of a step, in tensor order: each tensor's counter advanced, its group's
// hyperparameters and beta powers made into its rule, its buffers picked from the lists.
template <typename Group>
auto plan_step(const RawLists& lists, const std::vector<Group>& groups) {
  using Rule = decltype(std::declval<const Group&>().rule(int64_t{1}, nullptr));
  std::vector<TensorEntry<Rule>> entries(lists.params.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const int64_t group = lists.group_of[i];
    const Group& hyper = groups[group];
    const int64_t step = ++lists.steps[i];
    float* powers = Group::kUsesPowers ? lists.beta_powers + group * kPowerColumns : nullptr;
    TensorEntry<Rule>& entry = entries[i];
    entry.rule = hyper.rule(step, powers);
    entry.param = lists.params[i];
    entry.grad = lists.grads[i];
    for (int k = 0; k < Rule::kStates; ++k) entry.states[k] = lists.states[k][i];
  }
  return entries;
}

}  // namespace optdrift::multi
