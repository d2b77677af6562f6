// CPU multi-tensor ops (*_multi_step; the shared part is multi_tensor_ops.h): the chunk list of
// multi_tensor.h walked by a loop, each chunk applying its tensor's rule element by element
// exactly as the one-tensor ops do (apply_cpu.h), so a one-tensor list gives the one-tensor op's
// arithmetic. Chunks are independent (a chunk never spans two tensors, tensors own their buffers),
// so they run through at::parallel_for; the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <vector>

#include "../multi_tensor.h"
#include "../multi_tensor_ops.h"

namespace optdrift::cpu {
namespace {

// Below this many elements a step runs on the calling thread: waking the pool costs more than the
// work (a layout case of a few thousand elements).
constexpr int64_t kSerialBelow = 2 * multi::kChunkElements;

template <typename Rule, typename param_t>
void apply_chunk(const multi::TensorEntry<Rule>& entry, const multi::Chunk& chunk) {
  param_t* param_data = static_cast<param_t*>(entry.param);
  const param_t* grad_data = static_cast<const param_t*>(entry.grad);
  const int64_t end = chunk.start + chunk.length;
  for (int64_t i = chunk.start; i < end; ++i) {
    float value = static_cast<float>(param_data[i]);
    float state[Rule::kStates];
    for (int k = 0; k < Rule::kStates; ++k) state[k] = entry.states[k][i];
    entry.rule(value, static_cast<float>(grad_data[i]), state);
    param_data[i] = static_cast<param_t>(value);
    for (int k = 0; k < Rule::kStates; ++k) entry.states[k][i] = state[k];
  }
}

template <typename Rule, typename param_t>
void run_typed(const std::vector<multi::TensorEntry<Rule>>& entries,
               const std::vector<multi::Chunk>& chunks) {
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      apply_chunk<Rule, param_t>(entries[chunks[c].tensor], chunks[c]);
  };
  int64_t total = 0;
  for (const multi::Chunk& chunk : chunks) total += chunk.length;
  const int64_t count = static_cast<int64_t>(chunks.size());
  if (total < kSerialBelow) {
    body(0, count);
  } else {
    at::parallel_for(0, count, 1, body);
  }
}

struct CpuBackend {
  template <typename Rule>
  static void run(const char* op, const std::vector<multi::TensorEntry<Rule>>& entries,
                  const std::vector<multi::Chunk>& chunks, at::TensorList params) {
    TORCH_CHECK(params[0].device().is_cpu(), op, ": the CPU kernel got tensors on ",
                params[0].device());
    switch (params[0].scalar_type()) {
      case at::kFloat: return run_typed<Rule, float>(entries, chunks);
      case at::kHalf: return run_typed<Rule, c10::Half>(entries, chunks);
      case at::kBFloat16: return run_typed<Rule, c10::BFloat16>(entries, chunks);
      default: break;
    }
    TORCH_INTERNAL_ASSERT(false, op, ": parameter dtype ", params[0].scalar_type(), " passed the checks");
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(optdrift, CPU, m) {
  OPTDRIFT_REGISTER_MULTI_OPS(m, CpuBackend);
}

}  // namespace optdrift::cpu
