// optdrift_od2::observe_rows: one observed arena's od2 contribution for one step, in one pass.
//
// The fast engine (worker/engine/fast.py) lays many cases' parameters and states out as padded
// [rows, width] arenas and needs, every step, each case's non-finite count and its two od2 lanes.
// As torch ops that is about twenty int64 kernels per arena, each reading and writing the whole
// arena widened to 8 bytes an element; this op reads each element once and adds its row's three
// sums into the case's counters:
//
//   counts[0, case_index[r]] += number of non-finite elements of row r (all `width` columns)
//   counts[1, case_index[r]] += lane_a of row r's first lengths[r] elements
//   counts[2, case_index[r]] += lane_b of the same elements
//
// with the lanes of worker/engine/digest.py, element j salted with salt_slot(j). Every sum is
// modulo 2^64, so the result equals digest.lanes' bit for bit in any order (tests/test_od2_op.py).
// The CPU implementation is below; the CUDA one is od2_cuda.cu.
#include <torch/library.h>

#include <algorithm>

#include "od2.h"
#include "od2_checks.h"

namespace optdrift_od2 {
namespace {

template <typename bits_t>
void observe_rows_typed(const at::Tensor& data, const int64_t* lengths, uint64_t slot_term,
                        const int64_t* case_index, int64_t cases, uint64_t exponent_mask,
                        uint64_t* counts) {
  const auto rows = data.size(0), width = data.size(1);
  const auto* all = static_cast<const bits_t*>(data.const_data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = case_index[r];
    TORCH_CHECK(c >= 0 && c < cases, "optdrift_od2::observe_rows: case_index[", r, "] = ", c,
                " is outside the ", cases, " cases of 'counts'");
    const bits_t* row = all + r * width;
    const int64_t valid = std::clamp<int64_t>(lengths[r], 0, width);
    RowSums sums;
    for (int64_t j = 0; j < width; ++j) {
      const uint64_t x = static_cast<uint64_t>(row[j]);
      sums.nonfinite += nonfinite(x, exponent_mask) ? 1 : 0;
      if (j < valid) add_lanes(sums, x, salt(slot_term, static_cast<uint64_t>(j)));
    }
    counts[c] += sums.nonfinite;
    counts[cases + c] += sums.lane_a;
    counts[2 * cases + c] += sums.lane_b;
  }
}

void observe_rows_cpu(const at::Tensor& data, const at::Tensor& lengths, int64_t slot,
                      const at::Tensor& case_index, const at::Tensor& counts) {
  check_observe_rows(data, lengths, slot, case_index, counts);
  const uint64_t slot_term = (static_cast<uint64_t>(slot) + 1) * kSlot;
  const uint64_t mask = exponent_mask(data.scalar_type());
  auto* out = reinterpret_cast<uint64_t*>(counts.data_ptr<int64_t>());
  const auto* lens = lengths.const_data_ptr<int64_t>();
  const auto* index = case_index.const_data_ptr<int64_t>();
  const auto cases = counts.size(1);
  switch (data.element_size()) {
    case 1: observe_rows_typed<uint8_t>(data, lens, slot_term, index, cases, mask, out); break;
    case 2: observe_rows_typed<uint16_t>(data, lens, slot_term, index, cases, mask, out); break;
    case 4: observe_rows_typed<uint32_t>(data, lens, slot_term, index, cases, mask, out); break;
    default: observe_rows_typed<uint64_t>(data, lens, slot_term, index, cases, mask, out); break;
  }
}

}  // namespace

TORCH_LIBRARY(optdrift_od2, m) {
  m.def("observe_rows(Tensor data, Tensor lengths, int slot, Tensor case_index, Tensor(a!) counts) -> ()");
}

TORCH_LIBRARY_IMPL(optdrift_od2, CPU, m) { m.impl("observe_rows", &observe_rows_cpu); }

}  // namespace optdrift_od2
