"""End-to-end tuning of a quantized model (kbit.finetune, quantize_model(tune_steps=N)): codes fixed, codebooks and
block scales tuned to the unquantized model's outputs, the result in the same storage format."""

import copy
import sys
from functools import partial

import pytest
import torch
from torch import nn

import kbit
from kbit import finetune
from kbit._validate import check_codebook
from kbit.formats import create_normal_float_codebook

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked next-token distributions, as a trained model's, not near-uniform ones
        model.lm_head.weight.mul_(8.0)
    return model


def _ids(n=4, seq=32):
    return torch.randint(0, 256, (n, seq))


def _kbit_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, kbit.KbitLinear)}


def _calibration_loss(model, reference, ids) -> float:
    batches = finetune.tuning_batches(ids)
    return finetune._mean_loss(model, batches, finetune.reference_outputs(reference, batches))


@pytest.fixture(scope="module")
def tuned_pair():
    """(unquantized model, quantized, quantized and tuned) with the same codes, K=2 rtn +rotate."""
    model, ids = _tiny_llama(), _ids()
    plain = kbit.quantize_model(copy.deepcopy(model), bits=2, rotate=True, progress=False)
    tuned = kbit.quantize_model(copy.deepcopy(model), bits=2, rotate=True, progress=False, calibration=ids,
                                tune_steps=40)
    return model, plain, tuned, ids


def test_tuning_lowers_the_calibration_loss_and_keeps_the_codes(tuned_pair):
    model, plain, tuned, ids = tuned_pair
    before, after = _calibration_loss(plain, model, ids), _calibration_loss(tuned, model, ids)
    assert after < 0.9 * before, (before, after)
    layers, tuned_layers = _kbit_layers(plain), _kbit_layers(tuned)
    assert layers.keys() == tuned_layers.keys() and layers
    changed_scales = 0
    for name, m in layers.items():
        t = tuned_layers[name]
        assert torch.equal(m.packed, t.packed), name  # the codes
        assert torch.equal(m.scale, t.scale) and torch.equal(m.rotation_signs, t.rotation_signs), name
        check_codebook(t.codebook, 2)
        assert torch.equal(t.codebook, t.codebook.half().float()), name  # fp16-exact levels, as the format wants
        assert not torch.equal(m.codebook, t.codebook), name
        changed_scales += int((m.absmax != t.absmax).sum())
    assert changed_scales > 0


def test_tuned_model_reloads_bit_for_bit(tuned_pair, tmp_path):
    _, _, tuned, ids = tuned_pair
    tuned.save_pretrained(str(tmp_path))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    mods = _kbit_layers(again)
    for name, m in _kbit_layers(tuned).items():
        for key, t in m.state_dict().items():
            assert torch.equal(t, mods[name].state_dict()[key]), f"{name}.{key}"
    with torch.no_grad():
        assert torch.equal(tuned(ids).logits, again(ids).logits)


def test_what_is_tuned_is_what_is_stored():
    """The weight the tuning computes is the stored layer's dequantized weight, bit for bit, after steps that
    moved the levels and block scales."""
    lin = nn.Linear(80, 64)  # 80 inputs: padded rows of 96
    layer = kbit.KbitLinear.from_linear(lin, bits=3)
    t = finetune._TunedLinear(layer)
    with torch.no_grad():
        assert torch.equal(t.weight(), layer.dequantize(torch.float32))
        t.levels.mul_(1.3).add_(torch.linspace(-0.05, 0.05, 8))
        t.log_gain.uniform_(-0.2, 0.2)
        t.keep_levels_apart()
        stored = t.tuned_layer()
        assert torch.equal(t.weight(), stored.dequantize(torch.float32))
        x = torch.randn(5, 80)
        assert torch.allclose(t(x), stored(x), rtol=1e-5, atol=1e-5)


def test_levels_stay_ascending_and_apart():
    layer = kbit.KbitLinear.from_linear(nn.Linear(64, 32), bits=2)
    t = finetune._TunedLinear(layer)
    with torch.no_grad():
        t.levels.copy_(torch.tensor([-1.0, 0.3, 0.2, 0.9]))  # levels 1 and 2 crossed
        t.keep_levels_apart()
    codebook, _ = t.stored()
    check_codebook(codebook, 2)
    assert torch.equal(t.levels[:2], torch.tensor([-1.0, 0.3]))


def test_tuning_that_does_not_lower_the_loss_is_dropped(monkeypatch):
    model, ids = _tiny_llama(), _ids()
    plain = kbit.quantize_model(copy.deepcopy(model), bits=3, progress=False)
    monkeypatch.setattr(finetune, "LEVEL_LR", 5.0)  # steps far too large: the loss goes up
    monkeypatch.setattr(finetune, "GAIN_LR", 5.0)
    q = kbit.quantize_model(copy.deepcopy(model), bits=3, progress=False, calibration=ids, tune_steps=3)
    for name, m in _kbit_layers(plain).items():
        for key, t in m.state_dict().items():
            assert torch.equal(t, _kbit_layers(q)[name].state_dict()[key]), f"{name}.{key}"
    # the parameters tuning froze take their requires_grad back (the kbit layers' empty count parameters stay frozen)
    assert [(n, p.requires_grad) for n, p in q.named_parameters()] == \
        [(n, p.requires_grad) for n, p in plain.named_parameters()]


def test_tuning_an_encoder_matches_its_outputs():
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    calibration = [torch.randn(16, 128) for _ in range(4)]
    plain = kbit.quantize_model(copy.deepcopy(model), bits=2, progress=False)
    tuned = kbit.quantize_model(copy.deepcopy(model), bits=2, progress=False, calibration=calibration, tune_steps=30)
    x = torch.cat(calibration)
    with torch.no_grad():
        ref = model(x)
        err = lambda q: float((q(x) - ref).pow(2).sum() / ref.pow(2).sum())  # noqa: E731
        assert err(tuned) < 0.9 * err(plain)


@pytest.mark.parametrize("steps, error", [(-1, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_tune_steps_are_refused(steps, error):
    with pytest.raises(error, match="tune_steps"):
        kbit.quantize_model(_tiny_llama(), bits=3, tune_steps=steps, progress=False)
    with pytest.raises(error, match="tune_steps"):
        kbit.KbitConfig(bits=3, tune_steps=steps)


def test_a_bare_linear_is_not_tuned_silently():
    with pytest.raises(ValueError, match="itself a Linear"):
        kbit.quantize_model(nn.Linear(128, 128), bits=3, tune_steps=2, calibration=[torch.randn(4, 128)],
                            progress=False)


def test_kbitconfig_and_cli_tune(tmp_path):
    from test_bit_budget import _save_with_tokenizer

    from kbit.convert import build_parser, cli_quantize

    src = tmp_path / "src"
    _save_with_tokenizer(_tiny_llama(), src)
    nf = create_normal_float_codebook(3)
    q = transformers.AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=kbit.KbitConfig(bits=3, calibration=_ids(), tune_steps=3))
    assert _kbit_layers(q) and all(not torch.equal(m.codebook, nf) for m in _kbit_layers(q).values())
    with pytest.raises(ValueError, match="calibration is used by"):
        kbit.KbitConfig(bits=3, calibration=_ids())
    assert build_parser().parse_args(["m", "-o", "x", "--tune-steps", "7"]).tune_steps == 7
    assert cli_quantize([str(src), "--bits", "3", "--tune-steps", "2", "--out", str(tmp_path / "out"),  # built-in text
                         "--no-progress", "--dtype", "float32"]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert _kbit_layers(again) and all(not torch.equal(m.codebook, nf) for m in _kbit_layers(again).values())
    assert cli_quantize([str(src), "--bits", "3", "--tune-steps", "-1", "--out", str(tmp_path / "bad"),
                         "--no-progress"]) == 1


# ----------------------------------------------------------------------------- block by block (block_tune_steps)
def _block_outputs(model, ids, block: int):
    """Block ``block``'s output hidden states on ``ids``."""
    seen = {}
    handle = model.model.layers[block].register_forward_hook(
        lambda m, i, o: seen.__setitem__("out", (o[0] if isinstance(o, tuple) else o).detach()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return seen["out"]


def test_block_tuning_matches_each_block_to_the_unquantized_one():
    """``block_tune_steps``: block 0's codebooks and block scales move (its codes do not), its output ends closer
    to the unquantized block's on the calibration data than without tuning, and every tuned weight is valid
    storage; the model's own weights are untouched."""
    from kbit import calibration

    torch.manual_seed(0)
    model, ids = _tiny_llama(), _ids(8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    plain = calibration.quantize_layers(model, layers, 2, "gptq", calibration=ids)
    tuned = calibration.quantize_layers(model, layers, 2, "gptq", calibration=ids,
                                        block_tuner=partial(finetune.tune_block, steps=20))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    block0 = [m for n, m in layers if n.startswith("model.layers.0.")]
    assert all(torch.equal(tuned[id(m)].packed, plain[id(m)].packed) for m in block0)
    assert any(not torch.equal(tuned[id(m)].absmax, plain[id(m)].absmax) for m in block0)
    for m in block0:
        check_codebook(tuned[id(m)].codebook, 2)

    def error(qws):
        q = copy.deepcopy(model)
        mods = dict(q.named_modules())
        for n, m in layers:
            mods[n].weight.data = kbit.dequantize(qws[id(m)], torch.float32)
        ref = _block_outputs(model, ids, 0)
        return float((_block_outputs(q, ids, 0) - ref).pow(2).sum() / ref.pow(2).sum())

    assert error(tuned) < 0.95 * error(plain), (error(tuned), error(plain))


def test_block_tuning_that_does_not_lower_the_loss_is_dropped(monkeypatch):
    from kbit import calibration

    model, ids = _tiny_llama(), _ids()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    plain = calibration.quantize_layers(model, layers, 2, "gptq", calibration=ids)
    monkeypatch.setattr(finetune, "LEVEL_LR", 5.0)  # steps far too large: the loss goes up
    monkeypatch.setattr(finetune, "GAIN_LR", 5.0)
    tuned = calibration.quantize_layers(model, layers, 2, "gptq", calibration=ids,
                                        block_tuner=partial(finetune.tune_block, steps=3))
    for _, m in layers:
        assert torch.equal(tuned[id(m)].absmax, plain[id(m)].absmax)
        assert torch.equal(tuned[id(m)].codebook, plain[id(m)].codebook)


def test_block_tuning_computes_the_weights_as_substituted():
    """``tune_block`` builds each weight as calibration puts it in the layer (un-rotated, and transposed for a GPT-2
    ``Conv1D``): aimed at the block's own outputs with those weights, there is nothing to gain and it returns None;
    aimed at the unquantized block's outputs, it returns tuned weights of the same shapes."""
    from kbit.rotation import Rotation

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=128, n_layer=1, n_head=4, n_positions=32)
    block = transformers.GPT2LMHeadModel(cfg).eval().transformer.h[0]
    x = [((torch.randn(2, 8, 128),), {}), ((torch.randn(2, 8, 128),), {})]
    with torch.no_grad():
        unquantized = [block(*a, **kw) for a, kw in x]
    weights = {}
    for name, p in block.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            rotation = Rotation.for_layer(name, p.shape[0])
            qw = kbit.quantize(rotation.rotate(p.detach().T.contiguous()), 2)
            weights[name] = (qw, rotation, True)
            p.data = rotation.unrotate(kbit.dequantize(qw, torch.float32)).T.contiguous()
    with torch.no_grad():
        own = [block(*a, **kw) for a, kw in x]
    assert finetune.tune_block(block, weights, x, [None, None], own, steps=4) is None
    tuned = finetune.tune_block(block, weights, x, [None, None], unquantized, steps=4)
    assert tuned is not None and {n: t.shape for n, t in tuned.items()} == {n: w[0].shape for n, w in weights.items()}


def test_quantize_model_takes_the_gptq_refinements():
    """``quantize_model(fp_targets=True, block_tune_steps=N)`` reaches the calibration: other block scales than plain
    gptq, the same storage format."""
    model, ids = _tiny_llama(), _ids()
    plain = kbit.quantize_model(copy.deepcopy(model), bits=2, method="gptq", calibration=ids, progress=False)
    refined = kbit.quantize_model(copy.deepcopy(model), bits=2, method="gptq", calibration=ids, progress=False,
                                  fp_targets=True, block_tune_steps=5)
    a, b = _kbit_layers(plain), _kbit_layers(refined)
    assert a.keys() == b.keys() and any(not torch.equal(a[n].absmax, b[n].absmax) for n in a)
    assert all(a[n].packed.shape == b[n].packed.shape and a[n].bits == b[n].bits for n in a)


def test_quantize_model_checks_method_and_steps_once(monkeypatch):
    """method, tune_steps and block_tune_steps are checked at quantize_model's boundary; quantize_layers,
    tune_block and tune_end_to_end take them checked."""
    from kbit import methods

    calls = []
    for name, original in (("check_method", methods.check_method), ("check_tune_steps", finetune.check_tune_steps)):
        def counting(*args, _name=name, _original=original):
            calls.append(_name)
            return _original(*args)

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("kbit") and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counting)
    kbit.quantize_model(_tiny_llama(), bits=2, method="gptq", calibration=_ids(2, 16), progress=False,
                        block_tune_steps=1, tune_steps=1)
    assert sorted(calls) == ["check_method", "check_tune_steps"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_calibrated_quantization_and_tuning_run_on_the_gpu(dtype):
    """gptq with every refinement, a bit budget and end-to-end tuning on a CUDA model (the GPU's own kernels in
    the calibration and tuning passes): the layers stay on the GPU in the model's dtype, the budget is met as
    counted, the tuned model's calibration loss is below the untuned one's with the same codes; an fp32 model's
    layers take fp32 activations on the GPU (the weight dequantized to float32, cuBLAS)."""
    torch.manual_seed(0)
    model, ids = _tiny_llama().to("cuda", dtype), _ids().cuda()
    settings = dict(bits=3.25, method="gptq", rotate=True, calibration=ids, fp_targets=True, block_tune_steps=3,
                    progress=False)
    plain = kbit.quantize_model(copy.deepcopy(model), **settings)
    tuned = kbit.quantize_model(copy.deepcopy(model), tune_steps=20, **settings)
    layers, tuned_layers = _kbit_layers(plain), _kbit_layers(tuned)
    assert layers.keys() == tuned_layers.keys() and layers
    for name, m in tuned_layers.items():
        assert m.codebook.is_cuda and m.is_gemm_resident and m.weight_dtype == dtype
        x = torch.randn(2, m.in_features, device="cuda", dtype=dtype)
        y = m(x)
        assert y.dtype == dtype
        tol = 1e-2 if dtype == torch.float16 else 1e-4
        want = torch.nn.functional.linear(x.float(), m.dequantize(torch.float32))
        torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)
        assert torch.equal(layers[name].qweight.packed, m.qweight.packed), name  # the same codes
    stored = sum(m.qweight.packed.numel() * 32 + m.qweight.absmax.numel() * 8 for m in tuned_layers.values())
    assert stored / sum(m.in_features * m.out_features for m in tuned_layers.values()) <= 3.25
    assert len({m.bits for m in tuned_layers.values()}) > 1  # the budget mixes K
    before, after = _calibration_loss(plain, model, ids), _calibration_loss(tuned, model, ids)
    assert after < before and after == after, (before, after)
