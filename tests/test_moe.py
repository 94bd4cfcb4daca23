"""Mixture-of-experts on CPU: KbitExperts against a per-expert reference, quantize_model on tiny MoE models of
every transformers family that keeps fused experts, save/load, untrusted checkpoints, unsupported variants."""

from __future__ import annotations

import copy
import functools
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kbit
from kbit import grouped, ops
from kbit.formats import padded_in_features
from kbit.moe import STORAGE, KbitExperts

from repo_script import load_script
from test_formats import DTYPES, KS, _name

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

TOP_KS = (1, 2, 4, 6, 8)
ROUTINGS = ("random", "one_expert", "some_empty", "unrouted")


# ----------------------------------------------------------------------------- references and inputs
def experts_reference(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, idx: torch.Tensor,
                      w: torch.Tensor) -> torch.Tensor:
    """float32 [T, H]: the sum over choices (t, j) of a valid expert e of w[t, j] * down[e] @ (silu(g) * u), where
    g, u = gate_up[e] @ x[t]."""
    out = torch.zeros(x.shape[0], down.shape[1])
    flat, weights = idx.reshape(-1), w.reshape(-1).float()
    for e in range(gate_up.shape[0]):
        slots = (flat == e).nonzero().flatten()
        tokens = slots // idx.shape[1]
        g, u = (x[tokens].float() @ gate_up[e].T).chunk(2, dim=-1)
        out.index_add_(0, tokens, (F.silu(g) * u) @ down[e].T * weights[slots, None])
    return out


def routing(kind: str, T: int, top_k: int, E: int) -> torch.Tensor:
    """[T, top_k] expert ids: distinct per token; ``one_expert``: every token's first choice is one expert;
    ``some_empty``: only half of the experts get tokens; ``unrouted``: some choices are E or -1 (no expert)."""
    pool = E // 2 if kind == "some_empty" and top_k <= E // 2 else E
    if not T:
        return torch.zeros(0, top_k, dtype=torch.long)
    idx = torch.stack([torch.randperm(pool)[:top_k] for _ in range(T)])
    if kind == "one_expert":
        e0 = int(torch.randint(0, E, ()))
        for t in range(T):
            row = [e0] + [e for e in idx[t].tolist() if e != e0]
            idx[t] = torch.tensor(row[:top_k])
    if kind == "unrouted":
        idx[torch.rand(T, top_k) < 0.3] = E
        idx[0, -1] = -1
    return idx


def random_experts(E: int, H: int, I: int, dtype=torch.float32):
    gate_up = (torch.randn(E, 2 * I, H) * 0.05).to(dtype)
    down = (torch.randn(E, H, I) * 0.05).to(dtype)
    return gate_up, down


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype, what: str) -> None:
    """The module rounds the gate/up product, the activation and the down product to ``dtype``: a few of its
    rounding steps, relative to the output's scale."""
    eps = torch.finfo(dtype).eps
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((out.float() - ref).abs().max()) if ref.numel() else 0.0
    assert err <= 16 * eps * scale + 1e-30, f"{what}: max error {err:.3g} vs output scale {scale:.3g} (eps {eps:.3g})"


# ----------------------------------------------------------------------------- KbitExperts
E_TEST, H_TEST, I_TEST = 10, 72, 40  # H and I not multiples of 32 (padded storage), multiples of 8 (grouped path)


@functools.lru_cache(maxsize=None)
def cached_experts(k: int, dtype) -> KbitExperts:
    """A layer of random experts per (k, dtype), with its GEMM layouts (on CPU, for the reference ops)."""
    torch.manual_seed(k * 31 + DTYPES.index(dtype))
    mod, _ = KbitExperts.from_weights(*random_experts(E_TEST, H_TEST, I_TEST, dtype), bits=k)
    mod.derive_gemm_layouts()
    return mod


@functools.lru_cache(maxsize=None)
def dequantized(mod: KbitExperts) -> tuple:
    return mod.dequantize("gate_up", torch.float32), mod.dequantize("down", torch.float32)


def reference_of(mod: KbitExperts, x, idx, w) -> torch.Tensor:
    return experts_reference(*dequantized(mod), x, idx, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("k", KS)
def test_experts_match_per_expert_reference(k, dtype):
    """Every top-k in {1, 2, 4, 6, 8} with every routing: random, all tokens on one expert, empty experts,
    unrouted choices."""
    mod, T = cached_experts(k, dtype), 13
    for top_k in TOP_KS:
        for routing_kind in ROUTINGS:
            x, idx, w = torch.randn(T, H_TEST).to(dtype), routing(routing_kind, T, top_k, E_TEST), torch.rand(T, top_k)
            with torch.no_grad():
                out = mod(x, idx, w)
            assert out.shape == (T, H_TEST) and out.dtype == dtype
            check_close(out, reference_of(mod, x, idx, w), dtype,
                        f"bits={k} {_name(dtype)} top_k={top_k} routing={routing_kind}")


@pytest.mark.parametrize("k", KS)
def test_expert_storage_is_per_expert_quantize(k):
    """Row e of every buffer is exactly kbit.quantize of expert e's weight alone."""
    gate_up, down = random_experts(4, 64, 48, torch.bfloat16)
    gate_up[2] *= 1000.0  # a different per-tensor scale for one expert
    mod, _ = KbitExperts.from_weights(gate_up, down, bits=k)
    for proj, weights in (("gate_up", gate_up), ("down", down)):
        for e in range(4):
            want = kbit.quantize(weights[e], bits=k)
            got = mod.expert_weight(proj, e)
            for name in ("packed", "absmax", "scale", "codebook"):
                assert torch.equal(getattr(got, name), getattr(want, name)), f"{proj}[{e}].{name}"
            assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert torch.equal(mod.dequantize("gate_up"), torch.stack([kbit.dequantize(kbit.quantize(w, k)) for w in gate_up]))


def test_projections_are_views_of_the_buffers_in_both_forms():
    """``projection(proj)`` is a QuantizedWeight [E, N, K] over the module's buffers; expert e of it is the weight
    built from row e of each saved buffer; the gate/up layout is the grouped GEMM's (rows interleaved by 8); dequantize
    is each expert's, stacked. The same from the GEMM layouts (derived there bit for bit)."""
    E, H, I = 3, 72, 40
    mod, _ = KbitExperts.from_weights(*random_experts(E, H, I, torch.bfloat16), bits=3)
    state = {key: t.clone() for key, t in mod.state_dict().items()}
    for resident in (False, True):
        if resident:
            mod._hold_layout()  # what prepare() does on CUDA
        for proj, (N, K) in mod.shapes().items():
            qw = mod.projection(proj)
            assert qw.shape == (E, N, K) and qw.is_gemm_resident == resident and qw.dtype == torch.bfloat16
            assert qw.codebook is mod.codebook and qw.scale is getattr(mod, f"{proj}_scale")
            assert (qw.row_order is not None) == (proj == "gate_up")
            if not resident:
                assert qw.packed is getattr(mod, f"{proj}_packed") and qw.absmax is getattr(mod, f"{proj}_absmax")
            for e in range(E):
                want = kbit.QuantizedWeight(state[f"{proj}_packed"][e], state[f"{proj}_absmax"][e], state["codebook"],
                                            state[f"{proj}_scale"][e], 3, (N, K), torch.bfloat16)
                got = mod.expert_weight(proj, e)
                for key in ("packed", "absmax", "scale", "codebook"):
                    assert torch.equal(getattr(got, key), getattr(want, key)), (resident, proj, e, key)
                assert got.shape == (N, K) and not got.is_gemm_resident
            want = torch.stack([mod.expert_weight(proj, e).dequantize() for e in range(E)])
            assert torch.equal(mod.dequantize(proj), want)
    for e in range(E):  # the layout the grouped GEMM reads: each expert's, gate/up rows interleaved
        rows = [grouped.interleave_gate_up(state[f"gate_up_{key}"][e].view(2 * I, -1), I).reshape(-1)
                for key in ("packed", "absmax")]
        b, a = ops.repack(*rows, 3, 2 * I, padded_in_features(H))
        assert torch.equal(mod.gate_up_gemm_codes[e], b) and torch.equal(mod.gate_up_gemm_absmax[e], a)


def test_experts_empty_input_and_duplicate_choices():
    gate_up, down = random_experts(6, 64, 32)
    mod, _ = KbitExperts.from_weights(gate_up, down, bits=4)
    with torch.no_grad():
        out = mod(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
        assert out.shape == (0, 64)
        x, idx, w = torch.randn(3, 64), torch.tensor([[1, 1], [5, 1], [0, 0]]), torch.rand(3, 2)
        ref = experts_reference(mod.dequantize("gate_up"), mod.dequantize("down"), x, idx, w)
        check_close(mod(x, idx, w), ref, torch.float32, "an expert chosen twice by one token")


def test_experts_forward_argument_errors():
    mod, _ = KbitExperts.from_weights(*random_experts(4, 64, 32), bits=3)
    x, idx, w = torch.randn(5, 64), torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2)
    with pytest.raises(ValueError, match="hidden_states"):
        mod(torch.randn(5, 63), idx, w)
    with pytest.raises(ValueError, match="top_k_index and top_k_weights"):
        mod(x, idx, torch.rand(5, 3))
    with pytest.raises(TypeError, match="top_k_index must be an integer"):
        mod(x, idx.float(), w)
    with pytest.raises(TypeError, match="top_k_weights must be a floating"):
        mod(x, idx, idx)
    with pytest.raises(ValueError, match="expert must be <"):
        mod.expert_weight("down", 4)
    with pytest.raises(ValueError, match="proj must be one of"):
        mod.expert_weight("up", 0)


def test_experts_dtype_casts_keep_the_format():
    mod, _ = KbitExperts.from_weights(*random_experts(3, 64, 32), bits=4)
    before = {n: b.clone() for n, b in mod.state_dict().items()}
    mod.half()
    mod.to(torch.bfloat16)
    for name, t in mod.state_dict().items():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name


# ----------------------------------------------------------------------------- the grouped ops (references)
def test_route_reference_tables():
    """kbit.grouped's documented tables on a hand-checked example (an unrouted choice, an empty expert, an
    expert whose rows take two passes)."""
    ids = torch.tensor([[1, 3], [1, 0], [4, 1]])  # 4 = E: not routed
    w = torch.tensor([[0.5, 0.25], [0.125, 1.0], [2.0, 4.0]], dtype=torch.bfloat16)
    x_rows, row_weights, position, passes, num_passes = ops.moe_route(ids, w, 4, 2)
    assert x_rows.tolist() == [1, 0, 1, 2, 0, 0]  # expert 0: slot 3; expert 1: slots 0, 2, 5; expert 3: slot 1
    assert row_weights.tolist() == [1.0, 0.5, 0.125, 4.0, 0.25, 0.0]
    assert position.tolist() == [[1, 4], [2, 0], [-1, 3]]
    assert passes.shape[0] == grouped.max_passes(4, 6, 2) == 7 and num_passes.tolist() == [4]
    assert passes.tolist() == [[0, 0, 1, 0], [1, 1, 2, 0], [1, 3, 1, 0], [3, 4, 1, 0]] + [[0, 0, 0, 0]] * 3


def _with_layouts(E, H, I, k, dtype=torch.float32):
    mod, _ = KbitExperts.from_weights(*random_experts(E, H, I, dtype), bits=k)
    mod.derive_gemm_layouts()
    return mod


@pytest.mark.parametrize("silu_gate", [True, False])
@pytest.mark.parametrize("k", KS)
def test_moe_gemm_reference_is_per_pass_product(k, silu_gate):
    E, H, I, T = 5, 64, 48, 11
    mod = _with_layouts(E, H, I, k)
    x, idx, w = torch.randn(T, H).half(), routing("unrouted", T, 2, E), torch.rand(T, 2)  # the GEMM's dtypes
    x_rows, row_weights, position, passes, num_passes = ops.moe_route(idx, w, E, 8)
    if silu_gate:
        got = ops.moe_gemm(x, mod.gate_up_gemm_codes, mod.gate_up_gemm_absmax, mod.codebook, mod.gate_up_scale, x_rows,
                           None, passes, num_passes, k, 2 * I, H, 8, True, 0)
    else:
        got = ops.moe_gemm(x[:, :I].contiguous(), mod.down_gemm_codes, mod.down_gemm_absmax, mod.codebook,
                           mod.down_scale, x_rows, row_weights, passes, num_passes, k, H, padded_in_features(I), 8,
                           False, 0)
    gate_up, down = mod.dequantize("gate_up"), mod.dequantize("down")
    routed = int((position >= 0).sum())
    for row in range(T * 2):
        if row >= routed:
            assert not bool(got[row].any()), "rows no pass covers are 0 in the reference"
            continue
        e = int(passes[(passes[:, 1] <= row) & (row < passes[:, 1] + passes[:, 2])][0, 0])
        xr = x[int(x_rows[row])].float()
        if silu_gate:
            g, u = (gate_up[e] @ xr).chunk(2)
            want = F.silu(g) * u
        else:
            want = down[e] @ xr[:I] * row_weights[row]
        torch.testing.assert_close(got[row].float(), want, rtol=2e-3, atol=1e-5)  # fp32 sums, rounded once to fp16


def test_combine_reference():
    y = torch.randn(6, 16, dtype=torch.float16)
    position = torch.tensor([[1, 4], [2, 0], [-1, 3]], dtype=torch.int32)
    out = ops.moe_combine(y, position)
    want = torch.stack([y[1].float() + y[4].float(), y[2].float() + y[0].float(), y[3].float()]).half()
    assert out.dtype == torch.float16 and torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)  # the GEMM's dtypes
@pytest.mark.parametrize("k", KS)
def test_grouped_forward_through_reference_ops(k, dtype):
    """The CUDA forward's Python side (route, fused gate/up, down with routing weights, combine) run through the
    ops' references (what the kernels must reproduce): each top-k once, each routing kind."""
    mod, T = cached_experts(k, dtype), 9
    for top_k, routing_kind in ((1, "random"), (2, "unrouted"), (4, "one_expert"), (6, "some_empty"), (8, "random")):
        x, idx, w = torch.randn(T, H_TEST).to(dtype), routing(routing_kind, T, top_k, E_TEST), torch.rand(T, top_k)
        with torch.no_grad():
            out = mod._forward_grouped(x, idx, w)
        assert out.shape == (T, H_TEST) and out.dtype == dtype
        check_close(out, reference_of(mod, x, idx, w), dtype, f"bits={k} {_name(dtype)} top_k={top_k} {routing_kind}")


def test_grouped_forward_with_another_activation():
    """A gate activation other than SiLU: the GEMM stores gate and up interleaved, Python applies the activation."""
    mod = _with_layouts(4, 64, 32, 4, torch.float16)
    mod.act_fn = nn.GELU()
    x, idx, w = torch.randn(5, 64).half(), routing("random", 5, 2, 4), torch.rand(5, 2)
    gate_up, down = mod.dequantize("gate_up", torch.float32), mod.dequantize("down", torch.float32)
    want = torch.zeros(5, 64)
    for t in range(5):
        for j in range(2):
            g, u = (gate_up[int(idx[t, j])] @ x[t].float()).chunk(2)
            want[t] += float(w[t, j]) * (down[int(idx[t, j])] @ (F.gelu(g) * u))
    with torch.no_grad():
        check_close(mod._forward_grouped(x, idx, w), want, torch.float16, "grouped, GELU")
        check_close(mod(x, idx, w), want, torch.float16, "forward, GELU")


def test_opcheck_moe_ops():
    mod = _with_layouts(4, 64, 32, 3)
    x, idx, w = torch.randn(6, 64).half(), routing("unrouted", 6, 2, 4), torch.rand(6, 2)
    torch.library.opcheck(ops.moe_route, (idx, w, 4, 8))
    x_rows, row_weights, position, passes, num_passes = ops.moe_route(idx, w, 4, 8)
    gu = (mod.gate_up_gemm_codes, mod.gate_up_gemm_absmax, mod.codebook, mod.gate_up_scale)
    torch.library.opcheck(ops.moe_gemm, (x, *gu, x_rows, None, passes, num_passes, 3, 64, 64, 8, True, 0))
    h = ops.moe_gemm(x, *gu, x_rows, None, passes, num_passes, 3, 64, 64, 8, True, 0)
    down = (mod.down_gemm_codes, mod.down_gemm_absmax, mod.codebook, mod.down_scale)
    torch.library.opcheck(ops.moe_gemm, (h, *down, None, row_weights, passes, num_passes, 3, 64, 32, 8, False, 0))
    torch.library.opcheck(ops.moe_combine, (torch.randn(12, 64).half(), position))


def test_compile_grouped_forward_fullgraph():
    """The grouped forward traces whole (fake implementations, no host synchronization in the graph)."""
    torch._dynamo.reset()
    mod = _with_layouts(6, 64, 32, 4, torch.float16)
    x, idx, w = torch.randn(7, 64).half(), routing("random", 7, 2, 6), torch.rand(7, 2)
    compiled = torch.compile(mod._forward_grouped, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, idx, w), mod._forward_grouped(x, idx, w))


# ----------------------------------------------------------------------------- save / load
def _state_round_trip(mod: KbitExperts, via: str) -> dict:
    state = mod.state_dict()
    assert all(isinstance(t, torch.Tensor) for t in state.values())
    if via == "torch":
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)
    st = pytest.importorskip("safetensors.torch")
    return st.load(st.save({k: v.contiguous() for k, v in state.items()}))


@pytest.mark.parametrize("via", ["torch", "safetensors"])
@pytest.mark.parametrize("k", KS)
def test_experts_save_load_round_trip(k, via):
    E, H, I = 5, 96, 64
    mod, _ = KbitExperts.from_weights(*random_experts(E, H, I, torch.float16), bits=k)
    loaded = _state_round_trip(mod, via)
    assert set(loaded) == {f"{p}_{s}" for p in ("gate_up", "down") for s in ("packed", "absmax", "scale")} | {
        "codebook", "meta"}
    for fresh in (KbitExperts(E, H, I, bits=k), KbitExperts(E, H, I, bits=k, device="meta")):
        fresh.load_state_dict(loaded, assign=fresh.gate_up_packed.is_meta)
        assert fresh.weight_dtype == torch.float16
        x, idx, w = torch.randn(7, H).half(), routing("random", 7, 2, E), torch.rand(7, 2)
        with torch.no_grad():
            assert torch.equal(fresh(x, idx, w), mod(x, idx, w))


def _corrupt(state: dict, case: str) -> tuple:
    state = dict(state)
    if case == "meta_k":
        state["meta"] = state["meta"].clone()
        state["meta"][0] += 1
        return state, "describes bits="
    if case == "meta_shape":
        state["meta"] = state["meta"][:4].clone()
        return state, "shape \\(5,\\)"
    if case == "scale_not_power_of_two":
        state["down_scale"] = state["down_scale"] * 3
        return state, "powers of two"
    if case == "scale_negative":
        state["gate_up_scale"] = -state["gate_up_scale"]
        return state, "powers of two"
    if case == "codebook_unsorted":
        state["codebook"] = state["codebook"].flip(0)
        return state, "ascending"
    if case == "packed_dtype":
        state["gate_up_packed"] = state["gate_up_packed"].to(torch.int64)
        return state, "gate_up_packed must be torch.int32"
    if case == "absmax_shape":
        state["down_absmax"] = state["down_absmax"][:, :-1].contiguous()
        return state, "down_absmax must be"
    if case == "not_contiguous":
        state["gate_up_absmax"] = state["gate_up_absmax"].t().contiguous().t()
        return state, "contiguous"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["meta_k", "meta_shape", "scale_not_power_of_two", "scale_negative",
                                  "codebook_unsorted", "packed_dtype", "absmax_shape", "not_contiguous"])
def test_experts_refuse_bad_checkpoints(case):
    E, H, I = 4, 64, 32
    mod, _ = KbitExperts.from_weights(*random_experts(E, H, I), bits=4)
    state, message = _corrupt(mod.state_dict(), case)
    fresh = KbitExperts(E, H, I, bits=4)
    before = {n: b.clone() for n, b in fresh.state_dict().items()}
    with pytest.raises(RuntimeError, match=message):
        fresh.load_state_dict(state)
    for name, t in fresh.state_dict().items():  # nothing was assigned
        assert torch.equal(t, before[name]), name


def test_experts_load_16_bit_codebook_and_scales():
    mod, _ = KbitExperts.from_weights(*random_experts(3, 64, 32), bits=4)
    state = {n: t.half() if n in ("codebook", "gate_up_scale", "down_scale") else t
             for n, t in mod.state_dict().items()}
    fresh = KbitExperts(3, 64, 32, bits=4)
    fresh.load_state_dict(state)
    assert fresh.codebook.dtype == torch.float32 and torch.equal(fresh.down_scale, mod.down_scale)


# ----------------------------------------------------------------------------- tiny transformers models
COMMON = dict(vocab_size=320, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              max_position_embeddings=256)
MOE = dict(intermediate_size=256, moe_intermediate_size=128, num_experts_per_tok=2)
MLA = dict(kv_lora_rank=64, q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(MOE, num_experts=8, shared_expert_intermediate_size=256)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(MOE, num_experts=8)),
    "deepseek_v2": ("DeepseekV2Config", dict(MOE, **dict(MLA, q_lora_rank=None), n_routed_experts=8, n_shared_experts=1,
                                             first_k_dense_replace=1, n_group=1, topk_group=1)),
    "deepseek_v3": ("DeepseekV3Config", dict(MOE, **MLA, n_routed_experts=8, n_shared_experts=1,
                                             first_k_dense_replace=1, n_group=1, topk_group=1)),
    "glm4_moe": ("Glm4MoeConfig", dict(MOE, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                                       n_group=1, topk_group=1)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(MOE, **MLA, n_routed_experts=8, n_shared_experts=1,
                                                first_k_dense_replace=1, n_group=1, topk_group=1)),
}


def tiny_moe(family: str, dtype=torch.float32) -> nn.Module:
    config_name, extra = FAMILIES[family]
    config_cls = getattr(transformers, config_name, None)
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**COMMON, **extra), dtype=dtype).eval()
    with torch.no_grad():  # non-trivial norms and router biases, so that a mix-up of tensors would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


# Every family in CI (-m slow); by default the plain one and the one with shared experts, dense first layers and MLA.
@pytest.fixture(scope="module", params=[f if f in ("qwen3_moe", "deepseek_v2") else pytest.param(f, marks=pytest.mark.slow)
                                        for f in FAMILIES])
def moe_pair(request):
    """(original fp32 model, K=4 quantized copy) per family."""
    torch.manual_seed(4321)
    model = tiny_moe(request.param)
    return model, kbit.quantize_model(copy.deepcopy(model), bits=4, progress=False)


def test_quantize_model_quantizes_every_expert(moe_pair):
    model, q = moe_pair
    fused = [n for n, _ in kbit.moe.find_experts(model)]
    assert fused, "the tiny model has fused experts"
    for name in fused:
        m = q.get_submodule(name)
        assert isinstance(m, KbitExperts), f"{name} is {type(m).__name__}"
        assert (m.num_experts, m.hidden_dim, m.intermediate_dim) == kbit.moe.experts_shape(model.get_submodule(name))
    assert not [n for n, p in q.named_parameters() if p.dim() >= 3], "a 3-D parameter stayed in full precision"
    linear_left = [n for n, m in q.named_modules() if type(m) is nn.Linear and n != "lm_head" and
                   min(m.in_features, m.out_features) >= 128]
    assert not linear_left
    # Embeddings and lm_head (320 x 128 each) are what stays; every expert and projection is quantized.
    assert kbit.quantized_fraction(q) > 0.75 and kbit.quantized_fraction(model) == 0.0


def dequantized_copy(model: nn.Module, quantized: nn.Module) -> nn.Module:
    """A copy of ``model`` with the weight of each layer ``quantized`` holds in kbit storage replaced by its
    reconstruction."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in quantized.named_modules():
            if isinstance(m, kbit.KbitLinear):
                ref.get_submodule(name).weight.copy_(m.dequantize(torch.float32))
            elif isinstance(m, KbitExperts):
                target = ref.get_submodule(name)
                target.gate_up_proj.copy_(m.dequantize("gate_up", torch.float32))
                target.down_proj.copy_(m.dequantize("down", torch.float32))
    return ref


def test_quantized_moe_matches_dequantized_reference(moe_pair):
    """The quantized model computes what the original computes with every weight replaced by its reconstruction."""
    model, q = moe_pair
    ids = torch.randint(0, COMMON["vocab_size"], (2, 9))
    a, b, full = logits(q, ids), logits(dequantized_copy(model, q), ids), logits(model, ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.equal(a, full)
    assert float((a - full).norm() / full.norm()) < 0.4


def test_quantized_moe_generates(moe_pair):
    _, q = moe_pair
    ids = torch.randint(0, COMMON["vocab_size"], (2, 5))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                  pad_token_id=0)
    out = q.generate(ids, **kwargs)
    assert out.shape == (2, 10) and torch.equal(out[:, :5], ids)
    assert torch.equal(out, q.generate(ids, **kwargs))


def test_quantized_moe_state_dict_round_trip(moe_pair):
    """state_dict (tensors only) into a model quantized from other weights: the same logits."""
    model, q = moe_pair
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    other = kbit.quantize_model(copy.deepcopy(model).apply(_perturb), bits=4, progress=False)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 6))
    assert not torch.equal(logits(other, ids), logits(q, ids))
    other.load_state_dict(state)
    assert torch.equal(logits(other, ids), logits(q, ids))


def _perturb(m: nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters(recurse=False):
            p.add_(torch.randn_like(p) * 0.01)


@pytest.mark.parametrize("k, dtype", [  # every pair in CI (-m slow)
    pytest.param(k, dtype, marks=() if (k, dtype) in ((4, torch.float16), (2, torch.bfloat16)) else pytest.mark.slow,
                 id=f"{k}-{_name(dtype)}") for k in KS for dtype in (torch.bfloat16, torch.float16)])
def test_quantize_model_16_bit_moe(k, dtype):
    model = tiny_moe("qwen3_moe", dtype)
    q = kbit.quantize_model(copy.deepcopy(model), bits=k, progress=False)
    experts = [m for m in q.modules() if isinstance(m, KbitExperts)]
    assert len(experts) == 2 and all(m.bits == k and m.weight_dtype == dtype for m in experts)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 4))
    out = logits(q, ids)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())


def test_quantize_model_skip_and_min_features_apply_to_experts():
    model = tiny_moe("mixtral")
    q = kbit.quantize_model(copy.deepcopy(model), bits=4, skip=("lm_head", "*.experts"), progress=False)
    assert not any(isinstance(m, KbitExperts) for m in q.modules())
    assert any(isinstance(m, kbit.KbitLinear) for m in q.modules())
    with pytest.warns(UserWarning, match="nothing to quantize.*10 narrower than min_features=129"):
        q = kbit.quantize_model(copy.deepcopy(model), bits=4, min_features=129, progress=False)
    assert not any(isinstance(m, KbitExperts) for m in q.modules())  # H = 128 < 129


def test_quantize_model_is_all_or_nothing_with_experts():
    model = tiny_moe("qwen3_moe")
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[3, 0, 0] = float("nan")
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts.*down_proj\[3\].*NaN"):
        kbit.quantize_model(model, bits=4, progress=False)
    assert not any(isinstance(m, (KbitExperts, kbit.KbitLinear)) for m in model.modules())
    for (n, a), (_, b) in zip(model.named_parameters(), before.named_parameters()):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), n


# ----------------------------------------------------------------------------- other expert layouts
class FusedExperts(nn.Module):
    """A transformers-5-style fused experts module; ``transposed`` stores [E, H, 2I] / [E, I, H] (Aria)."""

    def __init__(self, E, H, I, transposed=False, **flags):
        super().__init__()
        gate_up, down = random_experts(E, H, I)
        self.is_transposed = transposed
        self.gate_up_proj = nn.Parameter(gate_up.transpose(1, 2).contiguous() if transposed else gate_up)
        self.down_proj = nn.Parameter(down.transpose(1, 2).contiguous() if transposed else down)
        self.act_fn = nn.SiLU()
        self.__dict__.update(flags)


def test_transposed_fused_experts():
    mod = nn.ModuleDict({"experts": FusedExperts(6, 128, 128, transposed=True)})
    original = mod.experts
    kbit.quantize_model(mod, bits=5, progress=False)
    assert isinstance(mod.experts, KbitExperts)
    x, idx, w = torch.randn(9, 128), routing("random", 9, 2, 6), torch.rand(9, 2)
    with torch.no_grad():
        out = mod.experts(x, idx, w)
    check_close(out, experts_reference(mod.experts.dequantize("gate_up"), mod.experts.dequantize("down"), x, idx, w),
                torch.float32, "transposed experts")
    full = experts_reference(original.gate_up_proj.detach().transpose(1, 2),
                             original.down_proj.detach().transpose(1, 2), x, idx, w)
    assert float((out - full).norm() / full.norm()) < 0.2  # K = 5: ~5% weight error per projection


@pytest.mark.parametrize("flag", [{"has_bias": True}, {"has_gate": False}, {"is_concatenated": False},
                                  {"has_post_expert_norm": True}])
def test_unsupported_fused_experts_are_reported(flag):
    mod = nn.ModuleDict({"experts": FusedExperts(4, 128, 128, **flag),
                         "proj": nn.Linear(128, 128)})
    with pytest.warns(UserWarning, match=f"experts: FusedExperts has {next(iter(flag))}"):
        kbit.quantize_model(mod, bits=4, progress=False)
    assert type(mod.experts) is FusedExperts and isinstance(mod.proj, kbit.KbitLinear)
    assert kbit.quantized_fraction(mod) < 0.1


class OldExpert(nn.Module):
    """transformers 4.x per-expert MLP (MixtralBlockSparseTop2MLP): w1 gate, w3 up, w2 down."""

    def __init__(self, H, I):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)


def test_per_expert_linear_layout_is_quantized():
    """Older transformers keep one nn.Linear per expert projection: each becomes a KbitLinear; the router stays."""
    block = nn.ModuleDict({"gate": nn.Linear(128, 8, bias=False),
                           "experts": nn.ModuleList(OldExpert(128, 256) for _ in range(8))})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kbit.quantize_model(block, bits=4, progress=False)
    assert all(isinstance(getattr(e, n), kbit.KbitLinear) for e in block.experts for n in ("w1", "w2", "w3"))
    assert type(block.gate) is nn.Linear
    assert kbit.quantized_fraction(block) > 0.99


# ----------------------------------------------------------------------------- end-to-end benchmark
@pytest.mark.slow
def test_e2e_benchmark_runs_a_tiny_qwen3_moe(tmp_path):
    """benchmarks/bench_e2e.py --model qwen3-moe in its CPU smoke size: both rows built, kbit's experts quantized,
    the static-cache decode equal to model.generate."""
    import json

    bench = load_script("benchmarks/bench_e2e.py")
    argv = ["--device", "cpu", "--model", "qwen3-moe", "--layers", "2", "--hidden", "128", "--heads", "2",
            "--kv-heads", "1", "--head-dim", "64", "--experts", "8", "--top-k", "2", "--moe-intermediate", "128",
            "--vocab", "320", "--bits", "4", "--batch", "2", "--new-tokens", "2", "--repeats", "1", "--check",
            "--check-tokens", "6", "--strict-generate", "--out-dir", str(tmp_path), "--tag", "smoke"]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "e2e_smoke.json").read_text())
    assert [r["format"] for r in result["rows"]] == ["float32", "kbit K=4"]
    assert result["rows"][1]["resident_bytes"] < result["rows"][0]["resident_bytes"] / 2
    assert all(res["hf_generate_equals_eager"] for r in result["rows"] for res in r["batches"].values())


# ----------------------------------------------------------------------------- what is saved, pinned
def _exact_weights(shape, offset: int) -> torch.Tensor:
    """Values with no rounding anywhere (multiples of 1/256 from integers), so that the pins below hold on any
    platform: whatever kbit saves for them is fixed."""
    n = torch.arange(offset, offset + int(torch.Size(shape).numel()), dtype=torch.int64)
    return (((n * 37) % 29) - 14).to(torch.float32).reshape(shape) / 256


def _digest(state: dict, keys) -> str:
    """sha256 over each key of ``keys`` in order: its name, dtype, shape and bytes."""
    import hashlib

    h = hashlib.sha256()
    for key in keys:
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# The experts' state dict and a saved folder's experts entries of exact weights: any change to what is saved (keys,
# their order, dtypes, shapes or bytes) changes these digests.
PINNED_EXPERTS_STATE = "39d60e4a799768af68f2f6d72aee9738ebf9c346ff69632eee2b3eecb8698a50"
PINNED_FOLDER_EXPERTS = "1c67fdb03f15b8bed7a686a0472535f8af7dbc2be0490608d46cd6230a3d49fd"


def test_saved_experts_state_dict_is_pinned():
    E, H, I = 4, 72, 40
    gate_up, down = _exact_weights((E, 2 * I, H), 0), _exact_weights((E, H, I), 7)
    gate_up[1] *= 1024  # another per-tensor scale
    mod, _ = KbitExperts.from_weights(gate_up.to(torch.bfloat16), down.to(torch.bfloat16), bits=3)
    state = mod.state_dict()
    assert list(state) == ["gate_up_packed", "gate_up_absmax", "gate_up_scale", "down_packed", "down_absmax",
                           "down_scale", "codebook", "meta"]
    assert _digest(state, state) == PINNED_EXPERTS_STATE
    mod._hold_layout()  # GEMM-resident (what prepare does on CUDA): the same state derived from the layouts
    assert _digest(mod.state_dict(), state) == PINNED_EXPERTS_STATE


def test_saved_folder_experts_entries_are_pinned(tmp_path):
    from safetensors import safe_open

    model = tiny_moe("qwen3_moe")
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            p.copy_(_exact_weights(p.shape, 1000 * i))
    kbit.save_quantized(kbit.quantize_model(model, bits=4, progress=False), tmp_path)
    entries = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            entries.update((key, f.get_tensor(key)) for key in f.keys() if ".experts." in key)
    assert entries and all(key.rsplit(".", 1)[1] in STORAGE for key in entries)
    assert _digest(entries, sorted(entries)) == PINNED_FOLDER_EXPERTS


def test_moe_benchmark_peer_dequantizes_the_experts_storage():
    """bench_moe.py's dequantize + bf16 peer rebuilds every expert from the storage tensors it is handed (derived once,
    outside the timed calls) equal to the layer's own reconstruction."""
    bench = load_script("benchmarks/bench_moe.py")
    E, H, I = 4, 64, 96  # H and I not multiples of 256: the padded columns are cut off
    experts, _ = kbit.KbitExperts.from_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I), bits=3)
    for proj in ("gate_up", "down"):
        got = bench.dequantized(experts, proj, *experts.storage(proj))
        torch.testing.assert_close(got, experts.dequantize(proj, torch.bfloat16), rtol=0, atol=0)


def test_the_moe_ops_direct_forms_take_the_op_where_they_hold_no_kernel():
    """moe_route_direct / moe_gemm_direct / moe_combine_direct (KbitExperts' grouped forward, four calls a layer)
    hold the CUDA kernels (ops._direct; tests/test_moe_cuda.py runs them); on the CPU they run the op, its
    reference, equal to calling it."""
    E, H, I, T = 4, 64, 32, 5
    mod = _with_layouts(E, H, I, 4)
    x, idx, w = torch.randn(T, H).half(), routing("unrouted", T, 2, E), torch.rand(T, 2)
    routed = ops.moe_route_direct(idx, w, E, 8)
    assert all(torch.equal(a, b) for a, b in zip(routed, ops.moe_route(idx, w, E, 8)))
    x_rows, row_weights, position, passes, num_passes = routed
    args = (mod.gate_up_gemm_codes, mod.gate_up_gemm_absmax, mod.codebook, mod.gate_up_scale, x_rows, None, passes,
            num_passes, 4, 2 * I, H, 8, True, 0)
    h = ops.moe_gemm_direct(x, *args)
    assert torch.equal(h, ops.moe_gemm(x, *args))
    y = torch.randn(T * 2, H, dtype=torch.float16)
    assert torch.equal(ops.moe_combine_direct(y, position), ops.moe_combine(y, position))
