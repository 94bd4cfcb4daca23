"""Sibling projections as one GEMM launch on the GPU (kbit.fusion; skipped without CUDA).

* The GEMM with a scale per 256-row block (``GemmParams::row_scales``) gives, for each block, bit for bit what the
  same launch gives with that block's projection's per-tensor scale: every fused path (KBIT_GEMM_PATH) at 1, 16, 256
  and 2048 tokens, K = 2..5, with split-K forced, bias or none. Against separate launches of each projection (other
  shapes, so other cuts of the fp32 sums): within the rounding of the last bits.
* Greedy decoding with fused projections gives the tokens of separate ones (tiny Llama, tiny Qwen3), eager and
  compiled (``mode="reduce-overhead"``, CUDA graphs).
* Fusing allocates nothing but the block scales (4 bytes per 256 rows); state dicts stay per projection, bit for bit.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import kbit
from kbit import ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
]

KS = (2, 3, 4, 5)
PATHS = (None, "mma_sync", "k_split", "wgmma", "ws")  # None: the planner's choice
TOKENS = (1, 16, 256, 2048)


class Attention(nn.Module):
    """Three projections of one input: rows past a 256-row block and below one, per-tensor scales 2**a apart."""

    def __init__(self, hidden=1024, widths=(1000, 256, 300), bias=True):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, n, bias=bias) for n in widths)
        with torch.no_grad():
            self.k_proj.weight.mul_(16)
            self.v_proj.weight.mul_(1 / 8)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _fused(bits, bias=True, dtype=torch.float16):
    model = Attention(bias=bias).to(dtype)
    kbit.quantize_model(model, bits=bits, min_features=1, skip=(), progress=False)
    model.cuda()
    group = model.q_proj._fusion
    assert group is not None and group._stacked is not None  # built once all three landed on the GPU
    return model, group


@pytest.mark.parametrize("k", KS)
def test_block_scales_equal_per_tensor_scales_bit_for_bit(k, monkeypatch):
    model, group = _fused(k)
    st = group._stacked
    layers = group.members
    K = layers[0].qweight.in_features_padded
    bias = group._bias(torch.float16)
    assert len({float(m.scale) for m in layers}) == 3
    failures = []
    for path in PATHS:
        if path is None:
            monkeypatch.delenv("KBIT_GEMM_PATH", raising=False)
        else:
            monkeypatch.setenv("KBIT_GEMM_PATH", path)
        for M in TOKENS:
            x = torch.randn(M, 1024, device="cuda", dtype=torch.float16)
            for grid in (0, 5):  # planned, and 5 CTAs: tiles split across CTAs (partials summed)
                for b in (bias, None):
                    fused = ops.gemm(x, st.codes, st.absmax, layers[0].codebook, st.block_scale, b, k, st.rows, K,
                                     grid)
                    for m, offset in zip(layers, st.offsets):
                        alone = ops.gemm(x, st.codes, st.absmax, m.codebook, m.scale, b, k, st.rows, K, grid)
                        cols = slice(offset, offset + m.out_features)
                        if not torch.equal(fused[:, cols], alone[:, cols]):
                            diff = (fused[:, cols].float() - alone[:, cols].float()).abs().max().item()
                            failures.append(f"path={path} M={M} grid={grid} bias={b is not None} rows at {offset}: "
                                            f"max |diff| {diff:.3g}")
    assert not failures, f"K={k}:\n  " + "\n  ".join(failures)


@pytest.mark.parametrize("k", KS)
def test_fused_layers_match_separate_launches(k):
    model, group = _fused(k)
    for M in TOKENS:
        x = torch.randn(M, 1024, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            fused = model(x)
            assert group._held is None
            separate = [kbit.matmul(x, m.qweight, m.bias) for m in group.members]
        for got, want in zip(fused, separate):
            # The same products; the launch's shape may cut the fp32 sums differently (kbit.fusion).
            torch.testing.assert_close(got, want, rtol=4e-3, atol=4e-3)


def _tiny(family):
    transformers = pytest.importorskip("transformers")
    from kbit.hf import from_config

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)
    cls, config = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)),
                   "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common))}[family]
    torch.manual_seed(11)
    with torch.device("cuda"):
        model = from_config(cls, config, dtype=torch.float16, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    kbit.quantize_model(model, bits=4, progress=False)
    groups = {id(m._fusion) for m in model.modules() if isinstance(m, kbit.KbitLinear) and m._fusion is not None}
    assert len(groups) == 4
    return model


def _greedy(model, prompt, tokens, **kwargs):
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[:, prompt.shape[1]:]


def _same_or_near_tie(model, prompt, got, want, tol):
    """The tokens are equal, or the first divergence is at a near tie of ``model``'s top two logits (the fused and
    separate launches may round a last bit differently)."""
    if torch.equal(got, want):
        return
    first = int((got != want).any(0).nonzero()[0])
    with torch.no_grad():
        logits = model(torch.cat([prompt, want[:, :first]], dim=1)).logits[:, -1].float()
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1]).min().item()
    assert gap <= tol, f"tokens diverge at step {first} where the top-2 logit gap is {gap:.3g}"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_decode_fused_equals_unfused(family):
    model = _tiny(family)
    prompt = torch.randint(1, 512, (2, 12), device="cuda")
    fused = _greedy(model, prompt, 24)
    kbit.fuse_projections(model, enabled=False)
    unfused = _greedy(model, prompt, 24)
    _same_or_near_tie(model, prompt, fused, unfused, tol=2e-2)
    print(f"{family}: fused == unfused: {torch.equal(fused, unfused)}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compiled_decode_fused_equals_unfused(family):
    """transformers' static-cache fast path, the decode step compiled with fullgraph=True (a graph break raises) and
    mode="reduce-overhead" (CUDA graphs): the holds between siblings are data flow inside the graph, nothing is kept
    between steps, and the tokens are those of the eager fused model and of the compiled unfused one."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = _tiny(family)
    prompt = torch.randint(1, 512, (2, 12), device="cuda")
    eager_fused = _greedy(model, prompt, 16)
    model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    torch._dynamo.utils.counters.clear()
    compiled_fused = _greedy(model, prompt, 16, cache_implementation="static")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "generate did not compile the decode step"
    assert torch.equal(_greedy(model, prompt, 16, cache_implementation="static"), compiled_fused)  # replayed
    assert all(m._fusion._held is None for m in model.modules() if isinstance(m, kbit.KbitLinear) and m._fusion)
    _same_or_near_tie(model, prompt, compiled_fused, eager_fused, tol=5e-2)
    torch._dynamo.reset()
    kbit.fuse_projections(model, enabled=False)
    compiled_unfused = _greedy(model, prompt, 16, cache_implementation="static")
    _same_or_near_tie(model, prompt, compiled_fused, compiled_unfused, tol=5e-2)


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_fusing_allocates_only_the_block_scales_and_keeps_state_dicts():
    model = _tiny("llama").cpu()
    kbit.fuse_projections(model, enabled=False)
    cpu_state = {key: t.clone() for key, t in model.state_dict().items()}
    base = _allocated()
    model.cuda()  # ungrouped: each layer its own layout
    unfused = _allocated() - base
    kbit.fuse_projections(model)
    fused = _allocated() - base
    groups = {m._fusion for m in model.modules() if isinstance(m, kbit.KbitLinear) and m._fusion is not None}
    assert len(groups) == 4 and all(g._stacked is not None for g in groups)
    assert 0 <= fused - unfused <= 512 * len(groups)  # one block-scale vector per group (an allocator block each)
    for g in groups:
        for m, (codes, absmax) in zip(g.members, g._stacked.views):
            assert m.gemm_codes is codes and m.gemm_absmax is absmax
    got = model.state_dict()
    assert list(got) == list(cpu_state)
    assert all(torch.equal(got[key].cpu(), cpu_state[key]) for key in cpu_state)
    # Loading on the GPU: each layer's new layout goes back into its rows of the same stack (addresses kept).
    q = model.model.layers[0].self_attn.q_proj
    address = q.gemm_codes.data_ptr()
    model.load_state_dict(cpu_state)
    assert q.gemm_codes.data_ptr() == address and abs(_allocated() - base - fused) <= 4096
    print(f"tiny Llama on the GPU: unfused {unfused} B, fused {fused} B")
