// Grouped GEMM instantiations for k = 4: passes of 8, 16, 32 (mma.sync) and 128 (wgmma) rows, x {Store, SiluGate},
// x {fp16, bf16} (moe_gemm.cuh).
#include "moe_gemm.cuh"

namespace kbit {
KBIT_INSTANTIATE_GROUPED_GEMM(4)
}  // namespace kbit
