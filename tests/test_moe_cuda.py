"""GPU tests of the mixture-of-experts kernels (skipped without CUDA), in tests/cuda_harness.py's conventions.

* ``kbit::moe_route`` on CUDA builds the tables of ``kbit.grouped``: the same passes as the reference, each
  expert's rows the same (token, weight) pairs in any order, positions that point at their own rows.
* ``kbit::moe_gemm`` (the grouped GEMM, one launch for every expert) is within the tolerance of
  tests/cuda_harness.py's GemmChecker per routed row: ``max|out - ref32| <= 2 * max|ref_lp - ref32| + slack`` with
  ref_lp the same product in the input dtype through cuBLAS; forced split-K is deterministic.
* ``kbit.KbitExperts`` on CUDA (route, gate/up with the SiLU epilogue, down with the routing weights, combine)
  against the per-expert fp32 reference, with ref_lp the module's own per-expert path in the input dtype: every
  K, fp16/bf16, top-k 1..8, empty experts, all tokens on one expert, unrouted choices, every rows-per-pass the
  device runs (8, 16, 32; 128 on Hopper); CUDA-graph capture and torch.compile; tiny transformers MoE models.
* ``test_sanitize_moe_*``: small, CPU-referenced, for compute-sanitizer (``-k sanitize``), including crafted
  tables that must not make a kernel leave its tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kbit
from kbit import grouped, ops
from kbit.formats import padded_in_features
from kbit.moe import KbitExperts

from cuda_harness import GEMM_DTYPES, BITS, _capture, _name, assert_bits_equal, gen, poison, poisoned, seed_for, tag
from test_moe import ROUTINGS, TOP_KS, routing

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
    pytest.mark.usefixtures("ieee_fp32_matmul"),  # fp32 references are real fp32 products (conftest.py)
]

# (E, H, I): N = 2I not a multiple of 256 (partial row tiles), I_pad = 160 a partial k-group.
SHAPE = (16, 256, 160)
TOKENS = (1, 5, 16, 64, 300)


_EXPERTS = {}


def cuda_experts(k: int, dtype, shape=SHAPE) -> KbitExperts:
    """A quantized random experts layer on the GPU, one per (k, dtype, shape) for the whole run."""
    key = (k, dtype, shape)
    if key not in _EXPERTS:
        E, H, I = shape
        g = gen(seed_for("experts", *key), "cuda")
        gate_up = (torch.randn(E, 2 * I, H, generator=g, device="cuda") * 0.05).to(dtype)
        down = (torch.randn(E, H, I, generator=g, device="cuda") * 0.05).to(dtype)
        _EXPERTS[key] = KbitExperts.from_weights(gate_up, down, bits=k)[0]
    return _EXPERTS[key]


def experts_reference32(mod: KbitExperts, x, idx, w) -> torch.Tensor:
    """fp32 sum over valid choices of w * down(silu(gate) * up), dequantized weights, vectorized per expert."""
    gate_up, down = mod.dequantize("gate_up", torch.float32), mod.dequantize("down", torch.float32)
    out = torch.zeros(x.shape[0], mod.hidden_dim, device=x.device)
    flat = idx.reshape(-1)
    for e in range(mod.num_experts):
        slots = (flat == e).nonzero().flatten()
        if slots.numel():
            tokens = slots // idx.shape[1]
            g, u = (x[tokens].float() @ gate_up[e].T).chunk(2, dim=-1)
            out.index_add_(0, tokens, ((F.silu(g) * u) @ down[e].T) * w.reshape(-1)[slots, None].float())
    return out


def check_against(out: torch.Tensor, ref32: torch.Tensor, ref_lp: torch.Tensor, msg: str) -> None:
    """tests/cuda_harness.py's GemmChecker rule: the kernel within twice the same-precision reference's error."""
    o, lp = out.float(), ref_lp.float()
    assert not bool(torch.isnan(o).any() or torch.isinf(o).any()), f"{msg}: NaN/Inf in the output"
    if not o.numel():
        return
    scale = float(ref32.abs().max())
    eps = torch.finfo(out.dtype).eps
    half_ulp = 0.5 * eps * 2.0 ** math.floor(math.log2(scale)) if scale > 0 else 0.0
    err, err_lp = float((o - ref32).abs().max()), float((lp - ref32).abs().max())
    bound = 2 * err_lp + half_ulp + 1e-5 * scale
    assert err <= bound, (f"{msg}: max|out-ref32|={err:.4g} > {bound:.4g} (max|ref_lp-ref32|={err_lp:.4g}, "
                          f"scale {scale:.4g})")


def route_inputs(kind: str, T: int, top_k: int, E: int, seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    idx = routing(kind, T, top_k, E).cuda()
    w = torch.rand(T, top_k, generator=gen(seed, "cuda"), device="cuda").to(dtype)
    return idx, w


# ----------------------------------------------------------------------------- moe_route
def check_route(got, want, idx, w, msg: str) -> None:
    """CUDA tables against the reference: passes equal; each expert's rows the same (token, weight) pairs."""
    x_rows, row_weights, position, passes, num_passes = (t.cpu() for t in got)
    r_rows, r_weights, r_position, r_passes, r_num = want
    assert_bits_equal(num_passes, r_num, f"num_passes {msg}")
    assert_bits_equal(passes, r_passes, f"passes {msg}")
    routed = int((r_position >= 0).sum())
    spans = {}  # expert -> its sorted rows [first, end): rows within an expert come in arrival order, so compare sets
    for e, first, rows, _ in r_passes[: int(r_num[0])].tolist():
        lo, hi = spans.get(e, (first, first))
        spans[e] = (min(lo, first), max(hi, first + rows))
    for e, (lo, hi) in spans.items():
        sel = slice(lo, hi)
        mine = sorted(zip(x_rows[sel].tolist(), row_weights[sel].tolist()))
        ref = sorted(zip(r_rows[sel].tolist(), r_weights[sel].tolist()))
        assert mine == ref, f"{msg}: expert {e}'s rows {mine} != {ref}"
    assert not bool(x_rows[routed:].any() or row_weights[routed:].any()), f"{msg}: rows past the routed ones not 0"
    assert torch.equal(position < 0, r_position < 0), f"{msg}: unrouted choices differ"
    t = torch.arange(idx.shape[0])[:, None].expand_as(position)
    ok = position >= 0
    assert torch.equal(x_rows[position[ok].long()], t[ok].to(torch.int32)), f"{msg}: position -> wrong token"
    assert torch.equal(row_weights[position[ok].long()], w.cpu().float()[ok]), f"{msg}: position -> wrong weight"


@pytest.mark.parametrize("rows", [8, 16, 32, 128])
@pytest.mark.parametrize("routing_kind", ROUTINGS)
@pytest.mark.parametrize("top_k", TOP_KS)
def test_route_matches_reference(top_k, routing_kind, rows):
    for E, T in ((16, 1), (16, 37), (128, 16), (8, 700), (1000, 3)):
        if top_k > E:
            continue
        for ids_dtype, w_dtype in ((torch.int64, torch.float32), (torch.int32, torch.bfloat16),
                                   (torch.int64, torch.float16)):
            seed = seed_for("route", E, T, top_k, routing_kind, rows, ids_dtype, w_dtype)
            msg = tag(seed, op="moe_route", E=E, T=T, top_k=top_k, routing=routing_kind, rows=rows, ids=ids_dtype,
                      w=w_dtype)
            idx, w = route_inputs(routing_kind, T, top_k, E, seed, w_dtype)
            idx = idx.to(ids_dtype)
            S, P = T * top_k, grouped.max_passes(E, T * top_k, rows)
            ptrs = poison((S, torch.int32), (S, torch.float32), (S, torch.int32), (P * 4, torch.int32),
                          (1, torch.int32))
            got = ops.moe_route(idx, w, E, rows)
            poisoned(ptrs, *got)
            check_route(got, grouped.route_reference(idx.cpu(), w.cpu(), E, rows), idx, w, msg)


def test_route_empty_and_all_unrouted():
    out = ops.moe_route(torch.zeros(0, 4, dtype=torch.long, device="cuda"), torch.zeros(0, 4, device="cuda"), 8, 8)
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0, 4), (0, 4), (1,)] and int(out[4][0]) == 0
    idx = torch.full((5, 2), 8, dtype=torch.long, device="cuda")
    x_rows, row_weights, position, passes, num_passes = ops.moe_route(idx, torch.rand(5, 2, device="cuda"), 8, 8)
    assert int(num_passes[0]) == 0 and bool((position == -1).all()) and not bool(passes.any())


# ----------------------------------------------------------------------------- moe_gemm
def gemm_case(mod: KbitExperts, proj: str, x: torch.Tensor, tables, rows: int, grid_override: int = 0):
    """(y, ref32, ref_lp) of one grouped GEMM of ``mod``'s projection over the routed rows of ``tables``."""
    x_rows, row_weights, position, passes, num_passes = tables
    E, H, I = mod.num_experts, mod.hidden_dim, mod.intermediate_dim
    silu = proj == "gate_up"
    N, in_features_padded = (2 * I, padded_in_features(H)) if silu else (H, padded_in_features(I))
    codes, absmax = getattr(mod, f"{proj}_gemm_codes"), getattr(mod, f"{proj}_gemm_absmax")
    y = ops.moe_gemm(x, codes, absmax, mod.codebook, getattr(mod, f"{proj}_scale"), x_rows if silu else None,
                     None if silu else row_weights, passes, num_passes, mod.bits, N, in_features_padded, rows, silu,
                     grid_override)
    w32 = mod.dequantize(proj, torch.float32)
    routed = int((position >= 0).sum())
    src = x[x_rows[:routed].long()] if silu else x[:routed]
    e_of_row = torch.repeat_interleave(passes[:, 0], passes[:, 2])[:routed].long()
    ref32, ref_lp = torch.empty(routed, y.shape[1], device="cuda"), torch.empty(routed, y.shape[1], device="cuda")
    for e in e_of_row.unique().tolist():
        sel = (e_of_row == e).nonzero().flatten()
        p32 = src[sel].float() @ w32[e].T
        plp = F.linear(src[sel], w32[e].to(x.dtype))
        if silu:
            g32, u32 = p32.chunk(2, dim=-1)
            glp, ulp = plp.float().chunk(2, dim=-1)
            ref32[sel], ref_lp[sel] = F.silu(g32) * u32, (F.silu(glp) * ulp).to(x.dtype).float()
        else:
            wr = row_weights[sel, None]
            ref32[sel], ref_lp[sel] = p32 * wr, (plp.float() * wr).to(x.dtype).float()
    return y[:routed], ref32, ref_lp


@pytest.mark.parametrize("proj", ["gate_up", "down"])
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
@pytest.mark.parametrize("k", BITS)
def test_moe_gemm_matches_reference(k, dtype, proj):
    mod = cuda_experts(k, dtype)
    E, H, I = SHAPE
    assert mod._rows_supported, "the device runs the grouped GEMM"
    for rows in mod._rows_supported:
        for T, top_k, kind in ((1, 8, "random"), (23, 2, "unrouted"), (300, 1, "one_expert"), (200, 4, "some_empty")):
            seed = seed_for("moe_gemm", k, dtype, proj, rows, T, top_k, kind)
            msg = tag(seed, op="moe_gemm", bits=k, dtype=dtype, proj=proj, rows=rows, T=T, top_k=top_k, routing=kind)
            idx, w = route_inputs(kind, T, top_k, E, seed)
            tables = ops.moe_route(idx, w, E, rows)
            width = H if proj == "gate_up" else I
            x = torch.randn(T if proj == "gate_up" else T * top_k, width, generator=gen(seed, "cuda"),
                            device="cuda").to(dtype)
            y, ref32, ref_lp = gemm_case(mod, proj, x, tables, rows)
            check_against(y, ref32, ref_lp, msg)


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
@pytest.mark.parametrize("k", BITS)
def test_moe_gemm_split_k_deterministic(k, dtype):
    """A forced small grid splits tiles across CTAs: results repeat bit for bit and stay within tolerance."""
    mod = cuda_experts(k, dtype)
    E, H, _ = SHAPE
    seed = seed_for("moe_split", k, dtype)
    idx, w = route_inputs("random", 9, 4, E, seed)
    tables = ops.moe_route(idx, w, E, 8)
    x = torch.randn(9, H, generator=gen(seed, "cuda"), device="cuda").to(dtype)
    for grid in (1, 3, 7):
        msg = tag(seed, op="moe_gemm split-K", bits=k, dtype=dtype, grid_override=grid)
        first, ref32, ref_lp = gemm_case(mod, "gate_up", x, tables, 8, grid)
        check_against(first, ref32, ref_lp, msg)
        for rep in range(20):
            again = gemm_case(mod, "gate_up", x, tables, 8, grid)[0]
            assert_bits_equal(again, first, f"{msg} repeat {rep}")


# ----------------------------------------------------------------------------- KbitExperts on CUDA
@pytest.mark.parametrize("routing_kind", ROUTINGS)
@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
@pytest.mark.parametrize("k", BITS)
def test_experts_match_per_expert_reference(k, dtype, top_k, routing_kind):
    mod = cuda_experts(k, dtype)
    E, H, _ = SHAPE
    assert mod.gate_up_gemm_codes is not None, "the grouped path is prepared on CUDA"
    for T in TOKENS:
        seed = seed_for("experts", k, dtype, top_k, routing_kind, T)
        rows = mod.rows_per_pass(T * top_k)
        msg = tag(seed, op="KbitExperts", bits=k, dtype=dtype, top_k=top_k, routing=routing_kind, T=T, rows=rows)
        idx, w = route_inputs(routing_kind, T, top_k, E, seed)
        x = torch.randn(T, H, generator=gen(seed, "cuda"), device="cuda").to(dtype)
        with torch.no_grad():
            out = mod(x, idx, w)
            ref_lp = mod._forward_reference(x, idx, w)
        assert out.shape == (T, H) and out.dtype == dtype, msg
        check_against(out, experts_reference32(mod, x, idx, w), ref_lp, msg)


def test_experts_many_passes_on_one_expert():
    """Every token on expert 3 (with wgmma's 128-row passes on Hopper): one expert, many passes, split among SMs."""
    mod = cuda_experts(4, torch.bfloat16)
    E, H, _ = SHAPE
    for T in (100, 1000):
        idx = torch.full((T, 1), 3, dtype=torch.long, device="cuda")
        w = torch.rand(T, 1, device="cuda")
        x = torch.randn(T, H, device="cuda").bfloat16()
        with torch.no_grad():
            check_against(mod(x, idx, w), experts_reference32(mod, x, idx, w), mod._forward_reference(x, idx, w),
                          f"all {T} tokens on one expert")


def test_experts_wide_layer_and_other_activation():
    """A model-sized layer (H = 2048, I = 768, 128 experts, top-8) and a GELU gate (activation outside the GEMM)."""
    mod = cuda_experts(4, torch.bfloat16, (128, 2048, 768))
    x = torch.randn(16, 2048, device="cuda").bfloat16()
    idx, w = route_inputs("random", 16, 8, 128, seed_for("wide"))
    with torch.no_grad():
        check_against(mod(x, idx, w), experts_reference32(mod, x, idx, w), mod._forward_reference(x, idx, w),
                      "Qwen3-30B-A3B-shaped layer")
        mod.act_fn = torch.nn.GELU()
        try:
            ref = mod._forward_reference(x, idx, w)
            torch.testing.assert_close(mod(x, idx, w).float(), ref.float(), rtol=0.05,
                                       atol=0.05 * float(ref.abs().max()))
        finally:
            mod.act_fn = torch.nn.SiLU()


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
def test_cuda_graph_experts(dtype):
    mod = cuda_experts(4, dtype)
    E, H, _ = SHAPE
    for T, top_k in ((1, 8), (16, 2), (300, 4)):
        seed = seed_for("graph-experts", dtype, T, top_k)
        idx, w = route_inputs("random", T, top_k, E, seed)
        x = torch.randn(T, H, device="cuda").to(dtype)
        with torch.no_grad():
            graph, out = _capture(lambda: mod(x, idx, w))
            for trial in range(3):
                new_idx, new_w = route_inputs("some_empty" if trial else "one_expert", T, top_k, E, seed + trial)
                idx.copy_(new_idx)
                w.copy_(new_w)
                x.copy_(torch.randn(T, H, device="cuda").to(dtype))
                graph.replay()
                assert_bits_equal(out, mod(x, idx, w), tag(seed, op="graph-experts", T=T, trial=trial))
        del graph


def test_torch_compile_experts():
    torch._dynamo.reset()
    mod = cuda_experts(3, torch.float16)
    E, H, _ = SHAPE
    idx, w = route_inputs("random", 7, 2, E, seed_for("compile-experts"))
    x = torch.randn(7, H, device="cuda").half()
    with torch.no_grad():
        compiled = torch.compile(mod, fullgraph=True)
        assert_bits_equal(compiled(x, idx, w), mod(x, idx, w), "torch.compile(KbitExperts)")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "glm4_moe"])
def test_tiny_moe_model_on_cuda(family):
    """quantize_model on CPU, then the model on the GPU: logits near the CPU reference path, generate works."""
    import copy

    from test_moe import COMMON, logits, tiny_moe

    torch.manual_seed(seed_for("tiny", family))
    model = tiny_moe(family, torch.bfloat16)
    q = kbit.quantize_model(copy.deepcopy(model), bits=4, progress=False)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    cpu = logits(q, ids).float()
    q.cuda()
    assert all(m.gate_up_gemm_codes is not None for m in q.modules() if isinstance(m, KbitExperts))
    gpu = logits(q, ids.cuda()).float().cpu()
    assert float((gpu - cpu).norm() / cpu.norm()) < 0.05, family
    out = q.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=4, min_new_tokens=4,
                     do_sample=False, pad_token_id=0)
    assert out.shape == (2, 11)


# ----------------------------------------------------------------------------- compute-sanitizer subset
@pytest.mark.parametrize("k", BITS)
def test_sanitize_moe_forward(k):
    """The whole grouped forward on small shapes, against the CPU reference ops (no cuBLAS)."""
    E, H, I = 6, 64, 40
    seed = seed_for("sanitize-moe", k)
    g = gen(seed)
    mod, _ = KbitExperts.from_weights(torch.randn(E, 2 * I, H, generator=g) * 0.05,
                                      torch.randn(E, H, I, generator=g) * 0.05, bits=k)
    cpu = mod
    gpu = KbitExperts(E, H, I, bits=k, dtype=torch.float32, device="cuda")
    gpu.load_state_dict(mod.state_dict())
    cpu.derive_gemm_layouts()
    for T, top_k, kind in ((1, 2, "random"), (17, 4, "unrouted"), (40, 1, "one_expert"), (0, 2, "random")):
        torch.manual_seed(seed + T)
        idx, w = routing(kind, T, top_k, E), torch.rand(T, top_k)
        x = torch.randn(T, H, generator=g).half()
        with torch.no_grad():
            out = gpu(x.cuda(), idx.cuda(), w.cuda()).cpu()
            ref = cpu._forward_grouped(x, idx, w)
        msg = tag(seed, op="sanitize-moe", bits=k, T=T, top_k=top_k, routing=kind)
        assert out.shape == ref.shape and bool(torch.isfinite(out).all()), msg
        if T:
            err = float((out.float() - ref.float()).abs().max())
            assert err <= 0.01 * max(float(ref.abs().max()), 1e-6), f"{msg}: max error {err:.4g}"
    torch.cuda.synchronize()


def test_sanitize_moe_crafted_tables_stay_in_bounds():
    """Passes and rows that point outside y, x or the experts: wrong numbers at worst, no access outside the
    tensors (compute-sanitizer memcheck is the judge), no error."""
    mod = cuda_experts(4, torch.float16, (4, 64, 32))
    x = torch.randn(5, 64, device="cuda").half()
    i32 = dict(dtype=torch.int32, device="cuda")
    passes = torch.tensor([[7, 0, 3, 0], [0, 4, 8, 0], [-1, 0, 1, 0], [1, -5, 2, 0], [2, 0, 9, 0], [3, 0, 8, 0]],
                          **i32)
    x_rows = torch.tensor([0, 99, -3, 4, 2, 1, 0, 1], **i32)
    for num in (6, 1000, -2):
        num_passes = torch.tensor([num], **i32)
        for silu in (True, False):
            N, in_features_padded = (64, 64) if silu else (64, 32)
            proj = "gate_up" if silu else "down"
            xin = x if silu else x[:, :32].contiguous().repeat(2, 1)[:8]
            ops.moe_gemm(xin, getattr(mod, f"{proj}_gemm_codes"), getattr(mod, f"{proj}_gemm_absmax"), mod.codebook,
                         getattr(mod, f"{proj}_scale"), x_rows if silu else None, None, passes, num_passes, 4, N,
                         in_features_padded, 8, silu, 0)
    position = torch.tensor([[0, 7], [8, -1], [100, 3]], **i32)
    ops.moe_combine(torch.randn(8, 64, device="cuda").half(), position)
    torch.cuda.synchronize()


def _malformed_moe_cases():
    from kbit._build import cuda_ext

    ext = cuda_ext()
    mod = cuda_experts(4, torch.float16, (4, 64, 32))
    x = torch.randn(5, 64, device="cuda").half()
    i32 = dict(dtype=torch.int32, device="cuda")
    passes, num = torch.zeros(4, 4, **i32), torch.zeros(1, **i32)
    rows = torch.zeros(10, **i32)
    b, a, cb, s = mod.gate_up_gemm_codes, mod.gate_up_gemm_absmax, mod.codebook, mod.gate_up_scale

    def gemm(**over):
        args = dict(x=x, b=b, a=a, cb=cb, s=s, rows=rows, rw=None, passes=passes, num=num, bits=4, N=64, K=64, R=8,
                    silu=True)
        args.update(over)
        return lambda: ext.moe_gemm(args["x"], args["b"], args["a"], args["cb"], args["s"], args["rows"], args["rw"],
                                    args["passes"], args["num"], args["bits"], args["N"], args["K"], args["R"],
                                    args["silu"], 0, False)

    idx = torch.zeros(3, 2, dtype=torch.long, device="cuda")
    return [
        ("route ids float", lambda: ext.moe_route(idx.float(), idx.float(), 4, 8)),
        ("route weights shape", lambda: ext.moe_route(idx, torch.zeros(3, 3, device="cuda"), 4, 8)),
        ("route weights int", lambda: ext.moe_route(idx, idx, 4, 8)),
        ("route too many experts", lambda: ext.moe_route(idx, idx.float(), 5000, 8)),
        ("route rows per pass", lambda: ext.moe_route(idx, idx.float(), 4, 12)),
        ("gemm x fp32", gemm(x=x.float())),
        ("gemm x odd columns", gemm(x=torch.randn(5, 60, device="cuda").half())),
        ("gemm b shape", gemm(b=b[:, :-1].contiguous())),
        ("gemm absmax dtype", gemm(a=a.to(torch.int32))),
        ("gemm scale shape", gemm(s=s[:3].contiguous())),
        ("gemm rows int64", gemm(rows=rows.long())),
        ("gemm row weights with silu", gemm(rw=torch.zeros(10, device="cuda"))),
        ("gemm row weights short", gemm(silu=False, N=64, K=32, b=mod.down_gemm_codes, a=mod.down_gemm_absmax,
                                        x=x[:, :32].contiguous(), rows=None, rw=torch.zeros(4, device="cuda"))),
        ("gemm passes shape", gemm(passes=torch.zeros(4, 3, **i32))),
        ("gemm num passes shape", gemm(num=torch.zeros(2, **i32))),
        ("gemm k mismatch", gemm(bits=3)),
        ("gemm rows per pass", gemm(R=64)),
        ("gemm silu odd N", gemm(N=72)),
        ("combine y fp32", lambda: ext.moe_combine(torch.zeros(4, 64, device="cuda"), torch.zeros(2, 2, **i32))),
        ("combine position int64", lambda: ext.moe_combine(x, torch.zeros(2, 2, dtype=torch.long, device="cuda"))),
        ("combine odd columns", lambda: ext.moe_combine(torch.zeros(4, 60, device="cuda").half(),
                                                        torch.zeros(2, 2, **i32))),
    ]


def test_sanitize_moe_malformed_tensors_are_refused_by_the_binding():
    for name, call in _malformed_moe_cases():
        print(f"malformed case: {name}", flush=True)
        with pytest.raises(RuntimeError, match="kbit: "):
            call()
            torch.cuda.synchronize()
    torch.cuda.synchronize()
