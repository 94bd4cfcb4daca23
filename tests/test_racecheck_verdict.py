"""scripts/racecheck_verdict.py: which racecheck logs pass (clean, or only bulk-copy hazards) and which fail."""

from repo_script import load_script

rv = load_script("scripts/racecheck_verdict.py")

BULK = "Write access at kbit::bulk_copy_to_shared(void *, const void *, unsigned int, unsigned int)+0x6160 in common.cuh:168"
READ = "Read access at void kbit::load_tile_codes<kbit::GemmConfig<(int)2>>(const unsigned char *)+0x8130 in gemm.cuh:652"
OTHER_WRITE = "Write access at void kbit::build_tables<kbit::GemmConfig<(int)4>>(float, unsigned char *)+0x120 in gemm.cuh:300"


def report(first: str, *others: str) -> str:
    lines = [f"========= Error: Race reported between {first}"]
    lines += [f"=========     and {o} [64 hazards]" for o in others]
    return "\n".join(lines + ["========= "])


def log(*reports: str, displayed=None, errors=None) -> str:
    n = len(reports)
    displayed = n if displayed is None else displayed
    errors = n if errors is None else errors
    return "\n".join(["========= COMPUTE-SANITIZER", *reports, "... 18 passed in 12.3s",
                      f"========= RACECHECK SUMMARY: {displayed} hazards displayed ({errors} errors, 0 warnings)"])


def test_clean_log_passes():
    assert rv.verdict(log())[0]


def test_bulk_copy_hazards_pass_either_way_round():
    ok, why = rv.verdict(log(report(BULK, READ, READ), report(READ, BULK)))
    assert ok and why.startswith("2 hazards")


def test_any_other_hazard_fails():
    ok, why = rv.verdict(log(report(BULK, READ), report(OTHER_WRITE, READ)))
    assert not ok and "build_tables" in why
    assert not rv.verdict(log(report(BULK, READ, OTHER_WRITE)))[0]  # one pair of three is not a bulk copy's
    assert not rv.verdict(log(report(BULK)))[0]  # a report without the access it races with


def test_undisplayed_or_unparsed_hazards_fail():
    assert not rv.verdict(log(report(BULK, READ), errors=146))[0]  # print limit hid some
    assert not rv.verdict(log(report(BULK, READ), displayed=2, errors=2))[0]  # one report not parsed
    assert not rv.verdict("========= COMPUTE-SANITIZER\n")[0]  # the run died before its summary


def test_a_log_past_the_hazard_limit_fails():
    """Past its hazard limit racecheck checks nothing more, however harmless the hazards it showed."""
    limit = ("========= Warning: Maximum number of hazards reached. Environment variable "
             "NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS can be used to increase this count.")
    ok, why = rv.verdict(log(report(BULK, READ)) + "\n" + limit)
    assert not ok and "hazard limit" in why
    assert rv.verdict(log(report(BULK, READ)))[0]


def test_the_cluster_sums_over_the_stages_pass_and_only_they():
    """st_cluster's writes come after a cluster barrier past every consumer's last full-stage wait; a plain write
    or two cluster writes against each other stay failures."""
    CLUSTER = "Write access at kbit::st_cluster(unsigned int, unsigned int, float4)+0xf6c0 in common.cuh:236"
    ok, why = rv.verdict(log(report(BULK, CLUSTER, READ), report(CLUSTER, BULK)))
    assert ok and "cluster's sums" in why
    assert not rv.verdict(log(report(BULK, CLUSTER, OTHER_WRITE)))[0]
    assert not rv.verdict(log(report(CLUSTER, CLUSTER)))[0]
