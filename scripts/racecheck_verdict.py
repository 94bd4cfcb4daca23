"""Verdict on a compute-sanitizer racecheck log: clean, or every hazard one racecheck cannot order.

    python scripts/racecheck_verdict.py LOG      # exit 0: clean or bulk-copy hazards only; 1: a real report

Racecheck attributes the shared-memory write of a raw-address bulk copy (`cp.async.bulk`, kbit's
`bulk_copy_to_shared`) to the thread that issued it, and does not take the stage's mbarrier (the copy's
`complete_tx`, the readers' `try_wait`, their `arrive` on the empty barrier before the next copy is issued) as an
order between warps: every read of a stage another warp's lane filled, and every refill of a stage another warp
read, is reported. Those orders are what the pipeline is built on (docs/DESIGN.md, classic kernel) and what the
GPU tests check bitwise. So is the one write after them: a tile's parts summed in a cluster (`ws_cluster_reduce`)
store into the stages with `st_cluster` only after a cluster barrier that every consumer of every CTA reaches past
its last wait on a full stage, so each copy's write is ordered before them by that wait and the barrier. Every other
hazard (a plain write against a bulk copy included), a log that does not display all its hazards, and one past
racecheck's hazard limit, fails.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

BULK_WRITE = re.compile(r"Write access at kbit::bulk_copy_to_shared\(")
CLUSTER_SUM_WRITE = re.compile(r"Write access at kbit::st_cluster\(")
SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
# Racecheck stops tracking past its hazard limit: the accesses after it go unchecked.
LIMIT_REACHED = "Maximum number of hazards reached"


def hazard_reports(log: str) -> list[list[str]]:
    """Each report: its first access, then the accesses it races with ("and ...")."""
    reports: list[list[str]] = []
    for line in log.splitlines():
        first = re.search(r"Race reported between (.*)", line)
        if first:
            reports.append([first.group(1)])
        elif reports and re.match(r"=+\s+and ", line):
            reports[-1].append(line.split(" and ", 1)[1])
    return reports


def _unordered_to_racecheck(a: str, b: str) -> bool:
    """A bulk copy's write and a read, or the cluster's sums written over the stages: any other plain write against a
    bulk copy is not this class (it needs a proxy fence that racecheck cannot see either, so it stays a failure to look
    at)."""
    def ordered_after(other: str) -> bool:
        return other.startswith("Read access") or bool(CLUSTER_SUM_WRITE.match(other))
    return bool(BULK_WRITE.search(a) and ordered_after(b) or BULK_WRITE.search(b) and ordered_after(a))


def verdict(log: str) -> tuple[bool, str]:
    summary = SUMMARY.search(log)
    if summary is None:
        return False, "no RACECHECK SUMMARY in the log"
    if LIMIT_REACHED in log:
        return False, "racecheck stopped at its hazard limit: raise NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS"
    displayed, errors, warnings = map(int, summary.groups())
    if displayed == 0 and errors + warnings == 0:
        return True, "0 hazards"
    if displayed != errors + warnings:
        return False, f"{displayed} of {errors + warnings} hazards displayed: raise --print-limit to judge them all"
    reports = hazard_reports(log)
    if len(reports) != displayed:
        return False, f"{len(reports)} hazard reports parsed, the summary says {displayed}"
    real = [r for r in reports if len(r) < 2 or not all(_unordered_to_racecheck(r[0], b) for b in r[1:])]
    if real:
        listed = "\n".join("  " + " | ".join(r) for r in real)
        return False, (f"{len(real)} of {displayed} hazards not between a bulk copy and its readers or the cluster's "
                       f"sums:\n{listed}")
    return True, (f"{displayed} hazards, every one a bulk copy's write against its stage's readers or the cluster's "
                  "sums (unordered to racecheck)")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    ok, why = verdict(Path(argv[1]).read_text(errors="replace"))
    print(("clean: " if ok else "FAIL: ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
