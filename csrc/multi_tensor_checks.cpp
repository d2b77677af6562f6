// The definitions behind multi_tensor_checks.h: a host C++ unit (see checks.h for why), reusing
// the one-tensor ops' checks of checks_impl.h tensor by tensor and group by group.
#include "multi_tensor_checks.h"

#include <c10/util/Exception.h>

#include <string>

#include "checks_impl.h"

namespace optdrift::checks {
namespace {

// "optdrift::adam_multi_step (tensor 3)": the one-tensor checks' messages then name the tensor.
std::string where(const char* op, const char* what, size_t index) {
  return std::string(op) + " (" + what + " " + std::to_string(index) + ")";
}

}  // namespace

void check_multi_lists(const char* op, at::TensorList params, at::TensorList grads,
                       const std::vector<NamedTensorList>& states, const at::Tensor& steps,
                       const at::Tensor* beta_powers, at::IntArrayRef group_of,
                       const std::vector<NamedLength>& hyper_lengths) {
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count, op, ": 'grads' has ", grads.size(), " tensors but 'params' has ",
              count, "; pass one gradient per parameter");
  for (const auto& [name, list] : states)
    TORCH_CHECK(list.size() == count, op, ": state list '", name, "' has ", list.size(),
                " tensors but 'params' has ", count, "; pass one state tensor per parameter");
  TORCH_CHECK(group_of.size() == count, op, ": 'group_of' has ", group_of.size(),
              " entries but 'params' has ", count, " tensors; pass each tensor's param group");
  TORCH_CHECK(!hyper_lengths.empty(), op, ": the op passed no hyperparameter list");
  const size_t groups = hyper_lengths.front().second;
  for (const auto& [name, length] : hyper_lengths)
    TORCH_CHECK(length == groups, op, ": hyperparameter list '", name, "' has ", length,
                " entries but '", hyper_lengths.front().first, "' has ", groups,
                "; pass one value per param group");
  TORCH_CHECK(count == 0 || groups >= 1, op, ": no param group; pass one value per group in '",
              hyper_lengths.front().first, "'");
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK(group_of[i] >= 0 && static_cast<size_t>(group_of[i]) < groups, op, ": group_of[", i,
                "] is ", group_of[i], " but there are ", groups, " param groups (0..", groups - 1, ")");
    const std::string tensor_op = where(op, "tensor", i);
    detail::check_tensors(tensor_op.c_str(), params[i], grads[i], {});
    for (const auto& [name, list] : states) {
      const at::Tensor* state = &list[i];
      TORCH_CHECK(state->scalar_type() == at::kFloat, tensor_op, ": state argument '", name,
                  "' has dtype ", state->scalar_type(),
                  "; optimizer states are float32 whatever the parameter dtype");
      TORCH_CHECK(state->device() == params[i].device(), tensor_op, ": state argument '", name,
                  "' is on ", state->device(), " but 'param' is on ", params[i].device(),
                  "; put all tensors on one device");
      TORCH_CHECK(state->numel() == params[i].numel(), tensor_op, ": state argument '", name,
                  "' has ", state->numel(), " elements but 'param' has ", params[i].numel());
      detail::check_contiguous(tensor_op.c_str(), name, *state);
    }
    TORCH_CHECK(params[i].scalar_type() == params[0].scalar_type(), tensor_op, ": 'param' has dtype ",
                params[i].scalar_type(), " but tensor 0 has ", params[0].scalar_type(),
                "; one op call steps parameters of one dtype");
    TORCH_CHECK(params[i].device() == params[0].device(), tensor_op, ": 'param' is on ",
                params[i].device(), " but tensor 0 is on ", params[0].device(),
                "; one op call steps tensors of one device");
  }
  TORCH_CHECK(steps.scalar_type() == at::kLong && steps.device().is_cpu() && steps.dim() == 1 &&
                  steps.is_contiguous() && static_cast<size_t>(steps.numel()) == count,
              op, ": 'steps' must be a contiguous int64 CPU tensor of ", count,
              " counters (one per tensor); got ", steps.scalar_type(), " ", steps.sizes(), " on ",
              steps.device());
  const int64_t* counters = steps.data_ptr<int64_t>();
  for (size_t i = 0; i < count; ++i)
    TORCH_CHECK(counters[i] >= 0, op, ": steps[", i, "] is ", counters[i],
                "; counters start at 0 (a fresh tensor) and only the op advances them");
  if (beta_powers != nullptr)
    TORCH_CHECK(beta_powers->scalar_type() == at::kFloat && beta_powers->device().is_cpu() &&
                    beta_powers->dim() == 2 && beta_powers->size(0) == static_cast<int64_t>(groups) &&
                    beta_powers->size(1) == multi::kPowerColumns && beta_powers->is_contiguous(),
                op, ": 'beta_powers' must be a contiguous float32 CPU tensor [", groups, ", ",
                multi::kPowerColumns, "] (per param group: step, beta1^t, beta2^t; zeros when fresh); got ",
                beta_powers->scalar_type(), " ", beta_powers->sizes(), " on ", beta_powers->device());
}

void check_multi_groups(const char* op, const std::vector<multi::AdamGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const multi::AdamGroup& h = groups[g];
    // step 1 stands in for the counters, checked in check_multi_lists.
    detail::check_adam_hyperparameters(where(op, "param group", g).c_str(), 1, h.lr, h.beta1, h.beta2,
                                       h.eps, h.weight_decay, h.gnorm_scale);
  }
}

void check_multi_groups(const char* op, const std::vector<multi::AdemamixGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const multi::AdemamixGroup& h = groups[g];
    detail::check_ademamix_hyperparameters(where(op, "param group", g).c_str(), 1, h.lr, h.beta1,
                                           h.beta2, h.beta3, h.alpha, h.eps, h.weight_decay,
                                           h.gnorm_scale);
  }
}

void check_multi_groups(const char* op, const std::vector<multi::LionGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const multi::LionGroup& h = groups[g];
    detail::check_lion_hyperparameters(where(op, "param group", g).c_str(), h.lr, h.beta1, h.beta2,
                                       h.weight_decay, h.gnorm_scale);
  }
}

void check_multi_groups(const char* op, const std::vector<multi::MomentumGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const multi::MomentumGroup& h = groups[g];
    detail::check_momentum_hyperparameters(where(op, "param group", g).c_str(), 1, h.lr, h.momentum,
                                           h.weight_decay, h.gnorm_scale);
  }
}

void check_multi_groups(const char* op, const std::vector<multi::RmspropGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const multi::RmspropGroup& h = groups[g];
    detail::check_rmsprop_hyperparameters(where(op, "param group", g).c_str(), h.lr, h.alpha, h.eps,
                                          h.weight_decay, h.gnorm_scale);
  }
}

void check_multi_groups(const char* op, const std::vector<multi::AdagradGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const multi::AdagradGroup& h = groups[g];
    detail::check_adagrad_hyperparameters(where(op, "param group", g).c_str(), h.lr, h.eps,
                                          h.weight_decay, h.gnorm_scale);
  }
}

}  // namespace optdrift::checks
