// Argument checks of the multi-tensor ops (*_multi_step): declared here, defined in
// multi_tensor_checks.cpp, a host C++ unit, for checks.h's reason (nvcc must not compile a
// TORCH_CHECK that formats an integer). Each throws with the op, the argument, the tensor's index
// or the param group, and what to pass instead.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "multi_tensor.h"

namespace optdrift::checks {

// One state list with its schema name (e.g. {"exp_avgs", exp_avgs}).
using NamedTensorList = std::pair<const char*, at::TensorList>;
// One hyperparameter list's name and length.
using NamedLength = std::pair<const char*, size_t>;

// The lists: equal lengths, each tensor i like the one-tensor op's (param fp32/fp16/bf16, grad in
// its dtype, float32 states, one device, equal element counts, contiguous), one param dtype and
// one device over the lists; `steps` int64 on the CPU with one counter per tensor, each >= 0;
// `beta_powers` (nullptr: the op has none) float32 [groups, 3] on the CPU; `group_of` one entry per
// tensor, each in [0, groups); every hyperparameter list `groups` long (groups = the first's).
void check_multi_lists(const char* op, at::TensorList params, at::TensorList grads,
                       const std::vector<NamedTensorList>& states, const at::Tensor& steps,
                       const at::Tensor* beta_powers, at::IntArrayRef group_of,
                       const std::vector<NamedLength>& hyper_lengths);

// Each param group's hyperparameters, as the one-tensor op checks its scalars.
void check_multi_groups(const char* op, const std::vector<multi::AdamGroup>& groups);
void check_multi_groups(const char* op, const std::vector<multi::AdemamixGroup>& groups);
void check_multi_groups(const char* op, const std::vector<multi::LionGroup>& groups);
void check_multi_groups(const char* op, const std::vector<multi::MomentumGroup>& groups);
void check_multi_groups(const char* op, const std::vector<multi::RmspropGroup>& groups);
void check_multi_groups(const char* op, const std::vector<multi::AdagradGroup>& groups);

}  // namespace optdrift::checks
