"""Incoherence rotation (kbit.rotation, quantize_model(rotate=True), KbitConfig(rotate=True)).

What is checked: the rotation is orthogonal and preserves ``x @ W.T``; a rotated ``KbitLinear`` computes exactly
the fp32 reference ``rotate(x) @ dequantize(stored).T`` and stays within quantization error of the original
layer; ``.weight`` / ``dequantize()`` are in the original basis; state dicts, transformers folders and
quantizing while loading round-trip the rotation; untrusted rotations are refused; LoRA adapters see the
layer's original inputs; on CUDA, the fused GEMM on rotated inputs matches the CPU reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kbit
from kbit.rotation import MAX_BLOCK, Rotation, check_rotation, choose_block, random_signs


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors (conftest.py)


class Mlp(nn.Module):
    def __init__(self, d=192, h=256):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return Mlp().eval()


# ----------------------------------------------------------------------------- the rotation itself
def test_choose_block():
    assert [choose_block(n) for n in (576, 1536, 384, 4096, 14336, 96, 7)] == [64, 512, 128, MAX_BLOCK, MAX_BLOCK,
                                                                                32, 1]
    assert Rotation.random(7, 0) is None


@pytest.mark.parametrize("n", [64, 192, 576])
def test_rotation_is_orthogonal_and_preserves_products(n):
    r = Rotation.random(n, seed=3)
    x, W = torch.randn(5, n, dtype=torch.float64), torch.randn(7, n, dtype=torch.float64)
    torch.testing.assert_close(r.rotate(x) @ r.rotate(W).T, x @ W.T)
    torch.testing.assert_close(r.unrotate(r.rotate(x)), x)
    R = r.rotate(torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(R @ R.T, torch.eye(n, dtype=torch.float64))
    H = x.T @ x
    torch.testing.assert_close(r.hessian(H), r.rotate(x).T @ r.rotate(x))
    assert set(random_signs(n, 3).tolist()) == {-1, 1} and torch.equal(random_signs(n, 3), r.signs)


def test_check_rotation_refuses_bad_input():
    good = torch.ones(64, dtype=torch.int8)
    assert check_rotation(good, torch.tensor(32), 64) == 32
    for signs, block in [(good.to(torch.int32), 32), (torch.ones(32, dtype=torch.int8), 32),
                         (torch.zeros(64, dtype=torch.int8), 32), (good, 48), (good, 128), (good, 1),
                         (good, torch.tensor(32.0)), (good, True)]:
        with pytest.raises(ValueError, match="rotation"):
            check_rotation(signs, block, 64)


# ----------------------------------------------------------------------------- KbitLinear
@pytest.mark.parametrize("method", ["rtn", "mse"])
def test_rotated_layer_computes_the_rotated_reference(method):
    model = _mlp()
    q = kbit.quantize_model(copy.deepcopy(model), bits=4, method=method, rotate=True, min_features=64, progress=False)
    x = torch.randn(6, 192)
    for name in ("up", "down"):
        layer = getattr(q, name)
        assert layer.rotation is not None and layer.rotation.block == choose_block(layer.in_features)
        assert f"rotation_block={layer.rotation.block}" in repr(layer)
    with torch.no_grad():
        up = q.up
        want = up.rotation.rotate(x) @ up.qweight.dequantize(torch.float32).T + up.bias
        torch.testing.assert_close(up(x), want)  # float32 rounding: the CPU kernel sums in its own order
        # .weight and dequantize() are the original basis: F.linear with them gives the layer's output
        torch.testing.assert_close(nn.functional.linear(x, up.weight, up.bias), up(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(up.dequantize(), up.weight.dequantize())
        for name in ("up", "down"):
            w, wq = getattr(model, name).weight, getattr(q, name).dequantize(torch.float32)
            assert float((wq - w).norm() / w.norm()) < 0.12  # K=4: ~0.09 relative weight error, rotated or not
        y, yq = model(x), q(x)
        assert float((yq - y).norm() / y.norm()) < 0.15


def test_rotated_state_dict_round_trip_and_checks():
    q = kbit.quantize_model(_mlp(), bits=3, rotate=True, min_features=64, progress=False)
    state = q.state_dict()
    assert state["up.rotation_signs"].dtype == torch.int8 and int(state["up.rotation_block"]) == 64
    fresh = kbit.quantize_model(_mlp(seed=1), bits=3, rotate=True, min_features=64, progress=False)
    fresh.load_state_dict(state)
    x = torch.randn(3, 192)
    with torch.no_grad():
        assert torch.equal(fresh(x), q(x))
    built = kbit.KbitLinear(192, 256, bits=3, dtype=torch.float32, rotation_block=32)  # a different block: loaded
    built.load_state_dict({key[3:]: v for key, v in state.items() if key.startswith("up.")})
    assert built.rotation.block == 64
    with torch.no_grad():
        assert torch.equal(built(x), q.up(x))
    plain = kbit.quantize_model(_mlp(), bits=3, min_features=64, progress=False)
    with pytest.raises(RuntimeError, match="rotation_signs"):
        plain.load_state_dict(state)  # an unrotated layer must not silently drop a rotation
    bad = dict(state)
    bad["up.rotation_signs"] = torch.zeros(192, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="-1 and \\+1"):
        fresh.load_state_dict(bad)
    bad = dict(state)
    bad["up.rotation_block"] = torch.tensor(48)
    with pytest.raises(RuntimeError, match="power of two"):
        fresh.load_state_dict(bad)


def test_rotated_layer_deepcopy_and_casts():
    q = kbit.quantize_model(_mlp(), bits=4, rotate=True, min_features=64, progress=False)
    c = copy.deepcopy(q).half()
    assert c.up.rotation_signs.dtype == torch.int8 and c.up.rotation.block == q.up.rotation.block
    x = torch.randn(2, 192)
    with torch.no_grad():
        torch.testing.assert_close(c(x.half()).float(), q(x), rtol=2e-2, atol=2e-2)


def test_gptq_with_rotation_lowers_output_error():
    pytest.importorskip("transformers")
    from test_methods import _tiny_llama

    model = _tiny_llama()
    ids = torch.randint(0, 256, (8, 32))
    out = {}
    for method, rotate in [("rtn", True), ("gptq", True), ("gptq", False)]:
        q = kbit.quantize_model(copy.deepcopy(model), bits=3, method=method, rotate=rotate,
                                calibration=ids if method == "gptq" else None, progress=False)
        assert all(m.rotation is not None for m in q.modules() if isinstance(m, kbit.KbitLinear)) == rotate
        with torch.no_grad():
            out[method, rotate] = q(ids).logits
    with torch.no_grad():
        ref = model(ids).logits
    err = {key: float((v - ref).norm() / ref.norm()) for key, v in out.items()}
    assert err["gptq", True] < err["rtn", True], err


# ----------------------------------------------------------------------------- transformers
def _tiny_llama_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kbit.hf import from_config

    config = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = from_config(transformers.LlamaForCausalLM, config, dtype=torch.float32).eval()
    model.save_pretrained(str(tmp_path / "src"))
    return model, str(tmp_path / "src")


def test_rotation_round_trips_through_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, src = _tiny_llama_dir(tmp_path)
    q = kbit.quantize_model(copy.deepcopy(model), bits=3, rotate=True, progress=False)
    assert q.config.quantization_config.rotate is True
    kbit.save_quantized(q, tmp_path / "q")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"))
    assert loaded.model.layers[0].mlp.down_proj.rotation.block == 256
    ids = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, q(ids).logits)
    # quantizing while loading: the same rotation (signs seeded by the layer name) and the same codes
    on_load = transformers.AutoModelForCausalLM.from_pretrained(src, quantization_config=kbit.KbitConfig(
        bits=3, rotate=True))
    assert torch.equal(on_load.model.layers[1].self_attn.q_proj.rotation_signs,
                       q.model.layers[1].self_attn.q_proj.rotation_signs)
    with torch.no_grad():
        torch.testing.assert_close(on_load(ids).logits, q(ids).logits)


def test_lora_on_rotated_layers(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    _, src = _tiny_llama_dir(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, quantization_config=kbit.KbitConfig(
        bits=4, rotate=True))
    ids = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        base = model(ids).logits
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        assert torch.equal(pm(ids).logits, base)
    wrapped = pm.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():  # the adapter reads the layer's original input, not the rotated one
        wrapped.lora_B["default"].weight.normal_()
        x = torch.randn(3, 128)
        want = wrapped.base_layer(x) + wrapped.lora_B["default"](wrapped.lora_A["default"](x)) * wrapped.scaling[
            "default"]
        torch.testing.assert_close(wrapped(x), want)
    loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for n, p in pm.named_parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_rotated_forward_matches_reference(k, dtype):
    q = kbit.quantize_model(_mlp().to(dtype), bits=k, rotate=True, min_features=64, progress=False).cuda()
    x = torch.randn(5, 192, device="cuda", dtype=dtype)
    with torch.no_grad():
        got = q.up(x)
        xr = q.up.rotation.rotate(x)  # the rotation is a torch op in x's dtype; the kernel sees its output
        assert torch.equal(got, kbit.matmul(xr, q.up.qweight, q.up.bias))
        want = xr.float() @ q.up.qweight.dequantize(torch.float32).T + q.up.bias.float()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
