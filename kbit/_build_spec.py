"""What the CUDA extension is built from: its sources and compiler flags.

One list for both builds: ``kbit/_build.py`` (the just-in-time build through torch) and ``scripts/compile_check.sh``
(nvcc alone, no GPU, no torch), which reads it with ``python -c``. No imports, so reading it needs nothing but Python.
"""

# In kbit/csrc. The .cu files are split so that ninja compiles them in parallel (one GEMM file per bit width).
BINDING = "binding.cpp"  # the only source that includes PyTorch's headers
CUDA_SOURCES = ["quantize.cu", "repack.cu", "gemm.cu", "gemm_k2.cu", "gemm_k3.cu", "gemm_k4.cu", "gemm_k5.cu",
                "moe_route.cu", "moe_gemm.cu", "moe_gemm_k2.cu", "moe_gemm_k3.cu", "moe_gemm_k4.cu", "moe_gemm_k5.cu",
                "gemm_ws_k2.cu", "gemm_ws_k3.cu", "gemm_ws_k4.cu", "gemm_ws_k5.cu"]
CXX_FLAGS = ["-O3", "-std=c++17"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
