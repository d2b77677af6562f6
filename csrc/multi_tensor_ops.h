// The six multi-tensor ops (schemas in ops.cpp), written once over a backend: the checks, the
// lists as raw pointers, the param groups' hyperparameters, the shared-state step of
// multi_tensor.h (counters, beta powers, rules) and the chunk list; then
// `Backend::run(op, entries, chunks, params)` walks the chunks (cpu/multi_tensor.cpp: a loop over
// the chunks; cuda/multi_tensor.cu: one kernel launch, one block per chunk). No TORCH_CHECK here
// formats a number (nvcc compiles this; see checks.h): every check is in multi_tensor_checks.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

#include <vector>

#include "multi_tensor.h"
#include "multi_tensor_checks.h"

namespace optdrift::multi {

// The checked lists as raw pointers; `beta_powers` may be nullptr (an op without powers).
inline RawLists raw_lists(at::TensorList params, at::TensorList grads,
                          const std::vector<checks::NamedTensorList>& states,
                          const at::Tensor& steps, const at::Tensor* beta_powers,
                          at::IntArrayRef group_of) {
  RawLists lists;
  for (size_t i = 0; i < params.size(); ++i) {
    lists.params.push_back(params[i].data_ptr());
    lists.grads.push_back(grads[i].data_ptr());
    lists.numels.push_back(params[i].numel());
    lists.group_of.push_back(group_of[i]);
    for (size_t k = 0; k < states.size(); ++k)
      lists.states[k].push_back(states[k].second[i].data_ptr<float>());
  }
  lists.steps = steps.data_ptr<int64_t>();
  lists.beta_powers = beta_powers != nullptr ? beta_powers->data_ptr<float>() : nullptr;
  return lists;
}

template <typename Backend, typename Group>
void run_multi(const char* op, at::TensorList params, at::TensorList grads,
               const std::vector<checks::NamedTensorList>& states, const at::Tensor& steps,
               const at::Tensor* beta_powers, at::IntArrayRef group_of,
               const std::vector<Group>& groups) {
  checks::check_multi_groups(op, groups);
  if (params.empty()) return;
  const RawLists lists = raw_lists(params, grads, states, steps, beta_powers, group_of);
  const auto entries = plan_step(lists, groups);
  Backend::run(op, entries, make_chunks(lists.numels), params);
}

template <typename Backend>
struct MultiOps {
  static void adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, const at::Tensor& steps,
                   const at::Tensor& beta_powers, at::IntArrayRef group_of, at::ArrayRef<double> lr,
                   at::ArrayRef<double> beta1, at::ArrayRef<double> beta2, at::ArrayRef<double> eps,
                   at::ArrayRef<double> weight_decay, at::ArrayRef<double> gnorm_scale,
                   const c10::List<bool>& skip_zeros) {
    const char* op = "optdrift::adam_multi_step";
    const std::vector<checks::NamedTensorList> states{{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}};
    checks::check_multi_lists(op, params, grads, states, steps, &beta_powers, group_of,
                              {{"lr", lr.size()}, {"beta1", beta1.size()}, {"beta2", beta2.size()},
                               {"eps", eps.size()}, {"weight_decay", weight_decay.size()},
                               {"gnorm_scale", gnorm_scale.size()}, {"skip_zeros", skip_zeros.size()}});
    std::vector<AdamGroup> groups;
    for (size_t g = 0; g < lr.size(); ++g)
      groups.push_back(AdamGroup{lr[g], beta1[g], beta2[g], eps[g], weight_decay[g], gnorm_scale[g],
                                 skip_zeros.get(g)});
    run_multi<Backend>(op, params, grads, states, steps, &beta_powers, group_of, groups);
  }

  static void ademamix(at::TensorList params, at::TensorList grads, at::TensorList exp_avg_fasts,
                       at::TensorList exp_avg_slows, at::TensorList exp_avg_sqs,
                       const at::Tensor& steps, const at::Tensor& beta_powers,
                       at::IntArrayRef group_of, at::ArrayRef<double> lr, at::ArrayRef<double> beta1,
                       at::ArrayRef<double> beta2, at::ArrayRef<double> beta3,
                       at::ArrayRef<double> alpha, at::ArrayRef<double> eps,
                       at::ArrayRef<double> weight_decay, at::ArrayRef<double> gnorm_scale) {
    const char* op = "optdrift::ademamix_multi_step";
    const std::vector<checks::NamedTensorList> states{
        {"exp_avg_fasts", exp_avg_fasts}, {"exp_avg_slows", exp_avg_slows}, {"exp_avg_sqs", exp_avg_sqs}};
    checks::check_multi_lists(op, params, grads, states, steps, &beta_powers, group_of,
                              {{"lr", lr.size()}, {"beta1", beta1.size()}, {"beta2", beta2.size()},
                               {"beta3", beta3.size()}, {"alpha", alpha.size()}, {"eps", eps.size()},
                               {"weight_decay", weight_decay.size()},
                               {"gnorm_scale", gnorm_scale.size()}});
    std::vector<AdemamixGroup> groups;
    for (size_t g = 0; g < lr.size(); ++g)
      groups.push_back(AdemamixGroup{lr[g], beta1[g], beta2[g], beta3[g], alpha[g], eps[g],
                                     weight_decay[g], gnorm_scale[g]});
    run_multi<Backend>(op, params, grads, states, steps, &beta_powers, group_of, groups);
  }

  static void lion(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   const at::Tensor& steps, at::IntArrayRef group_of, at::ArrayRef<double> lr,
                   at::ArrayRef<double> beta1, at::ArrayRef<double> beta2,
                   at::ArrayRef<double> weight_decay, at::ArrayRef<double> gnorm_scale) {
    const char* op = "optdrift::lion_multi_step";
    const std::vector<checks::NamedTensorList> states{{"exp_avgs", exp_avgs}};
    checks::check_multi_lists(op, params, grads, states, steps, nullptr, group_of,
                              {{"lr", lr.size()}, {"beta1", beta1.size()}, {"beta2", beta2.size()},
                               {"weight_decay", weight_decay.size()},
                               {"gnorm_scale", gnorm_scale.size()}});
    std::vector<LionGroup> groups;
    for (size_t g = 0; g < lr.size(); ++g)
      groups.push_back(LionGroup{lr[g], beta1[g], beta2[g], weight_decay[g], gnorm_scale[g]});
    run_multi<Backend>(op, params, grads, states, steps, nullptr, group_of, groups);
  }

  static void momentum(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                       const at::Tensor& steps, at::IntArrayRef group_of, at::ArrayRef<double> lr,
                       at::ArrayRef<double> momentum, at::ArrayRef<double> weight_decay,
                       at::ArrayRef<double> gnorm_scale) {
    const char* op = "optdrift::momentum_multi_step";
    const std::vector<checks::NamedTensorList> states{{"momentum_buffers", momentum_buffers}};
    checks::check_multi_lists(op, params, grads, states, steps, nullptr, group_of,
                              {{"lr", lr.size()}, {"momentum", momentum.size()},
                               {"weight_decay", weight_decay.size()},
                               {"gnorm_scale", gnorm_scale.size()}});
    std::vector<MomentumGroup> groups;
    for (size_t g = 0; g < lr.size(); ++g)
      groups.push_back(MomentumGroup{lr[g], momentum[g], weight_decay[g], gnorm_scale[g]});
    run_multi<Backend>(op, params, grads, states, steps, nullptr, group_of, groups);
  }

  static void rmsprop(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                      const at::Tensor& steps, at::IntArrayRef group_of, at::ArrayRef<double> lr,
                      at::ArrayRef<double> alpha, at::ArrayRef<double> eps,
                      at::ArrayRef<double> weight_decay, at::ArrayRef<double> gnorm_scale) {
    const char* op = "optdrift::rmsprop_multi_step";
    const std::vector<checks::NamedTensorList> states{{"square_avgs", square_avgs}};
    checks::check_multi_lists(op, params, grads, states, steps, nullptr, group_of,
                              {{"lr", lr.size()}, {"alpha", alpha.size()}, {"eps", eps.size()},
                               {"weight_decay", weight_decay.size()},
                               {"gnorm_scale", gnorm_scale.size()}});
    std::vector<RmspropGroup> groups;
    for (size_t g = 0; g < lr.size(); ++g)
      groups.push_back(RmspropGroup{lr[g], alpha[g], eps[g], weight_decay[g], gnorm_scale[g]});
    run_multi<Backend>(op, params, grads, states, steps, nullptr, group_of, groups);
  }

  static void adagrad(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                      const at::Tensor& steps, at::IntArrayRef group_of, at::ArrayRef<double> lr,
                      at::ArrayRef<double> eps, at::ArrayRef<double> weight_decay,
                      at::ArrayRef<double> gnorm_scale) {
    const char* op = "optdrift::adagrad_multi_step";
    const std::vector<checks::NamedTensorList> states{{"state_sums", state_sums}};
    checks::check_multi_lists(op, params, grads, states, steps, nullptr, group_of,
                              {{"lr", lr.size()}, {"eps", eps.size()},
                               {"weight_decay", weight_decay.size()},
                               {"gnorm_scale", gnorm_scale.size()}});
    std::vector<AdagradGroup> groups;
    for (size_t g = 0; g < lr.size(); ++g)
      groups.push_back(AdagradGroup{lr[g], eps[g], weight_decay[g], gnorm_scale[g]});
    run_multi<Backend>(op, params, grads, states, steps, nullptr, group_of, groups);
  }
};

}  // namespace optdrift::multi

// Every op registered for one dispatch key with its backend.
#define OPTDRIFT_REGISTER_MULTI_OPS(m, Backend)                              \
  do {                                                                        \
    (m).impl("adam_multi_step", &::optdrift::multi::MultiOps<Backend>::adam); \
    (m).impl("ademamix_multi_step", &::optdrift::multi::MultiOps<Backend>::ademamix); \
    (m).impl("lion_multi_step", &::optdrift::multi::MultiOps<Backend>::lion); \
    (m).impl("momentum_multi_step", &::optdrift::multi::MultiOps<Backend>::momentum); \
    (m).impl("rmsprop_multi_step", &::optdrift::multi::MultiOps<Backend>::rmsprop); \
    (m).impl("adagrad_multi_step", &::optdrift::multi::MultiOps<Backend>::adagrad); \
  } while (0)
