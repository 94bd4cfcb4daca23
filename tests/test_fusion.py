"""Sibling projections (q/k/v, gate/up) as one GEMM launch (kbit.fusion), on CPU through the reference ops.

On CPU a layer holds the storage format and runs its own GEMM; the tests here make the layers GEMM-resident by hand
(what ``prepare`` does on CUDA), so that the fused launch runs the reference ``kbit::gemm`` with a scale per row, and
compare it with each layer's own ``kbit::gemm``. The CUDA kernels' side is tests/test_fused_cuda.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import kbit
import kbit.fusion
from kbit.formats import create_normal_float_codebook
from kbit.hf import from_config

pytestmark = pytest.mark.usefixtures("one_thread")

transformers = pytest.importorskip("transformers")


def _gemm_resident(model: nn.Module) -> None:
    """What prepare() does on CUDA, on CPU by hand; then every layer's prepare(), which builds the groups."""
    layers = [m for m in model.modules() if isinstance(m, kbit.KbitLinear)]
    for layer in layers:
        layer._hold_layout()
    for layer in layers:
        layer.prepare()


class Attention(nn.Module):
    """Three projections of one input, of different widths (one past a 256-row block, one below it) and scales."""

    def __init__(self, hidden=96, widths=(300, 40, 256), bias=True):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, n, bias=bias) for n in widths)
        with torch.no_grad():  # per-tensor scales 2**a apart: the fused launch must apply each sibling's own
            self.k_proj.weight.mul_(16)
            self.v_proj.weight.mul_(1 / 8)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _fused_attention(bits=4, bias=True, **quantize):
    model = Attention(bias=bias).to(torch.bfloat16)
    kbit.quantize_model(model, bits=bits, min_features=1, skip=(), progress=False, **quantize)
    _gemm_resident(model)
    return model


def _count_gemms(monkeypatch) -> list:
    """The GEMM launches kbit's layers make (``ops.gemm_direct``: the op, or its kernel without the op's dispatch)."""
    calls = []
    real = kbit.ops.gemm_direct

    def counted(*args):
        calls.append(args[7])  # out_features
        return real(*args)

    monkeypatch.setattr(kbit.ops, "gemm_direct", counted)
    return calls


@pytest.mark.parametrize("bits,bias", [(2, True), (3, False), (4, True), (5, False)])
def test_fused_outputs_equal_each_layers_own_gemm_bit_for_bit(bits, bias, monkeypatch):
    model = _fused_attention(bits, bias)
    layers = (model.q_proj, model.k_proj, model.v_proj)
    group = model.q_proj._fusion
    assert group is not None and all(m._fusion is group for m in layers)
    assert len({float(m.scale) for m in layers}) == 3  # each sibling its own scale
    calls = _count_gemms(monkeypatch)
    for tokens in ((1,), (5,), (2, 33)):
        x = torch.randn(*tokens, 96, dtype=torch.bfloat16)
        calls.clear()
        got = model(x)
        assert calls == [512 + 256 + 256]  # one launch: q's 300 rows padded to 512, k's 40 to 256, then v's 256
        assert group._held is None  # the last sibling cleared the hold
        for y, m in zip(got, layers):
            want = kbit.matmul(x, m.qweight, m.bias)
            assert y.shape == want.shape and torch.equal(y, want)


def test_outputs_are_column_views_that_reshape_into_heads():
    model = _fused_attention()
    q, k, v = model(torch.randn(2, 3, 96, dtype=torch.bfloat16))
    stacked = model.q_proj._fusion._stacked
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()  # one result, no copies
    assert v.view(2, 3, 4, 64).stride() == (3 * stacked.rows, stacked.rows, 64, 1)  # transformers' .view(heads)


def test_stacked_layout_is_the_only_copy_and_state_dicts_are_per_projection():
    plain = Attention().to(torch.bfloat16)
    unfused = kbit.quantize_model(Attention().to(torch.bfloat16), bits=4, min_features=1, skip=(), progress=False,
                                  fuse_projections=False)
    unfused.load_state_dict(kbit.quantize_model(plain, bits=4, min_features=1, skip=(), progress=False,
                                                fuse_projections=False).state_dict())
    want = {key: t.clone() for key, t in unfused.state_dict().items()}
    _gemm_resident(unfused)
    assert unfused.q_proj._fusion is None
    own_bytes = sum(m.gemm_codes.nbytes + m.gemm_absmax.nbytes for m in (unfused.q_proj, unfused.k_proj,
                                                                         unfused.v_proj))
    assert kbit.fuse_projections(unfused) == 1
    stacked = unfused.q_proj._fusion._stacked
    for m in (unfused.q_proj, unfused.k_proj, unfused.v_proj):  # each layer's buffers: its rows of the stack
        assert m.gemm_codes.untyped_storage().data_ptr() == stacked.codes.untyped_storage().data_ptr()
        assert m.gemm_absmax.untyped_storage().data_ptr() == stacked.absmax.untyped_storage().data_ptr()
    assert stacked.codes.nbytes + stacked.absmax.nbytes == own_bytes
    got = unfused.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[key], want[key]) for key in want)


def test_siblings_that_differ_stay_separate(caplog):
    other = create_normal_float_codebook(4).flip(0).neg()  # the same levels, a different tensor
    other[1] += 1 / 64
    model = Attention().to(torch.bfloat16)
    kbit.quantize_model(model, bits=4, min_features=1, skip=(), progress=False)
    custom = kbit.quantize(model.k_proj.dequantize(), bits=4, codebook=other)
    model.k_proj = kbit.KbitLinear.from_quantized(custom, model.k_proj.bias)
    with caplog.at_level(logging.DEBUG, logger="kbit"):
        assert kbit.fuse_projections(model) == 0
    assert "codebooks differ" in caplog.text
    _gemm_resident(model)
    assert all(m._fusion is None for m in (model.q_proj, model.k_proj, model.v_proj))
    model = Attention().to(torch.bfloat16)
    kbit.quantize_model(model, bits={"k_proj": 3, "*": 4}, min_features=1, skip=(), progress=False)
    with caplog.at_level(logging.DEBUG, logger="kbit"):
        assert kbit.fuse_projections(model) == 0
    assert "bits differ" in caplog.text


def test_siblings_called_with_different_inputs_run_alone(monkeypatch, caplog):
    model = _fused_attention()
    x, other = torch.randn(2, 96, dtype=torch.bfloat16), torch.randn(2, 96, dtype=torch.bfloat16)
    calls = _count_gemms(monkeypatch)
    q = model.q_proj(x)
    with caplog.at_level(logging.DEBUG, logger="kbit"):
        k = model.k_proj(other)  # cross-attention's pattern: the group turns itself off
    assert "not called with one input" in caplog.text
    v = model.v_proj(other)
    assert not model.q_proj._fusion.enabled and model.q_proj._fusion._held is None
    assert calls == [1024, 40, 256]  # the fused launch, then k and v alone
    for y, m, inp in ((q, model.q_proj, x), (k, model.k_proj, other), (v, model.v_proj, other)):
        assert torch.equal(y, kbit.matmul(inp, m.qweight, m.bias))
    kbit.fuse_projections(model)  # grouped afresh
    calls.clear()
    model(x)
    assert len(calls) == 1


def test_switch_and_config():
    assert kbit.fusion.FUSE_BY_DEFAULT is True
    model = _fused_attention(fuse_projections=False)
    assert model.q_proj._fusion is None
    assert kbit.fuse_projections(model) == 1 and model.q_proj._fusion._stacked is not None
    assert kbit.fuse_projections(model, enabled=False) == 0 and model.q_proj._fusion is None
    with pytest.raises(TypeError, match="fuse_projections must be a bool"):
        kbit.quantize_model(Attention(), fuse_projections="yes", progress=False)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        kbit.fuse_projections(model, enabled=1)
    config = kbit.KbitConfig(bits=4)
    assert config.fuse_projections is True and kbit.KbitConfig(fuse_projections=False).fuse_projections is False
    assert "fuse_projections" not in config.to_dict()  # how it runs, not how it is stored
    with pytest.raises(TypeError, match="fuse_projections must be a bool"):
        kbit.KbitConfig(fuse_projections=None)


def test_moves_and_loads_keep_one_stacked_copy():
    model = _fused_attention()
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    want = model(x)
    group = model.q_proj._fusion
    stacked = group._stacked
    # A layer given its own layout (what load_state_dict and a move do on CUDA): its rows go back into the same stack.
    k = model.k_proj
    k.gemm_codes, k.gemm_absmax = k.gemm_codes.clone(), k.gemm_absmax.clone()
    k.prepare()
    assert group._stacked is stacked and k.gemm_codes.untyped_storage().data_ptr() == stacked.codes.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(model(x), want))
    state = {key: t.clone() for key, t in model.state_dict().items()}
    model.q_proj.load_state_dict({key[len("q_proj."):]: t for key, t in state.items() if key.startswith("q_proj.")})
    assert group._stacked is stacked and not group.launching  # on CPU q holds its storage: each layer alone
    model.load_state_dict(state)  # none resident any more: the stack is dropped
    assert group._stacked is None
    _gemm_resident(model)
    assert model.k_proj.gemm_codes.untyped_storage().data_ptr() == group._stacked.codes.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(model(x), want))
    model.to("cpu")  # off the layout: storage format (the CPU kernel's rounding), and the stack is dropped
    assert group._stacked is None and not model.q_proj.is_gemm_resident
    for got, expected in zip(model(x), want):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_gradients_flow_through_the_fused_launch():
    model = _fused_attention()
    x = torch.randn(4, 96, dtype=torch.bfloat16, requires_grad=True)
    sum(y.float().square().sum() for y in model(x)).backward()
    fused_grad, bias_grads = x.grad.clone(), [m.bias.grad.clone() for m in (model.q_proj, model.k_proj, model.v_proj)]
    kbit.fuse_projections(model, enabled=False)
    x.grad = None
    for m in (model.q_proj, model.k_proj, model.v_proj):
        m.bias.grad = None
    sum(y.float().square().sum() for y in model(x)).backward()
    # One backward GEMM over the stacked rows against three summed: bf16 roundings of large terms in another order,
    # so the tolerance follows the gradient's scale (an element where the terms cancel is small, its error is not).
    scale = x.grad.abs().max().item()
    torch.testing.assert_close(fused_grad, x.grad, rtol=1e-2, atol=1e-2 * scale)
    for got, m in zip(bias_grads, (model.q_proj, model.k_proj, model.v_proj)):
        assert torch.equal(got, m.bias.grad)


# ---------------------------------------------------------------------------------------------- transformers models
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def _tiny(family: str, layers: int = 2):
    configs = {
        "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
        "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(moe_intermediate_size=64, num_experts=4,
                                                                     num_experts_per_tok=2)),
    }
    model_name, config_name, extra = configs[family]
    config = getattr(transformers, config_name)(**{**COMMON, "num_hidden_layers": layers}, **extra)
    model = from_config(getattr(transformers, model_name), config, dtype=torch.bfloat16).eval()
    kbit.quantize_model(model, bits=4, min_features=16, progress=False)
    _gemm_resident(model)
    return model


def _greedy(model, ids, new_tokens=4):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_tokens_fused_equal_unfused(family, monkeypatch):
    model = _tiny(family)
    groups = {id(m._fusion) for m in model.modules() if isinstance(m, kbit.KbitLinear) and m._fusion is not None}
    assert len(groups) == (2 if family == "qwen3_moe" else 4)  # q/k/v per layer; gate/up where the MLP is dense
    ids = torch.randint(1, COMMON["vocab_size"], (2, 5))
    calls = _count_gemms(monkeypatch)
    fused = _greedy(model, ids)
    fused_calls = len(calls)
    kbit.fuse_projections(model, enabled=False)
    calls.clear()
    unfused = _greedy(model, ids)
    assert torch.equal(fused, unfused)
    saved = (2 if family == "qwen3_moe" else 3) * 2  # per forward: 2 of q/k/v, 1 of gate/up, per layer
    assert len(calls) - fused_calls == saved * 4  # four forwards (prefill and three steps)


@pytest.mark.slow
def test_compiled_forward_fuses_without_graph_breaks():
    model = _tiny("qwen3", layers=1)
    ids = torch.randint(1, COMMON["vocab_size"], (1, 6))
    gemms = []

    def backend(gm, example_inputs):
        gemms.append(sum(node.target is torch.ops.kbit.gemm.default for node in gm.graph.nodes))
        return gm.forward

    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend=backend, fullgraph=True)(ids).logits  # fullgraph: a break would raise
    assert torch.equal(got, want)
    assert gemms == [4]  # q/k/v, o, gate/up, down: 7 separately
    assert all(m._fusion._held is None for m in model.modules() if isinstance(m, kbit.KbitLinear) and m._fusion)


def test_gemm_takes_one_scale_per_256_rows_and_refuses_other_lengths():
    model = _fused_attention()
    stacked = model.q_proj._fusion._stacked
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    K = model.q_proj.qweight.in_features_padded
    args = (stacked.codes, stacked.absmax, model.q_proj.codebook)
    assert stacked.block_scale.shape == (4,)  # q: 2 blocks, k: 1, v: 1
    y = kbit.ops.gemm(x, *args, stacked.block_scale, None, 4, stacked.rows, K, 0)
    assert y.shape == (2, 1024)
    bias = torch.randn(stacked.rows).to(torch.bfloat16)
    # fake implementation, autograd registration (x and bias through the per-block scale) and schema
    torch.library.opcheck(kbit.ops.gemm, (x.requires_grad_(), *args, stacked.block_scale, bias, 4, stacked.rows, K, 0))
    for bad in (torch.ones(1024), torch.ones(3), torch.ones(2, 2)):
        with pytest.raises(ValueError, match="scale must hold one float32 or one per 256 output rows"):
            kbit.ops.gemm(x, *args, bad, None, 4, stacked.rows, K, 0)


def test_each_layer_moves_into_the_stack_as_it_becomes_gemm_resident():
    model = Attention().to(torch.bfloat16)
    kbit.quantize_model(model, bits=4, min_features=1, skip=(), progress=False)
    group = model.q_proj._fusion
    assert group._stacked is None  # on CPU: storage format, no stack
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    want = [kbit.matmul(x, m.qweight, m.bias) for m in group.members]
    for i, m in enumerate(group.members):
        m._hold_layout()
        m.prepare()  # its own layout copied into its rows of the stack, made at the first one: one copy held
        assert m.gemm_codes is group._stacked.views[i][0] and m.gemm_absmax is group._stacked.views[i][1]
        assert group.launching == (i == 2)  # one launch once all three are in
    for got, expected in zip(model(x), want):
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)  # the CPU kernel's rounding against the op's


def test_a_group_made_before_loading_lets_its_layers_go_when_a_late_one_differs():
    """A kbit folder's layers are grouped before their tensors arrive (kbit.hf.quantizer); when the last to arrive cannot
    share the launch (another codebook), those already in the stack take their own copies and the stack goes."""
    model = Attention().to(torch.bfloat16)
    kbit.quantize_model(model, bits=4, min_features=1, skip=(), progress=False)
    group = model.q_proj._fusion
    other = model.k_proj.codebook.clone()
    other[1] += 1 / 64
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    for i, m in enumerate(group.members[:2]):
        if i == 1:  # arrives with another codebook (on CUDA the others wait on meta, unchecked, until then)
            m.codebook = other
            want = [kbit.matmul(x, m.qweight, m.bias) for m in group.members]
        m._hold_layout()
        m.prepare()
        assert (group._stacked is None) == (i == 1)
    q = model.q_proj
    assert q.gemm_codes._base is None and q.gemm_absmax._base is None  # its own tensors, not rows of a stack
    for got, expected in zip(model(x), want):
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_an_input_written_in_place_between_siblings_is_a_new_input():
    model = _fused_attention()
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    model.q_proj(x)
    x.mul_(2)
    k = model.k_proj(x)
    assert not model.q_proj._fusion.enabled
    assert torch.equal(k, kbit.matmul(x, model.k_proj.qweight, model.k_proj.bias))


def test_a_member_layout_assigned_by_hand_runs_the_group_alone_until_its_prepare(monkeypatch):
    """The fused launch reads the stack, not the members' buffers: a layout assigned to a member (a copy of the same
    values here) takes the group off the stack until that member's prepare() copies it in."""
    model = _fused_attention()
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    want = [kbit.matmul(x, m.qweight, m.bias) for m in (model.q_proj, model.k_proj, model.v_proj)]
    calls = _count_gemms(monkeypatch)
    model.k_proj.gemm_codes = model.k_proj.gemm_codes.clone()
    got = model(x)
    assert len(calls) == 3
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    model.k_proj.prepare()
    calls.clear()
    got = model(x)
    assert calls == [model.q_proj._fusion._stacked.rows]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("rotate", [False, True])
def test_gemm_resident_layers_multiply_from_their_buffers_not_their_weight_views(rotate, monkeypatch):
    """A GEMM-resident layer (fused or alone) multiplies from its buffers, read once from its dicts: an eager call
    pays host time for every step through the QuantizedWeight view, and a compiled graph checks a guard for every
    object its trace read, at every call (the view doubles the tensors). Eager equals kbit.matmul's product of the
    view and compiled equals eager, bit for bit; neither reads the view."""
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1})
    model = from_config(transformers.LlamaForCausalLM, config, dtype=torch.bfloat16).eval()
    kbit.quantize_model(model, bits=4, min_features=16, rotate=rotate, progress=False)
    _gemm_resident(model)
    layers = [m for m in model.modules() if isinstance(m, kbit.KbitLinear)]
    assert any(m._fusion is None for m in layers)  # o_proj, down_proj
    x = torch.randn(3, COMMON["hidden_size"], dtype=torch.bfloat16)
    for layer in (m for m in layers if m._fusion is None and m.in_features == COMMON["hidden_size"]):
        rotated = x if layer.rotation is None else layer.rotation.rotate(x)
        want_layer = kbit.matmul(rotated, layer.qweight, layer.bias)
        with monkeypatch.context() as patch:
            patch.setattr(kbit.KbitLinear, "qweight", property(_no_view))
            assert torch.equal(layer(x), want_layer)
    ids = torch.randint(1, COMMON["vocab_size"], (1, 6))
    with torch.no_grad():
        want = model(ids).logits
    monkeypatch.setattr(kbit.KbitLinear, "qweight", property(_no_view))
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
        got = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
    assert torch.equal(got, want)


def _no_view(self):
    raise AssertionError("a layer's product read its QuantizedWeight view")
