// The 8-bit blockwise states' layout constants, shared by the kernels (quant_map.h) and the
// argument checks (blockwise8_checks_impl.h). Kept apart from quant_map.h so that the checks do
// not depend on the update math: a change to optimizer_math.h or quant_map.h recompiles only the
// kernels, not checks.cpp.
#pragma once

namespace optdrift::blockwise8 {

constexpr int kBlockSize = 256;  // elements per absmax block (the last block may be partial)
constexpr int kMapSize = 256;    // values in a quantization map (one per uint8 code)

}  // namespace optdrift::blockwise8
