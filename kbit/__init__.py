"""kbit: 2- to 5-bit codebook weight quantization with fused dequantize + GEMM CUDA kernels.

    qw = kbit.quantize(W, bits=4)          # W: [out_features, in_features] -> QuantizedWeight
    W_hat = kbit.dequantize(qw)            # [out_features, in_features]
    y = kbit.matmul(x, qw, bias=None)      # x: [..., in_features] -> [..., out_features]
    layer = kbit.KbitLinear.from_linear(linear, bits=4)
    kbit.quantize_model(model, bits=4)     # swaps eligible nn.Linear layers in place
    kbit.prepare(model)                 # GEMM layouts on the GPU now (before torch.compile / CUDA graphs)
    kbit.fuse_projections(model, enabled=False)  # q/k/v and gate/up: one GEMM launch each (on by default)

    # transformers: quantize while loading, save_pretrained / from_pretrained round-trip
    model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=kbit.KbitConfig(bits=4))

The seeds' functional API on raw tensors (quantize_kbit, kbit_gemm, ...) is ``kbit.functional``.
"""

from . import ops  # noqa: F401  (registers the torch.library ops)
from .weight import PrecisionLoss, PrecisionWarning, QuantizedWeight, dequantize, matmul, quantize
from .nn import KbitLinear, prepare, quantize_model, quantized_fraction
from .fusion import fuse_projections
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
    "quantized_fraction", "prepare", "fuse_projections",
    "DequantizedWeight", "KbitConfig", "save_quantized", "PrecisionWarning", "PrecisionLoss",
]
