"""ncu target: the GEMM cells where the 32-4096-token targets are missed (docs/PERFORMANCE.md), one launch each of
the planner's fused choice (``kbit.ops.gemm``) and, at k = 4, cuBLAS ``F.linear`` on the same random weight, fp16,
each in an NVTX range <K_in>to<N_out>_m<M>_k<bits>_<kbit|cublas>, after three warm-up calls.

    ncu --clock-control none --nvtx --nvtx-include "regex:.*_m[0-9]+_.*/" --section SpeedOfLight \\
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section LaunchStats \\
        --section MemoryWorkloadAnalysis -o prefill python benchmarks/ncu_prefill_cells.py
    ncu --import prefill.ncu-rep --page raw --csv > raw.csv

(benchmarks/results/ncu_prefill_NVIDIA_H200.json holds one such run.)
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kbit  # noqa: E402
import kbit.ops as ops  # noqa: E402
from kbit.weight import padded_in_features  # noqa: E402

# (K_in, N_out, M, bits): the token counts and shapes of each missed target, and 4096 tokens for the large-M rate.
CELLS = [(8192, 28672, 32, 4), (14336, 4096, 32, 4), (4096, 11008, 32, 4), (14336, 4096, 64, 4),
         (28672, 8192, 128, 4), (4096, 11008, 128, 4), (14336, 4096, 256, 4), (4096, 11008, 256, 4),
         (4096, 4096, 512, 4), (2048, 10240, 512, 4), (4096, 14336, 1024, 4), (2048, 1536, 1024, 4),
         (8192, 28672, 32, 5), (14336, 4096, 64, 5), (8192, 28672, 4096, 4)]


def profile_once(name, run):
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def main():
    torch.manual_seed(0)
    for k_in, n_out, m, bits in CELLS:
        w = torch.randn(n_out, k_in, device="cuda", dtype=torch.float16) * 0.02
        qw = kbit.quantize(w, bits)
        b_gemm, absmax_gemm = qw.gemm_layout()
        x = torch.randn(m, k_in, device="cuda", dtype=torch.float16)
        k_pad = padded_in_features(k_in)
        name = f"{k_in}to{n_out}_m{m}_k{bits}"
        profile_once(f"{name}_kbit", lambda: ops.gemm(x, b_gemm, absmax_gemm, qw.codebook, qw.scale, None, bits,
                                                      n_out, k_pad, 0))
        if bits == 4:
            profile_once(f"{name}_cublas", lambda: F.linear(x, w))


if __name__ == "__main__":
    main()
