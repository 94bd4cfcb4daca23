// Fused GEMM instantiations for k = 4: MB in {1, 2, 4} x {fp16, bf16} (see gemm.cuh).
#include "gemm.cuh"

namespace kbit {
KBIT_INSTANTIATE_GEMM(4)
}  // namespace kbit
