"""kbit: k-bit (K = 2..5) codebook weight quantization with fused dequantize + GEMM CUDA kernels.

    qw = kbit.quantize(W, k=4)          # W: [N, K] -> QuantizedWeight
    W_hat = kbit.dequantize(qw)         # [N, K]
    y = kbit.matmul(x, qw, bias=None)   # x: [..., K] -> [..., N]
    layer = kbit.KbitLinear.from_linear(linear, k=4)
    kbit.quantize_model(model, k=4)     # swaps eligible nn.Linear layers in place
    kbit.prepare(model)                 # GEMM layouts on the GPU now (before torch.compile / CUDA graphs)

    # transformers: quantize while loading, save_pretrained / from_pretrained round-trip
    model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=kbit.KbitConfig(bits=4))
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
from .dequantized_weight import DequantizedWeight
from .hf import save_quantized  # transformers is imported only when used
from . import _transformers_hook

__version__ = "0.1.0"

_transformers_hook.install()  # from_pretrained knows quant_method "kbit" once transformers' quantizers load


def __getattr__(name):
    # These import transformers (KbitConfig) or peft (lora): only when asked for.
    if name == "KbitConfig":
        from .hf_quantizer import KbitConfig

        return KbitConfig
    if name == "lora":
        import importlib

        return importlib.import_module(".lora", __name__)
    raise AttributeError(f"module 'kbit' has no attribute {name!r}")

__all__ = [
    "QuantizedWeight", "quantize", "dequantize", "matmul", "KbitLinear", "KbitExperts", "quantize_model",
    "quantized_fraction", "prepare",
    "DequantizedWeight", "KbitConfig", "save_quantized", "PrecisionWarning", "PrecisionLoss",
    "create_normal_float_codebook", "encode_absmax_e4m4", "decode_absmax_e4m4",
    "quantize_kbit", "dequantize_kbit", "repack_for_gemm", "kbit_gemm",
]
