// Warp-specialized GEMM instantiations for k = 5: 32, 64 and 128 tokens per tile x {fp16, bf16} (gemm_ws.cuh).
#include "gemm_ws.cuh"

namespace kbit {
KBIT_INSTANTIATE_GEMM_WS(5)
}  // namespace kbit
