// Fused GEMM instantiations for k = 5: MB in {1, 2, 4} x {fp16, bf16} (see gemm.cuh).
#include "gemm.cuh"

namespace kbit {
KBIT_INSTANTIATE_GEMM(5)
}  // namespace kbit
