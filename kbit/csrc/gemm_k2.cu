// Fused GEMM instantiations for k = 2: MB in {1, 2, 4} x {fp16, bf16} (see gemm.cuh).
#include "gemm.cuh"

namespace kbit {
KBIT_INSTANTIATE_GEMM(2)
}  // namespace kbit
