"""kbit: k-bit (K = 2..5) codebook weight quantization with fused dequantize + GEMM CUDA kernels.

    qw = kbit.quantize(W, k=4)          # W: [N, K] -> QuantizedWeight
    W_hat = kbit.dequantize(qw)         # [N, K]
    y = kbit.matmul(x, qw, bias=None)   # x: [..., K] -> [..., N]
    layer = kbit.KbitLinear.from_linear(linear, k=4)
    kbit.quantize_model(model, k=4)     # swaps eligible nn.Linear layers in place
    kbit.prepare(model)                 # GEMM layouts on the GPU now (before torch.compile / CUDA graphs)
"""

from . import ops  # noqa: F401  (registers the torch.library ops)
from .formats import (
    create_normal_float_codebook,
    decode_absmax_e4m4,
    encode_absmax_e4m4,
)
from .functional import dequantize_kbit, kbit_gemm, quantize_kbit, repack_for_gemm
from .weight import PrecisionLoss, PrecisionWarning, QuantizedWeight, dequantize, matmul, quantize
from .nn import KbitLinear, prepare, quantize_model, quantized_fraction
from .moe import KbitExperts
from .hf import load_quantized, save_quantized  # transformers is imported only when used

__version__ = "0.1.0"

__all__ = [
    "QuantizedWeight", "quantize", "dequantize", "matmul", "KbitLinear", "KbitExperts", "quantize_model",
    "quantized_fraction", "prepare",
    "save_quantized", "load_quantized", "PrecisionWarning", "PrecisionLoss",
    "create_normal_float_codebook", "encode_absmax_e4m4", "decode_absmax_e4m4",
    "quantize_kbit", "dequantize_kbit", "repack_for_gemm", "kbit_gemm",
]
