"""Quantization methods (kbit.methods, kbit.calibration) and quantize_model(method=..., calibration=...).

What is checked, against references that do not share the code under test:

* Every method's output is valid storage (it loads through the checks for untrusted checkpoints) and its
  reference dequantization is what the method claims: nearest codes for the stored block scales, by the
  format's own rule (``formats.nearest_codes``).
* ``"mse"`` is never worse than plain rounding on any block and clearly better in total; its fitted codebook
  beats normal-float on non-Gaussian weights.
* ``"gptq"`` reproduces a naive GPTQ written from the paper's formulas (explicit inverse-Hessian updates in
  float64, no lazy batches, no Cholesky), and lowers the layer's output error below ``"mse"``'s; its codebook
  refit is the least-squares codebook for the codes (a solve written with the Cholesky factor of H).
* Hessians are ``2 X^T X / n`` of each layer's input; block-by-block calibration leaves the model's weights
  untouched; ``quantize_model`` on small transformers (Llama and BERT from configs) with each method.
* On CUDA (skipped without): dequantize and the fused GEMM on method outputs match the CPU reference.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import kbit
from kbit import calibration, formats, methods
from kbit.formats import BLOCK_SIZE, decode_absmax_e4m4, unpack_bitplanes

from repo_script import load_script


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors (conftest.py)


def _stored_codes(qw):
    return unpack_bitplanes(qw.packed, qw.bits).reshape(qw.shape[0], -1)


def _block_scales(qw):
    return (decode_absmax_e4m4(qw.absmax) * qw.scale).reshape(qw.shape[0], -1)


def _blocks_error(W, qw):
    """Squared error per block [N, K_pad / 32] of the reference dequantization."""
    N, K = W.shape
    err = (kbit.dequantize(qw, torch.float32) - W.float()) ** 2
    in_features_padded = formats.padded_in_features(K)
    return nn.functional.pad(err, (0, in_features_padded - K)).reshape(N, -1, BLOCK_SIZE).sum(-1)


def _correlated_inputs(n: int, K: int, seed: int = 0):
    """Activations with a few dominant directions and uneven channel scales, as in real layers."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(K, K, generator=g) / math.sqrt(K)
    scales = torch.exp(torch.randn(K, generator=g))
    return (torch.randn(n, K, generator=g) * scales) @ basis


def _hessian(X):
    return 2 * X.T @ X / X.shape[0]


# ----------------------------------------------------------------------------- storage and claims
@pytest.mark.parametrize("method", ["mse", "gptq"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_output_is_valid_storage_with_nearest_codes(method, k):
    N, K = 24, 80  # K % 32 != 0: a padded last block
    W = torch.randn(N, K, dtype=torch.float16) * 0.05
    H = _hessian(_correlated_inputs(256, K)) if method == "gptq" else None
    qw = methods.quantize_tensor(W, k, method, hessian=H)
    loaded = kbit.QuantizedWeight.from_state_dict(qw.state_dict())  # every check an untrusted checkpoint gets
    assert loaded.codebook.numel() == 2**k and float(loaded.codebook.abs().max()) == 1.0
    assert bool((loaded.codebook[1:] > loaded.codebook[:-1]).all())
    if method == "mse":  # codes are the format's nearest codes for the stored scales
        x = formats.blocks_of(nn.functional.pad(W, (0, 96 - K)), qw.scale)
        want = formats.nearest_codes(x, decode_absmax_e4m4(qw.absmax), qw.codebook)
        assert torch.equal(_stored_codes(qw).reshape(-1, BLOCK_SIZE), want)
    # the reference dequantization is codebook[code] * block scale, cut to K columns
    want = (qw.codebook[_stored_codes(qw)] * _block_scales(qw).repeat_interleave(BLOCK_SIZE, 1))[:, :K]
    assert torch.equal(kbit.dequantize(qw, torch.float32), want)


def test_rtn_is_kbit_quantize():
    W = torch.randn(16, 64)
    a, b = methods.quantize_tensor(W, 3, "rtn"), kbit.quantize(W, 3)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.absmax, b.absmax)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_mse_never_worse_than_rtn_per_block(k):
    W = torch.randn(64, 256) * torch.rand(64, 1)  # rows of different magnitude
    W[3, 7] = 5.0  # an outlier block
    nf = formats.create_normal_float_codebook(k)
    rtn = kbit.quantize(W, k)
    mse = methods.quantize_tensor(W, k, "mse", codebook=nf)
    e_rtn, e_mse = _blocks_error(W, rtn), _blocks_error(W, mse)
    assert bool((e_mse <= e_rtn * (1 + 1e-6) + 1e-12).all())
    assert float(e_mse.sum()) < 0.93 * float(e_rtn.sum())  # measured 0.79 (K=2) .. 0.86 (K=5)


def test_mse_scale_is_best_of_its_candidates():
    """Brute force over every E4M4 code in the search range: the coarse-to-fine search (every other code, then
    the neighbours of the best) stays close to the exhaustive optimum."""
    k = 3
    x = torch.randn(2000, BLOCK_SIZE)
    cb = formats.create_normal_float_codebook(k)
    chosen = methods.search_block_scales(x, cb, k)
    base = formats.encode_absmax_e4m4(x.abs().amax(1)).long()

    def err(code):
        d = decode_absmax_e4m4(code.clamp(0, 255).to(torch.uint8))
        return ((x - cb[formats.nearest_codes(x, d, cb)] * d[:, None]) ** 2).sum(1)

    best = torch.stack([err(base + o) for o in range(-methods.SEARCH_DOWN[k], 2)]).min(0).values
    got = err(chosen.long())
    assert float((got <= best * (1 + 1e-6)).float().mean()) > 0.9  # most blocks get the exhaustive optimum
    assert float(got.sum()) <= 1.005 * float(best.sum())


def test_fitted_codebook_beats_normal_float_on_skewed_weights():
    W = torch.empty(128, 256).exponential_() - 0.5  # skewed, unlike the symmetric normal-float levels
    nf = methods.quantize_tensor(W, 3, "mse", codebook=formats.create_normal_float_codebook(3))
    fit = methods.quantize_tensor(W, 3, "mse")
    assert not torch.equal(fit.codebook, nf.codebook)
    assert torch.equal(fit.codebook.half().float(), fit.codebook)  # fp16 levels: what the fp16 kernel's tables hold
    assert float(_blocks_error(W, fit).sum()) < 0.8 * float(_blocks_error(W, nf).sum())  # measured 0.68-0.70


def test_mse_keeps_reconstruction_finite_near_dtype_max():
    W = torch.full((2, 32), 65000.0, dtype=torch.float16)
    W[:, ::2] = -64000.0
    qw = methods.quantize_tensor(W, 2, "mse")
    assert bool(torch.isfinite(kbit.dequantize(qw)).all())


# ----------------------------------------------------------------------------- gptq
def _naive_gptq(W, H, cb, k, damp=methods.GPTQ_DAMP):
    """GPTQ from its formulas, in float64: quantize column j, spread its error with the inverse Hessian of the
    columns not yet quantized, then remove j from that inverse (its Schur complement). Block scales are chosen
    by kbit's search (under test separately) on the updated weights when a block starts, weighting each column
    by 1 / [H^-1]_jj of the step where that column is quantized."""
    N, K = W.shape
    scale = formats.choose_tensor_scale(W.abs().amax())
    x = (W.double() / scale.double()).clone()
    H = H.double().clone()
    H += damp * H.diagonal().mean() * torch.eye(K, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    # the weight of column j: 1 / (its diagonal of H^-1 after eliminating the columns before it)
    cost, h = torch.empty(K, dtype=torch.float64), Hinv.clone()
    for j in range(K):
        cost[j] = 1.0 / h[j, j]
        h = h - torch.outer(h[:, j], h[j, :]) / h[j, j]
    cost = (cost / cost.mean()).float()
    codes = torch.empty(N, K, dtype=torch.int64)
    cb64 = cb.double()
    for j in range(K):
        if j % BLOCK_SIZE == 0:
            absmax = methods.search_block_scales(x[:, j:j + BLOCK_SIZE].float().contiguous(), cb, k,
                                                 cost[j:j + BLOCK_SIZE])
            d = decode_absmax_e4m4(absmax).double()
        codes[:, j] = formats.nearest_codes(x[:, j:j + 1].float().expand(-1, BLOCK_SIZE).contiguous(),
                                            d.float(), cb)[:, 0]
        e = (x[:, j] - cb64[codes[:, j]] * d) / Hinv[j, j]
        x[:, j + 1:] -= torch.outer(e, Hinv[j, j + 1:])
        Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
    return codes


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_matches_naive_reference(act_order):
    N, K, k = 48, 256, 3  # K > GPTQ_BATCH: lazy batches and the update of later columns both run
    W = torch.randn(N, K) * 0.02
    H = _hessian(_correlated_inputs(512, K))
    cb = formats.create_normal_float_codebook(k)
    qw = methods.quantize_gptq(W, H, k, codebook=cb, act_order=act_order)
    got = _stored_codes(qw)
    # activation order is the naive GPTQ of the permuted problem, codes permuted back
    perm = methods.block_order(torch.diagonal(H)) if act_order else torch.arange(K)
    want = torch.empty_like(got)
    want[:, perm] = _naive_gptq(W[:, perm], H[perm][:, perm], cb, k)
    assert float((got == want).float().mean()) > 0.98  # float32 vs float64: rare flips at level midpoints


def test_refine_block_scales_lowers_output_error():
    """With the codes kept, the refined block scales lower ``tr(dW H dW^T)`` (never raise it) and change only by
    a few E4M4 steps."""
    N, K, k = 32, 192, 3
    x = torch.randn(N, K)
    H = _hessian(_correlated_inputs(512, K))
    cb = formats.create_normal_float_codebook(k)
    blocks = x.reshape(-1, BLOCK_SIZE)
    absmax = formats.encode_absmax_e4m4(blocks.abs().amax(dim=1))
    codes = formats.nearest_codes(blocks, decode_absmax_e4m4(absmax), cb).reshape(N, K)
    absmax = absmax.reshape(N, -1)

    def out_err(a):
        xh = cb[codes] * decode_absmax_e4m4(a).repeat_interleave(BLOCK_SIZE, dim=1)
        r = (x - xh).double()
        return float((r @ H.double() * r).sum())

    refined = methods.refine_block_scales(x, codes, absmax, cb, H, limit=formats.E4M4_MAX)
    assert out_err(refined) < 0.97 * out_err(absmax)
    steps = (refined.to(torch.int32) - absmax.to(torch.int32)).abs()
    assert int(steps.max()) <= 2 * methods.REFINE_SWEEPS and bool((steps > 0).any())


def _out_err(x, codes, absmax, cb, H):
    xh = cb[codes] * decode_absmax_e4m4(absmax).repeat_interleave(BLOCK_SIZE, dim=1)
    r = (x - xh).double()
    return float((r @ H.double() * r).sum())


def _nearest_with(x, cb):
    """(codes [N, K], block scale codes [N, K / 32]) of ``x``: absmax scales and nearest codes for ``cb``."""
    blocks = x.reshape(-1, BLOCK_SIZE)
    absmax = formats.encode_absmax_e4m4(blocks.abs().amax(dim=1))
    codes = formats.nearest_codes(blocks, decode_absmax_e4m4(absmax), cb)
    return codes.reshape(x.shape), absmax.reshape(x.shape[0], -1)


def test_refit_codebook_is_the_least_squares_codebook(monkeypatch):
    """With codes and block scales kept, the refitted levels minimize ``tr(dW H dW^T)``: they match a least-squares
    solve over the levels (written as ``||(x - x_hat) L||``, ``H = L L^T``, the level at 1 held there) up to the
    levels' fp16 rounding, and lower the error."""
    N, K, k = 256, 192, 3
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    H = _hessian(_correlated_inputs(512, K))
    H += 0.01 * H.diagonal().mean() * torch.eye(K)  # damped, as GPTQ's: positive definite in float64 too
    cb = torch.linspace(-0.875, 1.0, 2**k)  # uniform levels: far from what Gaussian weights need
    codes, absmax = _nearest_with(x, cb)
    new = methods.refit_codebook(x, codes, absmax, cb, H)

    D = decode_absmax_e4m4(absmax).repeat_interleave(BLOCK_SIZE, dim=1).double()
    L = torch.linalg.cholesky(H.double())
    cols = [(torch.where(codes == level, D, 0.0) @ L).reshape(-1) for level in range(2**k)]
    peak = 2**k - 1  # the level at 1
    free = list(range(peak))
    target = (x.double() @ L).reshape(-1) - cols[peak]
    want = torch.linalg.lstsq(torch.stack([cols[i] for i in free], 1), target[:, None]).solution[:, 0]
    assert float(new[peak]) == 1.0 and bool((new[1:] > new[:-1]).all())
    assert torch.allclose(new[free].double(), want, atol=1e-3), (new, want)
    assert torch.equal(new, new.half().float())  # fp16 values, as fitted codebooks are
    assert _out_err(x, codes, absmax, new, H) < 0.98 * _out_err(x, codes, absmax, cb, H)
    # an optimal codebook is kept
    assert torch.equal(methods.refit_codebook(x, codes, absmax, new, H), new)
    # more weights than REFIT_WEIGHTS: the system comes from a sample of rows; a lower error than cb's on all rows,
    # not lower than the solution from all rows
    monkeypatch.setattr(methods, "REFIT_WEIGHTS", N // 2 * K)
    sampled = methods.refit_codebook(x, codes, absmax, cb, H)
    err = {name: _out_err(x, codes, absmax, c, H) for name, c in (("cb", cb), ("all", new), ("sample", sampled))}
    assert not torch.equal(sampled, new) and err["all"] <= err["sample"] < 0.99 * err["cb"], err


def test_gptq_refits_its_codebook(monkeypatch):
    """quantize_gptq's codebook is refitted to its codes: a lower output error than without the refit."""
    N, K, k = 64, 192, 3
    X = _correlated_inputs(1024, K)
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.02
    H = _hessian(X)
    errs, books = {}, {}
    for refit in (False, True):
        monkeypatch.setattr(methods, "REFIT_CODEBOOK", refit)
        qw = methods.quantize_tensor(W, k, "gptq", hessian=H)
        errs[refit] = float((X @ (kbit.dequantize(qw, torch.float32) - W).T).norm())
        books[refit] = qw.codebook
    assert not torch.equal(books[True], books[False])
    assert errs[True] < errs[False], errs


def test_block_order_keeps_blocks_whole():
    d = torch.rand(160)
    d[64:96] += 10.0  # the third block matters most
    perm = methods.block_order(d)
    assert sorted(perm.tolist()) == list(range(160))
    groups = perm.reshape(-1, BLOCK_SIZE)
    assert all(len({int(c) // BLOCK_SIZE for c in g}) == 1 for g in groups)  # each group is one original block
    assert int(groups[0, 0]) // BLOCK_SIZE == 2
    assert all(bool((d[g][1:] <= d[g][:-1]).all()) for g in groups)  # inside a block: larger diagonal first


@pytest.mark.parametrize("k", [2, 3, 4])
def test_gptq_lowers_output_error(k):
    N, K = 64, 192
    X = _correlated_inputs(1024, K)
    W = torch.randn(N, K) * 0.02
    H = _hessian(X)
    errs = {}
    for method in ("rtn", "mse", "gptq"):
        qw = methods.quantize_tensor(W, k, method, hessian=H if method == "gptq" else None)
        errs[method] = float((X @ (kbit.dequantize(qw, torch.float32) - W).T).norm())
    # mse minimizes the weight error, which need not lower the output error under correlated inputs; gptq must
    assert errs["gptq"] < 0.8 * min(errs["mse"], errs["rtn"]), errs


def test_gptq_handles_inputs_never_seen():
    K = 64
    X = _correlated_inputs(128, K)
    X[:, 5] = 0.0  # a dead input: zero row and column in H
    qw = methods.quantize_tensor(torch.randn(8, K), 3, "gptq", hessian=_hessian(X))
    assert bool(torch.isfinite(kbit.dequantize(qw)).all())


def test_quantize_tensor_argument_errors():
    W = torch.randn(8, 64)
    with pytest.raises(ValueError, match="method"):
        methods.quantize_tensor(W, 3, "awq")
    with pytest.raises(ValueError, match="hessian"):
        methods.quantize_tensor(W, 3, "gptq")
    with pytest.raises(ValueError, match="hessian"):
        methods.quantize_tensor(W, 3, "mse", hessian=torch.eye(64))
    with pytest.raises(ValueError, match="64"):
        methods.quantize_tensor(W, 3, "gptq", hessian=torch.eye(32))


# ----------------------------------------------------------------------------- calibration and models
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_collect_hessians_is_2xtx_over_n():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    data = [torch.randn(5, 16), torch.randn(3, 16)]
    hs = calibration.collect_hessians(model, {"0": model[0], "2": model[2]}, data)
    X0 = torch.cat(data)
    X2 = torch.relu(model[0](X0)).detach()
    torch.testing.assert_close(hs["0"], 2 * X0.T @ X0 / 8)
    torch.testing.assert_close(hs["2"], 2 * X2.T @ X2 / 8)


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, hidden, attention_mask):
        return self.proj(hidden)


def test_hessians_skip_padding():
    """Rows of padding tokens (attention_mask 0) do not count: a tokenizer's padded batch gives the Hessian of
    its real tokens."""
    model = _Masked()
    x = torch.randn(3, 5, 16)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    hs = calibration.collect_hessians(model, {"proj": model.proj}, [{"hidden": x, "attention_mask": mask}])
    real = x[mask.bool()]
    torch.testing.assert_close(hs["proj"], 2 * real.T @ real / real.shape[0])


def test_quantize_layers_restores_weights_even_on_error():
    model = _tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    ids = torch.randint(0, 256, (2, 16))
    qws = calibration.quantize_layers(model, layers, 3, "gptq", calibration=ids)
    assert set(qws) == {id(m) for _, m in layers}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    calls = []

    def fail():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        calibration.quantize_layers(model, layers, 3, "gptq", calibration=ids, on_layer=fail)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_block_calibration_sees_quantized_earlier_blocks():
    """Block 1's Hessians come from block 0's quantized outputs: compare with hooks on a substituted model."""
    model = _tiny_llama()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    ids = torch.randint(0, 256, (2, 16))
    qws = calibration.quantize_layers(model, layers, 2, "gptq", calibration=ids)
    # rebuild block 1's q_proj Hessian by hand: block 0 quantized, everything else original
    q = copy.deepcopy(model)
    mods = dict(q.named_modules())
    for n, m in layers:
        if n.startswith("model.layers.0."):
            mods[n].weight.data = kbit.dequantize(qws[id(m)], torch.float32)
    H = calibration.collect_hessians(q, {"q": mods["model.layers.1.self_attn.q_proj"]}, ids)["q"]
    want = methods.quantize_tensor(model.model.layers[1].self_attn.q_proj.weight, 2, "gptq", hessian=H)
    got = qws[id(model.model.layers[1].self_attn.q_proj)]
    assert torch.equal(got.packed, want.packed) and torch.equal(got.absmax, want.absmax)


def test_block_calibration_quantizes_in_groups_in_order():
    """Inside a block, o_proj's Hessian comes from a pass with q/k/v quantized, down_proj's from one with the
    attention and gate/up quantized; q/k/v see the block's original input."""
    model = _tiny_llama()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    ids = torch.randint(0, 256, (2, 16))
    qws = calibration.quantize_layers(model, layers, 3, "gptq", calibration=ids)
    block = "model.layers.0."
    groups = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    q = copy.deepcopy(model)
    mods, orig = dict(q.named_modules()), dict(model.named_modules())
    for group in groups:
        for name in group:
            H = calibration.collect_hessians(q, {"x": mods[block + name]}, ids)["x"]
            want = methods.quantize_tensor(orig[block + name].weight, 3, "gptq", hessian=H)
            got = qws[id(orig[block + name])]
            assert torch.equal(got.packed, want.packed) and torch.equal(got.absmax, want.absmax), name
        for name in group:  # the next group sees this one quantized
            mods[block + name].weight.data = kbit.dequantize(qws[id(orig[block + name])], torch.float32)


def test_block_pass_sums_only_the_first_group_when_asked():
    """GPTQ's passes sum X^T X only for the group it quantizes next (q/k/v here), the same values as a pass that
    sums every layer's, and from the second batch on stop once the group ran (down_proj runs in the first only)."""
    model = _tiny_llama()
    block = model.model.layers[0]
    layers = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    ids = torch.randint(0, 256, (calibration.CALIBRATION_BATCH + 2, 16))
    batches = calibration.check_calibration(ids)
    calls = []
    block.mlp.down_proj.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        inputs = calibration._capture_inputs(model, block, batches)
        masks = [None] * len(inputs)
        outputs, every, _, _ = calibration._block_pass(block, inputs, masks, layers)
        assert len(calls) == len(outputs) == 2
        outputs, first, hooks, _ = calibration._block_pass(block, inputs, masks, layers, first_group_only=True)
    group = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    assert hooks.first_group() == group and sorted(first) == sorted(group) and len(every) == 7
    assert all(torch.equal(first[n], every[n]) for n in group)
    assert outputs is None and len(calls) == 3


class _TwiceBlock(nn.Module):
    """``p`` runs twice on the same input, with ``q`` (outside p's group) between its calls."""

    def __init__(self):
        super().__init__()
        self.p, self.q = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.q(self.p(x))
        return y + self.p(x)


def test_block_pass_stops_only_after_every_call_of_the_group():
    block = _TwiceBlock()
    inputs = [((torch.randn(4, 8),), {}) for _ in range(3)]
    layers = {"p": block.p, "q": block.q}
    with torch.no_grad():
        _, every, _, _ = calibration._block_pass(block, inputs, [None] * 3, layers)
        _, first, hooks, _ = calibration._block_pass(block, inputs, [None] * 3, layers, first_group_only=True)
    assert hooks.first_group() == ["p"] and list(first) == ["p"] and torch.equal(first["p"], every["p"])


@pytest.mark.parametrize("refinements", [{}, {"fp_targets": True, "block_tune_steps": 2}], ids=["plain", "fp+block"])
def test_gptq_budget_unchanged_by_summing_only_the_first_group(monkeypatch, refinements):
    """A budget with gptq and rotation (and with fp targets and block tuning) gives the same K's and bit-for-bit the
    same weights as passes that sum every layer's Hessian and run whole (what calibration did before it skipped the
    groups quantized later)."""
    model = _tiny_llama()
    ids = torch.randint(0, 256, (calibration.CALIBRATION_BATCH + 4, 32), generator=torch.Generator().manual_seed(1))

    def stored(m):
        return {n: (l.bits, l.packed, l.absmax, l.codebook) for n, l in m.named_modules()
                if isinstance(l, kbit.KbitLinear)}

    got = stored(kbit.quantize_model(copy.deepcopy(model), bits=3.25, method="gptq", calibration=ids, rotate=True,
                                     progress=False, **refinements))
    every_pass = calibration._block_pass
    monkeypatch.setattr(calibration, "_block_pass", lambda *a, first_group_only=False: every_pass(*a))
    want = stored(kbit.quantize_model(model, bits=3.25, method="gptq", calibration=ids, rotate=True, progress=False,
                                      **refinements))
    assert len({k for k, *_ in got.values()}) > 1  # the budget chose more than one K
    for name, (k, *tensors) in want.items():
        assert got[name][0] == k and all(torch.equal(a, b) for a, b in zip(got[name][1:], tensors)), name


def test_weight_for_fp_inputs_is_the_least_squares_fit():
    """Undamped and in full, ``W + W cross H^-1`` is the least-squares weight for the quantized-path inputs X that
    reproduces the unquantized outputs ``X_fp W^T`` (a solve by ``torch.linalg.lstsq``); ``share`` scales the
    correction; equal inputs leave the weight as it is."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(256, 48, generator=g, dtype=torch.float64)
    X_fp = X + 0.1 * torch.randn(256, 48, generator=g, dtype=torch.float64)
    W = torch.randn(16, 48, generator=g)
    got = methods.weight_for_fp_inputs(W, _hessian(X), 2 * (X_fp - X).T @ X / 256, damp=0.0, share=1.0)
    want = torch.linalg.lstsq(X, X_fp @ W.T.double()).solution.T.float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(methods.weight_for_fp_inputs(W, _hessian(X), torch.zeros(48, 48)), W)
    half = methods.weight_for_fp_inputs(W, _hessian(X), 2 * (X_fp - X).T @ X / 256, damp=0.0, share=0.5)
    torch.testing.assert_close(half, (W + got) / 2, rtol=1e-5, atol=1e-5)


def _outputs_of(model, names, ids) -> dict:
    """``{name: output}`` of the named layers on ``ids``."""
    seen, mods = {}, dict(model.named_modules())
    handles = [mods[n].register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.detach())) for n in names]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return seen


def _layer_errors_to_fp(model, qws, ids, block: str) -> dict:
    """Per layer of ``block``: |X_fp W^T - X_q Q^T|^2 / |X_fp W^T|^2, on the unquantized model's input X_fp and the
    input X_q of the model with every layer quantized (``qws`` dequantized in place)."""
    q = copy.deepcopy(model)
    mods = dict(q.named_modules())
    names = [n for n, m in model.named_modules() if n.startswith(block) and isinstance(m, nn.Linear)]
    for n, m in model.named_modules():
        if id(m) in qws:
            mods[n].weight.data = kbit.dequantize(qws[id(m)], torch.float32)
    fp, quantized = _outputs_of(model, names, ids), _outputs_of(q, names, ids)
    return {n: float((fp[n] - quantized[n]).norm() ** 2 / fp[n].norm() ** 2) for n in names}


def test_fp_targets_match_the_unquantized_layer_outputs():
    """``fp_targets``: block 1's layers fit the unquantized model's outputs on its own inputs. Its q_proj is exactly
    GPTQ of ``weight_for_fp_inputs`` on Hessian and cross term built by hand, and every layer of block 1 ends
    closer to the unquantized model's output than plain (sequential) GPTQ gets; weights restored afterwards."""
    model = _tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    plain = calibration.quantize_layers(model, layers, 2, "gptq", calibration=ids)
    asym = calibration.quantize_layers(model, layers, 2, "gptq", calibration=ids, fp_targets=True)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    for n, m in layers:  # block 0's first group sees the same inputs either way
        if n.startswith("model.layers.0.self_attn.") and n[-6:] in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(asym[id(m)].packed, plain[id(m)].packed), n

    q = copy.deepcopy(model)
    mods = dict(q.named_modules())
    for n, m in layers:
        if n.startswith("model.layers.0."):
            mods[n].weight.data = kbit.dequantize(asym[id(m)], torch.float32)
    name = "model.layers.1.self_attn.q_proj"
    seen = {}
    hooks = [mods[name].register_forward_hook(lambda m, i, o: seen.__setitem__("q", i[0])),
             dict(model.named_modules())[name].register_forward_hook(lambda m, i, o: seen.__setitem__("fp", i[0]))]
    with torch.no_grad():
        q(ids), model(ids)
    for h in hooks:
        h.remove()
    X, X_fp = seen["q"].reshape(-1, 128), seen["fp"].reshape(-1, 128)
    target = methods.weight_for_fp_inputs(model.model.layers[1].self_attn.q_proj.weight, _hessian(X),
                                          2 * (X_fp - X).T @ X / X.shape[0])
    want = methods.quantize_tensor(target, 2, "gptq", hessian=_hessian(X))
    got = asym[id(model.model.layers[1].self_attn.q_proj)]
    assert torch.equal(got.packed, want.packed) and torch.equal(got.absmax, want.absmax)

    err_plain = _layer_errors_to_fp(model, plain, ids, "model.layers.1.")
    err_asym = _layer_errors_to_fp(model, asym, ids, "model.layers.1.")
    assert all(err_asym[n] < err_plain[n] for n in err_plain), (err_asym, err_plain)


@pytest.mark.parametrize("method", ["rtn", "mse", "gptq"])
def test_quantize_model_llama(method):
    model = _tiny_llama()
    ids = torch.randint(0, 256, (4, 32))
    with torch.no_grad():
        ref = model(ids).logits
    q = kbit.quantize_model(copy.deepcopy(model), bits=3, method=method, progress=False,
                            calibration=ids if method == "gptq" else None)
    kl = [m for m in q.modules() if isinstance(m, kbit.KbitLinear)]
    assert len(kl) == 10 and isinstance(q.lm_head, nn.Linear)  # k/v_proj (64 outputs) are too small
    with torch.no_grad():
        err = float((q(ids).logits - ref).norm() / ref.norm())
    assert err < 0.5


def test_gptq_on_conv1d_layers():
    """GPT-2's Conv1D stores its weight [in, out]: calibration writes through the transposed view and restores."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=128, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 128, (4, 24))
    with torch.no_grad():
        ref = model(ids).logits
    errs = {}
    for method in ("rtn", "gptq"):
        q = kbit.quantize_model(copy.deepcopy(model), bits=3, method=method, progress=False,
                                calibration=ids if method == "gptq" else None)
        assert sum(isinstance(m, kbit.KbitLinear) for m in q.modules()) == 8
        with torch.no_grad():
            errs[method] = float((q(ids).logits - ref).norm() / ref.norm())
    assert errs["gptq"] < errs["rtn"], errs


def test_quantize_model_methods_rank_on_bert():
    """Output error of a small BERT (the MiniLM architecture): gptq < mse < rtn at K = 2."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 128, (8, 24))
    calib = [{"input_ids": ids[:4], "attention_mask": torch.ones(4, 24, dtype=torch.long)}]
    with torch.no_grad():
        ref = model(ids[4:]).last_hidden_state
    errs = {}
    for method in ("rtn", "mse", "gptq"):
        q = kbit.quantize_model(copy.deepcopy(model), bits=2, method=method, progress=False,
                                calibration=calib if method == "gptq" else None)
        with torch.no_grad():
            errs[method] = float((q(ids[4:]).last_hidden_state - ref).norm() / ref.norm())
    assert errs["gptq"] < errs["mse"] < errs["rtn"], errs


def test_quantize_model_method_argument_errors():
    model = nn.Sequential(nn.Linear(128, 128))
    with pytest.raises(ValueError, match="calibration"):
        kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", progress=False)
    with pytest.raises(ValueError, match="calibration"):
        kbit.quantize_model(copy.deepcopy(model), bits=3, method="mse", calibration=torch.zeros(1, 4), progress=False)
    with pytest.raises(ValueError, match="method"):
        kbit.quantize_model(copy.deepcopy(model), bits=3, method="best", progress=False)
    with pytest.raises(TypeError, match="calibration"):
        kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=3.5, progress=False)
    with pytest.raises(ValueError, match="tokenizer"):  # text is accepted, but this model has no tokenizer
        kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration="some text", progress=False)
    with pytest.raises(TypeError, match="fp_targets"):
        kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=[torch.randn(4, 128)],
                            fp_targets=1, progress=False)
    with pytest.raises(ValueError, match="block_tune_steps"):
        kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=[torch.randn(4, 128)],
                            block_tune_steps=-1, progress=False)
    for refinement in ({"fp_targets": True}, {"block_tune_steps": 2}):
        with pytest.raises(ValueError, match="refine method='gptq'"):
            kbit.quantize_model(copy.deepcopy(model), bits=3, method="mse", progress=False, **refinement)


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["mse", "gptq"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_cuda_kernels_on_method_outputs(method, k):
    """Dequantize is bit-exact and the fused GEMM within the same-precision tolerance of tests/cuda_harness.py."""
    N, K = 320, 4128  # K % 256 != 0 and > one GPTQ batch
    W = (torch.randn(N, K) * 0.02).to(torch.float16)
    H = _hessian(_correlated_inputs(512, K)) if method == "gptq" else None
    qw = methods.quantize_tensor(W, k, method, hessian=H)  # on CPU: the reference's output
    w32 = kbit.dequantize(qw, torch.float32)
    gq = qw.cuda()
    assert torch.equal(kbit.dequantize(gq, torch.float16).cpu(), kbit.dequantize(qw, torch.float16))
    for M in (1, 16, 33, 200):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        out = kbit.matmul(x, gq).float()
        ref32 = x.float() @ w32.cuda().T
        ref_lp = nn.functional.linear(x, kbit.dequantize(gq, torch.float16)).float()
        scale_out = float(ref32.abs().max())
        slack = 0.5 * torch.finfo(torch.float16).eps * 2.0 ** math.floor(math.log2(scale_out)) + 1e-5 * scale_out
        assert float((out - ref32).abs().max()) <= 2 * float((ref_lp - ref32).abs().max()) + slack, (M, method, k)
    # GPTQ on the GPU (what quantize_model does when CUDA is present) gives valid storage too
    gptq_gpu = methods.quantize_tensor(W.cuda(), k, "gptq", hessian=_hessian(_correlated_inputs(512, K)).cuda())
    kbit.QuantizedWeight.from_state_dict(gptq_gpu.state_dict())


def _bench_module():
    return load_script("benchmarks/bench_quantize_methods.py")


def test_quantize_methods_benchmark_runs_tiny(tmp_path, capsys):
    """benchmarks/bench_quantize_methods.py in its CPU smoke size: one row per method, every decoder Linear."""
    pytest.importorskip("transformers")
    import json

    bench = _bench_module()
    out = tmp_path / "q.json"
    argv = ["--tiny", "--device", "cpu", "--layers", "1", "--calib-seqs", "2", "--calib-len", "16",
            "--methods", "rtn,gptq+rotate", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["rtn", "gptq+rotate"] and all(r["layers"] == 5 for r in rows)
    assert rows[0]["phase_seconds"]["quantize"] == 0 < rows[1]["phase_seconds"]["quantize"]
    assert all(r["average_bits"] == 4.25 and r["target_seconds"] < 900 for r in rows)
    assert "x 32" in capsys.readouterr().out


def test_quantize_methods_benchmark_times_a_budget_with_tuning(tmp_path, capsys):
    """--bits 3.25 --tune-steps 2: the budget is met as stored, its sensitivities and tuning are timed, and the
    row's target is the budget's (tuning included)."""
    pytest.importorskip("transformers")
    import json

    bench = _bench_module()
    out = tmp_path / "q.json"
    argv = ["--tiny", "--device", "cpu", "--layers", "1", "--calib-seqs", "2", "--calib-len", "16",
            "--methods", "rtn", "--bits", "3.25", "--tune-steps", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert data["bits"] == row["bits"] == 3.25 and row["tune_steps"] == 2 and row["target_seconds"] == 900
    assert row["average_bits"] <= 3.25
    assert row["phase_seconds"]["sensitivities"] > 0 and row["phase_seconds"]["tuning"] > 0
    assert "a budget of 3.25 bits per weight, 2 tuning steps" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [(["--bits", "3.3x"], "--bits"), (["--bits", "6"], "one of"),
                                           (["--bits", "5.5"], "between 2.25 and 5.25"),
                                           (["--tune-steps", "-1"], "int >= 0"), (["--tune-steps", "2.5"], "int")])
def test_quantize_methods_benchmark_refuses_bad_bits_and_steps(argv, message, capsys):
    bench = _bench_module()
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--device", "cpu"] + argv)
    assert message in capsys.readouterr().err


def test_quantize_methods_benchmark_parses_bits():
    bench = _bench_module()
    assert bench.bits_argument("3") == 3 and isinstance(bench.bits_argument("3"), int)
    assert bench.bits_argument("3.25") == 3.25 and isinstance(bench.bits_argument("3.25"), float)
