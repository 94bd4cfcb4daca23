"""benchmarks/ncu_source_regions.py: the regions of a warp-specialized kernel's SASS and their warp samples, on a
small source page written here the way ncu exports it (each kernel listed twice)."""

import csv
import io
import json
import subprocess
import sys

from repo_script import load_script

nsr = load_script("benchmarks/ncu_source_regions.py")

STALLS = ("stall_long_sb", "stall_short_sb", "stall_wait")
HEADER = ["Address", "Source", nsr.SAMPLES, nsr.EXECUTED, *STALLS, "stall_wait (Not Issued)"]
STEPS = 40  # consumer warps x steps: the step loop's count
# (source, executed, samples, long_sb, short_sb, wait)
KERNEL = [
    ("LDC R1, c[0x0][0x28]", 10, 5, 0, 0, 5),                           # before the loop
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 10, 3, 0, 0, 3),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6], R16", STEPS, 2, 2, 0, 0),  # the loop: the stage wait
    ("@!P0  BRA 0x7fdc23c6cc70", STEPS, 30, 30, 0, 0),
    ("PRMT R41, R20, 0x7604, R3", STEPS, 4, 0, 4, 0),
    ("LDS R45, [R41]", STEPS, 1, 0, 1, 0),
    ("@P1 BRA 0x7fdc23c6cd00", 7, 2, 0, 0, 2),                         # inside the loop, not once per step
    ("HGMMA.64x32x16.F32 R24, R48, gdesc[UR4], R24", STEPS, 6, 0, 0, 6),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x1", STEPS, 4, 0, 0, 4),
    ("ISETP.NE.AND P6, PT, R21, -0x452453, PT", 12, 20, 20, 0, 0),      # after: the split tiles' sums
    ("EXIT", 10, 3, 0, 0, 3),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 4, 10, 0, 0, 10),               # the producer
    ("SYNCS.ARRIVE.TRANS64 RZ, [UR19], R7", 60, 10, 10, 0, 0),
]
TOTAL = sum(k[2] for k in KERNEL)  # 100


def source_page(names) -> str:
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    for name in names:
        for _ in range(2):
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            for i, (src, ex, n, lsb, ssb, wait) in enumerate(KERNEL):
                w.writerow([hex(0x1000 + 16 * i), "      " + src, n, ex, lsb, ssb, wait, 0])
    return out.getvalue()


def details_page() -> str:
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(["ID", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
    w.writerow(["0", "GPU Speed Of Light Throughput", "Duration", "us", "21.89"])
    w.writerow(["0", "GPU Speed Of Light Throughput", "L1/TEX Cache Throughput", "%", "43.83"])
    w.writerow(["1", "GPU Speed Of Light Throughput", "Duration", "us", "1,050.20"])
    return out.getvalue()


def test_regions_and_the_loop():
    (kernel,) = nsr.parse_source(source_page(["k"]))  # listed twice, read once
    r = nsr.regions(kernel["instructions"])
    assert r["warp_samples"] == TOTAL
    # loop: from the try-wait (index 2) through the wgmma wait (index 8), the once-per-step branch inside included
    assert r["samples_pct"] == {"before_the_loop": 8.0, "consumer_loop": 49.0, "after_the_loop": 23.0,
                                "producer_and_barrier_retries": 20.0}
    assert r["loop_stage_wait_pct_of_all"] == 30.0
    assert r["loop_instructions_per_warp_step"] == 6
    assert r["loop_stall_reasons_pct_of_loop"] == {"long_sb": round(100 * 32 / 49, 1), "wait": round(100 * 12 / 49, 1),
                                                   "short_sb": round(100 * 5 / 49, 1)}
    assert r["loop_instruction_mix"] == {"SYNCS": 1, "BRA": 1, "PRMT": 1, "LDS": 1, "HGMMA": 1, "WARPGROUP": 1}


def test_a_stage_wait_only_where_the_loop_peaks_on_a_branch():
    kernel = nsr.parse_source(source_page(["k"]))[0]["instructions"]
    kernel[3][nsr.SAMPLES] = "0"  # the try-wait branch no longer the loop's most sampled instruction
    assert nsr.regions(kernel)["loop_stage_wait_pct_of_all"] is None


def test_command_line(tmp_path):
    (tmp_path / "source.csv").write_text(source_page(["a", "b"]))
    (tmp_path / "details.csv").write_text(details_page())
    run = subprocess.run([sys.executable, nsr.__file__, str(tmp_path / "source.csv"), str(tmp_path / "details.csv"),
                          "--names", "m32,m64"], capture_output=True, text=True, check=True)
    cases = json.loads(run.stdout)
    assert [c["range"] for c in cases] == ["m32", "m64"]
    assert cases[0]["duration_us"] == 21.89 and cases[0]["l1tex_pct"] == 43.83 and cases[1]["duration_us"] == 1050.2
    assert cases[1]["sm_frequency_ghz"] is None
    assert cases[0]["samples_pct"]["consumer_loop"] == 49.0
    bad = subprocess.run([sys.executable, nsr.__file__, str(tmp_path / "source.csv"), str(tmp_path / "details.csv"),
                          "--names", "only_one"], capture_output=True, text=True)
    assert bad.returncode != 0 and "2 kernels" in bad.stderr
