// Argument checks and dtype facts of optdrift_od2::observe_rows, shared by both devices.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace optdrift_od2 {

// The exponent bits of a float dtype (see od2.h nonfinite); 0 for integer and bool dtypes.
inline uint64_t exponent_mask(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Half: return 0x7C00ULL;
    case c10::ScalarType::BFloat16: return 0x7F80ULL;
    case c10::ScalarType::Float: return 0x7F800000ULL;
    case c10::ScalarType::Double: return 0x7FF0000000000000ULL;
    default: return 0;
  }
}

inline void check_observe_rows(const at::Tensor& data, const at::Tensor& lengths, int64_t slot,
                               const at::Tensor& case_index, const at::Tensor& counts) {
  constexpr const char* op = "optdrift_od2::observe_rows";
  TORCH_CHECK(data.dim() == 2, op, ": 'data' must be [rows, width], got ", data.dim(), " dimensions");
  TORCH_CHECK(data.is_contiguous(), op, ": 'data' must be contiguous");
  const auto size = data.element_size();
  TORCH_CHECK(size == 1 || size == 2 || size == 4 || size == 8, op, ": cannot digest dtype ",
              data.scalar_type(), " (elements of ", size, " bytes; supported: 1, 2, 4 or 8)");
  TORCH_CHECK(!data.is_complex(), op, ": cannot digest complex dtype ", data.scalar_type());
  TORCH_CHECK(slot >= 0, op, ": 'slot' must be >= 0, got ", slot);
  const auto rows = data.size(0);
  for (const auto* named : {&lengths, &case_index}) {
    const char* name = named == &lengths ? "lengths" : "case_index";
    TORCH_CHECK(named->scalar_type() == c10::ScalarType::Long && named->dim() == 1 &&
                    named->size(0) == rows && named->is_contiguous(),
                op, ": '", name, "' must be a contiguous int64 vector of ", rows, " (one per row)");
    TORCH_CHECK(named->device() == data.device(), op, ": '", name, "' is on ", named->device(),
                " but 'data' is on ", data.device());
  }
  TORCH_CHECK(counts.scalar_type() == c10::ScalarType::Long && counts.dim() == 2 &&
                  counts.size(0) == 3 && counts.is_contiguous(),
              op, ": 'counts' must be a contiguous int64 [3, cases] tensor");
  TORCH_CHECK(counts.device() == data.device(), op, ": 'counts' is on ", counts.device(),
              " but 'data' is on ", data.device());
}

}  // namespace optdrift_od2
