// Per-element update rules of the bundled 32-bit optimizers: the one place the math lives.
//
// cpu/*.cpp and cuda/*.cu both apply these rules; they differ only in how they walk the tensors.
// A rule is a small trivially-copyable struct of float32 scalars with
//     operator()(float& param, float raw_grad, float (&state)[kStates]) const
// that reads the parameter (already widened to float32 from fp32/fp16/bf16), the raw gradient
// (before gnorm_scale) and the float32 states, and updates param and states in place. All
// arithmetic is float32. Scalars that depend only on the step (bias corrections, 1 - lr*wd) are
// computed once on the host in double by the make_*_rule functions below and rounded to float
// once, so the hot loop does no pow() and no division beyond the update rule itself.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define OPTDRIFT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define OPTDRIFT_HOST_DEVICE inline
#endif

namespace optdrift {

// Adam with decoupled weight decay (Loshchilov & Hutter, arXiv:1711.05101, Algorithm 2), in the
// form torch.optim.AdamW documents: the decay and the gradient-based update are both taken from
// the previous parameter, p_t = p_{t-1} (1 - lr wd) - lr/(1 - b1^t) * m_t / (sqrt(v_t)/sqrt(1 - b2^t) + eps).
struct AdamRule {
  static constexpr int kStates = 2;  // exp_avg, exp_avg_sq
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float decay_factor;                // 1 - lr * weight_decay
  float step_size;                   // lr / (1 - beta1^step)
  float inv_sqrt_bias_correction2;   // 1 / sqrt(1 - beta2^step)
  float gnorm_scale;
  bool skip_zeros;

  OPTDRIFT_HOST_DEVICE void operator()(float& param, float raw_grad, float (&state)[2]) const {
    // skip_zeros: an element whose gradient is exactly zero is left untouched, decay included.
    if (skip_zeros && raw_grad == 0.0f) return;
    const float grad = raw_grad * gnorm_scale;
    float& exp_avg = state[0];
    float& exp_avg_sq = state[1];
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad;
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * (grad * grad);
    const float denom = sqrtf(exp_avg_sq) * inv_sqrt_bias_correction2 + eps;
    // Decay before the update: both terms from the previous parameter (PR-2040 ordering).
    param = param * decay_factor - step_size * (exp_avg / denom);
  }
};

// AdEMAMix (Pagliardini et al., arXiv:2409.03137, Algorithm 1): a fast EMA m1 (beta1, bias
// corrected), a slow EMA m2 (beta3, not bias corrected) mixed in with weight alpha, the second
// moment nu (beta2, bias corrected), and decoupled decay from the previous parameter as in AdamW.
// alpha and beta3 are taken as given each step; their warm-up schedulers are the caller's.
struct AdemamixRule {
  static constexpr int kStates = 3;  // exp_avg_fast, exp_avg_slow, exp_avg_sq
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float beta3, one_minus_beta3;
  float alpha;
  float eps;
  float lr;
  float decay_factor;                // 1 - lr * weight_decay
  float inv_bias_correction1;        // 1 / (1 - beta1^step)
  float inv_sqrt_bias_correction2;   // 1 / sqrt(1 - beta2^step)
  float gnorm_scale;

  OPTDRIFT_HOST_DEVICE void operator()(float& param, float raw_grad, float (&state)[3]) const {
    const float grad = raw_grad * gnorm_scale;
    float& exp_avg_fast = state[0];
    float& exp_avg_slow = state[1];
    float& exp_avg_sq = state[2];
    exp_avg_fast = beta1 * exp_avg_fast + one_minus_beta1 * grad;
    exp_avg_slow = beta3 * exp_avg_slow + one_minus_beta3 * grad;
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * (grad * grad);
    const float denom = sqrtf(exp_avg_sq) * inv_sqrt_bias_correction2 + eps;
    const float mixed = exp_avg_fast * inv_bias_correction1 + alpha * exp_avg_slow;
    param = param * decay_factor - lr * (mixed / denom);
  }
};

// Lion (Chen et al., arXiv:2302.06675, Algorithm 2): the sign of an interpolation c between the
// momentum and the gradient, decoupled decay from the previous parameter, then the momentum update.
struct LionRule {
  static constexpr int kStates = 1;  // exp_avg
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float lr;
  float decay_factor;                // 1 - lr * weight_decay
  float gnorm_scale;

  OPTDRIFT_HOST_DEVICE void operator()(float& param, float raw_grad, float (&state)[1]) const {
    const float grad = raw_grad * gnorm_scale;
    float& exp_avg = state[0];
    const float interpolated = beta1 * exp_avg + one_minus_beta1 * grad;
    // sign() that keeps a NaN a NaN, so a poisoned gradient shows up in the parameter.
    const float direction =
        interpolated > 0.0f ? 1.0f : (interpolated < 0.0f ? -1.0f : interpolated);
    param = param * decay_factor - lr * direction;
    exp_avg = beta2 * exp_avg + one_minus_beta2 * grad;
  }
};

// torch.optim.SGD with momentum (dampening 0, nesterov off), coupled L2 decay g <- g + wd p.
// On the first step the buffer is the gradient itself, as torch does.
struct MomentumRule {
  static constexpr int kStates = 1;  // momentum_buffer
  float lr;
  float momentum;
  float weight_decay;
  float gnorm_scale;
  bool first_step;

  OPTDRIFT_HOST_DEVICE void operator()(float& param, float raw_grad, float (&state)[1]) const {
    const float grad = raw_grad * gnorm_scale + weight_decay * param;
    float& buffer = state[0];
    buffer = first_step ? grad : momentum * buffer + grad;
    param = param - lr * buffer;
  }
};

// torch.optim.RMSprop, not centered, no momentum: eps is added after the square root.
struct RmspropRule {
  static constexpr int kStates = 1;  // square_avg
  float lr;
  float alpha, one_minus_alpha;
  float eps;
  float weight_decay;
  float gnorm_scale;

  OPTDRIFT_HOST_DEVICE void operator()(float& param, float raw_grad, float (&state)[1]) const {
    const float grad = raw_grad * gnorm_scale + weight_decay * param;
    float& square_avg = state[0];
    square_avg = alpha * square_avg + one_minus_alpha * (grad * grad);
    param = param - lr * (grad / (sqrtf(square_avg) + eps));
  }
};

// torch.optim.Adagrad with lr_decay 0 and initial_accumulator_value 0.
struct AdagradRule {
  static constexpr int kStates = 1;  // state_sum
  float lr;
  float eps;
  float weight_decay;
  float gnorm_scale;

  OPTDRIFT_HOST_DEVICE void operator()(float& param, float raw_grad, float (&state)[1]) const {
    const float grad = raw_grad * gnorm_scale + weight_decay * param;
    float& state_sum = state[0];
    state_sum = state_sum + grad * grad;
    param = param - lr * (grad / (sqrtf(state_sum) + eps));
  }
};

// ---- host-side construction: step-dependent scalars in double, rounded to float once ----

inline AdamRule make_adam_rule(int64_t step, double lr, double beta1, double beta2, double eps,
                               double weight_decay, double gnorm_scale, bool skip_zeros) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamRule rule;
  rule.beta1 = static_cast<float>(beta1);
  rule.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  rule.beta2 = static_cast<float>(beta2);
  rule.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  rule.eps = static_cast<float>(eps);
  rule.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  rule.step_size = static_cast<float>(lr / bias_correction1);
  rule.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  rule.gnorm_scale = static_cast<float>(gnorm_scale);
  rule.skip_zeros = skip_zeros;
  return rule;
}

inline AdemamixRule make_ademamix_rule(int64_t step, double lr, double beta1, double beta2,
                                       double beta3, double alpha, double eps,
                                       double weight_decay, double gnorm_scale) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdemamixRule rule;
  rule.beta1 = static_cast<float>(beta1);
  rule.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  rule.beta2 = static_cast<float>(beta2);
  rule.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  rule.beta3 = static_cast<float>(beta3);
  rule.one_minus_beta3 = static_cast<float>(1.0 - beta3);
  rule.alpha = static_cast<float>(alpha);
  rule.eps = static_cast<float>(eps);
  rule.lr = static_cast<float>(lr);
  rule.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  rule.inv_bias_correction1 = static_cast<float>(1.0 / bias_correction1);
  rule.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  rule.gnorm_scale = static_cast<float>(gnorm_scale);
  return rule;
}

inline LionRule make_lion_rule(double lr, double beta1, double beta2, double weight_decay,
                               double gnorm_scale) {
  LionRule rule;
  rule.beta1 = static_cast<float>(beta1);
  rule.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  rule.beta2 = static_cast<float>(beta2);
  rule.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  rule.lr = static_cast<float>(lr);
  rule.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  rule.gnorm_scale = static_cast<float>(gnorm_scale);
  return rule;
}

inline MomentumRule make_momentum_rule(int64_t step, double lr, double momentum,
                                       double weight_decay, double gnorm_scale) {
  MomentumRule rule;
  rule.lr = static_cast<float>(lr);
  rule.momentum = static_cast<float>(momentum);
  rule.weight_decay = static_cast<float>(weight_decay);
  rule.gnorm_scale = static_cast<float>(gnorm_scale);
  rule.first_step = step == 1;
  return rule;
}

inline RmspropRule make_rmsprop_rule(double lr, double alpha, double eps, double weight_decay,
                                     double gnorm_scale) {
  RmspropRule rule;
  rule.lr = static_cast<float>(lr);
  rule.alpha = static_cast<float>(alpha);
  rule.one_minus_alpha = static_cast<float>(1.0 - alpha);
  rule.eps = static_cast<float>(eps);
  rule.weight_decay = static_cast<float>(weight_decay);
  rule.gnorm_scale = static_cast<float>(gnorm_scale);
  return rule;
}

inline AdagradRule make_adagrad_rule(double lr, double eps, double weight_decay,
                                     double gnorm_scale) {
  AdagradRule rule;
  rule.lr = static_cast<float>(lr);
  rule.eps = static_cast<float>(eps);
  rule.weight_decay = static_cast<float>(weight_decay);
  rule.gnorm_scale = static_cast<float>(gnorm_scale);
  return rule;
}

}  // namespace optdrift
