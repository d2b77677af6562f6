// CPU kernels of the 2-state (and 3-state) optimizers, Adam and AdEMAMix: their rules applied
// element by element (the ops and their checks: two_state.cpp).
#include "../optimizer_math.h"
#include "apply_cpu.h"
#include "kernels_cpu.h"

namespace optdrift::cpu::kernels {

void adam_step(const ElementwiseArgs& args, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, double gnorm_scale, bool skip_zeros) {
  const AdamRule rule =
      make_adam_rule(step, lr, beta1, beta2, eps, weight_decay, gnorm_scale, skip_zeros);
  apply_rule("adam_step_cpu", rule, args);
}

void ademamix_step(const ElementwiseArgs& args, int64_t step, double lr, double beta1,
                   double beta2, double beta3, double alpha, double eps, double weight_decay,
                   double gnorm_scale) {
  const AdemamixRule rule = make_ademamix_rule(step, lr, beta1, beta2, beta3, alpha, eps,
                                               weight_decay, gnorm_scale);
  apply_rule("ademamix_step_cpu", rule, args);
}

}  // namespace optdrift::cpu::kernels
