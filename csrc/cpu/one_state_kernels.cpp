// CPU kernels of the 1-state optimizers, Lion, Momentum, RMSprop and Adagrad: their rules applied
// element by element (the ops and their checks: one_state.cpp).
#include "../optimizer_math.h"
#include "apply_cpu.h"
#include "kernels_cpu.h"

namespace optdrift::cpu::kernels {

void lion_step(const ElementwiseArgs& args, double lr, double beta1, double beta2,
               double weight_decay, double gnorm_scale) {
  apply_rule("lion_step_cpu", make_lion_rule(lr, beta1, beta2, weight_decay, gnorm_scale), args);
}

void momentum_step(const ElementwiseArgs& args, int64_t step, double lr, double momentum,
                   double weight_decay, double gnorm_scale) {
  apply_rule("momentum_step_cpu", make_momentum_rule(step, lr, momentum, weight_decay, gnorm_scale),
             args);
}

void rmsprop_step(const ElementwiseArgs& args, double lr, double alpha, double eps,
                  double weight_decay, double gnorm_scale) {
  apply_rule("rmsprop_step_cpu", make_rmsprop_rule(lr, alpha, eps, weight_decay, gnorm_scale),
             args);
}

void adagrad_step(const ElementwiseArgs& args, double lr, double eps, double weight_decay,
                  double gnorm_scale) {
  apply_rule("adagrad_step_cpu", make_adagrad_rule(lr, eps, weight_decay, gnorm_scale), args);
}

}  // namespace optdrift::cpu::kernels
