"""Where the warp-specialized GEMM kernel's warps spend their time, from ncu's source counters: the warp-state samples
of every SASS instruction summed by region of the kernel, and the step loop's stall reasons and instruction mix.

    ncu --nvtx --nvtx-include "regex:<ranges>/" --kernel-name regex:gemm --section SpeedOfLight \\
        --section WarpStateStats --section SourceCounters -o prof python <target>
    ncu --import prof.ncu-rep --page source --csv --print-source sass | gzip > source.csv.gz
    ncu --import prof.ncu-rep --page details --csv > details.csv
    python benchmarks/ncu_source_regions.py source.csv.gz details.csv --names 14336to4096_m32,...

Regions (kbit/csrc/gemm_ws.cuh), in address order: the consumers' step loop is the run of instructions from the first
to the last that ran as often as the wgmmas (once per consumer warp and step); before it the setup and the table
build; after it, up to the producer's code (which starts at its `setmaxnreg` release), the tile ends and the split
tiles' sums; then the producer's code and the out-of-line barrier retries. The loop's stage wait is its most sampled
instruction where that is a branch (the stage barrier's try-wait loop). Prints one JSON list, a case per kernel.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import json
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
DETAILS = {"duration_us": "Duration", "sm_frequency_ghz": "SM Frequency", "issue_slots_busy_pct": "Issue Slots Busy",
           "l1tex_pct": "L1/TEX Cache Throughput", "dram_pct": "DRAM Throughput"}


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def parse_source(text: str) -> list:
    """The source page's kernels in order, each {'name', 'instructions': [row dicts]}; a kernel listed twice in a row
    (the export repeats them) once."""
    kernels, header = [], None
    for row in csv.reader(io.StringIO(text)):
        if row and row[0] == "Kernel Name":
            kernels.append({"name": row[1], "instructions": []})
            header = None
        elif row and row[0] == "Address":
            header = row
        elif kernels and header and len(row) == len(header):
            kernels[-1]["instructions"].append(dict(zip(header, row)))
    unique = []
    for k in kernels:
        if not unique or (k["name"], k["instructions"]) != (unique[-1]["name"], unique[-1]["instructions"]):
            unique.append(k)
    return unique


def parse_details(text: str) -> dict:
    """{kernel ID: {metric name: value}} from the details page."""
    metrics = collections.defaultdict(dict)
    for row in csv.DictReader(io.StringIO(text)):
        try:
            metrics[int(row["ID"])][row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except ValueError:  # a metric whose value is text (names, launch attributes)
            continue
    return metrics


def opcode(source: str) -> str:
    words = source.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def regions(instructions: list) -> dict:
    """The kernel's samples by region (percent of all), the loop's stage wait, stall reasons and instruction mix."""
    samples = [int(d[SAMPLES] or 0) for d in instructions]
    executed = [int(d[EXECUTED] or 0) for d in instructions]
    sources = [d["Source"].strip() for d in instructions]
    per_step = max(e for e, s in zip(executed, sources) if opcode(s).startswith("HGMMA"))
    loop = [i for i, e in enumerate(executed) if e == per_step]
    first, last = loop[0], loop[-1]
    producer = next(i for i, s in enumerate(sources) if "USETMAXREG.DEALLOC" in s)
    total = sum(samples)

    def share(a: int, b: int) -> float:  # instructions [a, b), percent of all samples
        return round(100 * sum(samples[a:b]) / total, 1)

    stalls = [h for h in instructions[0] if h.startswith("stall_") and "Not Issued" not in h]
    reasons = collections.Counter()
    for d in instructions[first:last + 1]:
        for s in stalls:
            reasons[s[len("stall_"):]] += int(d[s] or 0)
    in_loop = sum(samples[first:last + 1])
    wait = max(range(first, last + 1), key=lambda i: samples[i])
    return {
        "warp_samples": total,
        "samples_pct": {"before_the_loop": share(0, first), "consumer_loop": share(first, last + 1),
                        "after_the_loop": share(last + 1, producer),
                        "producer_and_barrier_retries": share(producer, len(samples))},
        "loop_stage_wait_pct_of_all": (round(100 * samples[wait] / total, 1)
                                       if opcode(sources[wait]) == "BRA" else None),
        "loop_stall_reasons_pct_of_loop": {r: round(100 * v / in_loop, 1) for r, v in reasons.most_common(9)},
        "loop_instructions_per_warp_step": len(loop),
        "loop_instruction_mix": dict(collections.Counter(opcode(sources[i]) for i in loop).most_common(10)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    p.add_argument("details", help="ncu --page details --csv output")
    p.add_argument("--names", default="", help="comma-separated case names, one per kernel in order")
    args = p.parse_args()
    kernels = parse_source(read_text(args.source))
    details = parse_details(read_text(args.details))
    names = args.names.split(",") if args.names else [str(i) for i in range(len(kernels))]
    if len(names) != len(kernels):
        p.error(f"--names: {len(names)} names for {len(kernels)} kernels")
    cases = []
    for i, (name, kernel) in enumerate(zip(names, kernels)):
        case = {"range": name, "kernel": kernel["name"][:60]}
        case.update({key: details[i].get(metric) for key, metric in DETAILS.items()})
        case.update(regions(kernel["instructions"]))
        cases.append(case)
    json.dump(cases, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
