// Fused GEMM instantiations for k = 2: mma.sync MB in {1, 2, 4}, wgmma MB in {8, 16}, x {fp16, bf16} (gemm.cuh).
#include "gemm.cuh"

namespace kbit {
KBIT_INSTANTIATE_GEMM(2)
}  // namespace kbit
