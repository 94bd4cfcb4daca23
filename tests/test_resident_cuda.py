"""One resident copy of the codes on the GPU (skipped without CUDA): a kbit layer there holds its GEMM layout alone,
and everything that asks for the storage format (state_dict, .cpu(), dequantize, save_pretrained) gets, bit for bit,
the one quantized on CPU. The unrepack kernel against the reference; resident bytes of a small model against the
formula in docs/DESIGN.md#one-resident-copy; peak memory while loading a kbit folder onto the GPU.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import kbit
from kbit import layout, ops
from kbit.moe import GEMM_LAYOUTS, KbitExperts

from test_resident import gemm_layout_bytes

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
]

KS = (2, 3, 4, 5)
LAYOUT_SHAPES = ((1, 32), (17, 96), (300, 64), (40, 288), (257, 4096), (1024, 320))


def _state(module) -> dict:
    return {key: t.detach().cpu().clone() for key, t in module.state_dict().items()}


def _assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key].cpu(), want[key]), key


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_unrepack_kernel_inverts_repack_bit_for_bit(k, shape):
    N, in_features_padded = shape
    nb = N * in_features_padded // 32
    packed = torch.randint(-(2**31), 2**31, (nb * k,), dtype=torch.int64).to(torch.int32)  # any bits: a permutation
    absmax = torch.randint(0, 256, (nb,), dtype=torch.int32).to(torch.uint8)
    b, a = ops.repack(packed.cuda(), absmax.cuda(), k, N, in_features_padded)
    p2, a2 = ops.unrepack(b, a, k, N, in_features_padded)
    assert torch.equal(p2.cpu(), packed) and torch.equal(a2.cpu(), absmax)
    p3, a3 = layout.unrepack_reference(b.cpu(), a.cpu(), k, N, in_features_padded)
    assert torch.equal(p3, packed) and torch.equal(a3, absmax)


def _cpu_layer(bits: int, out_features: int, in_features: int, rotate: bool) -> kbit.KbitLinear:
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features).half())
    kbit.quantize_model(model, bits=bits, min_features=1, skip=(), rotate=rotate, progress=False)
    return model[0]


@pytest.mark.parametrize("k,rotate", [(2, False), (3, True), (4, False), (5, True)])
def test_layer_that_lived_on_cuda_saves_the_cpu_state_dict(k, rotate):
    cpu = _cpu_layer(k, 300, 258, rotate)  # rows past a 256-row block, in_features padded to 288
    want = _state(cpu)
    gpu = copy.deepcopy(cpu).cuda()
    assert gpu.is_gemm_resident and gpu.packed is None and gpu.absmax is None
    assert gpu.qweight.is_gemm_resident
    x = torch.randn(5, 258, device="cuda", dtype=torch.float16)
    y = gpu(x)
    _assert_same_state(_state(gpu), want)
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())
    codes = gpu.gemm_codes.data_ptr()
    gpu.half()  # a dtype cast on the GPU moves nothing and derives nothing
    assert gpu.is_gemm_resident and gpu.gemm_codes.data_ptr() == codes
    twin = copy.deepcopy(gpu)
    assert twin.is_gemm_resident and torch.equal(twin(x), y)
    _assert_same_state(_state(twin), want)
    fresh = kbit.KbitLinear(258, 300, bias=True, bits=k, dtype=torch.float16, device="cuda",
                            rotation_block=cpu._block)
    assert fresh.is_gemm_resident
    fresh.load_state_dict(want)
    assert fresh.is_gemm_resident and torch.equal(fresh(x), y)
    _assert_same_state(_state(fresh), want)
    back = gpu.cpu()
    assert not back.is_gemm_resident and back.gemm_codes is None
    _assert_same_state(_state(back), want)


@pytest.mark.parametrize("k", KS)
def test_layer_quantized_on_cuda_saves_what_cpu_quantization_saves(k):
    linear = torch.nn.Linear(100, 70).half()
    cpu = kbit.KbitLinear.from_linear(linear, bits=k)
    gpu = kbit.KbitLinear.from_linear(copy.deepcopy(linear).cuda(), bits=k)
    assert gpu.is_gemm_resident and not cpu.is_gemm_resident
    _assert_same_state(_state(gpu), _state(cpu))


@pytest.mark.parametrize("k", (3, 4))
def test_experts_on_cuda_hold_only_their_layouts(k):
    E, H, I = 4, 72, 40
    cpu, _ = KbitExperts.from_weights(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05, bits=k)
    want = _state(cpu)
    gpu = copy.deepcopy(cpu).cuda()
    assert gpu.is_gemm_resident and all(getattr(gpu, name) is not None for name in GEMM_LAYOUTS)
    assert all(getattr(gpu, f"{p}_{s}") is None for p in ("gate_up", "down") for s in ("packed", "absmax"))
    _assert_same_state(_state(gpu), want)
    for proj in ("gate_up", "down"):
        assert torch.equal(gpu.dequantize(proj).cpu(), cpu.dequantize(proj))
    x = torch.randn(6, H, device="cuda", dtype=torch.float16)
    idx = torch.randint(0, E, (6, 2), device="cuda")
    w = torch.rand(6, 2, device="cuda")
    y = gpu(x, idx, w)
    codes = gpu.gate_up_gemm_codes.data_ptr()
    gpu.half()  # a dtype cast on the GPU moves nothing and derives nothing; scales and codebook stay float32
    assert gpu.is_gemm_resident and gpu.gate_up_gemm_codes.data_ptr() == codes and gpu.down_scale.dtype == torch.float32
    twin = copy.deepcopy(gpu)
    assert twin.is_gemm_resident and torch.equal(twin(x, idx, w), y)
    _assert_same_state(_state(twin), want)
    y32 = gpu(x.float(), idx, w)  # float32 activations: the per-expert path, from storage derived per expert
    assert y32.dtype == torch.float32 and gpu.is_gemm_resident
    torch.testing.assert_close(y32, y.float(), rtol=0.02, atol=0.02 * float(y.abs().max()))
    fresh = KbitExperts(E, H, I, bits=k, dtype=torch.float32, device="cuda")
    fresh.load_state_dict(want)
    assert fresh.is_gemm_resident and torch.equal(fresh(x, idx, w), y)
    with pytest.raises(RuntimeError, match="powers of two"):  # a refused state dict keeps the layouts
        fresh.load_state_dict(dict(want, down_scale=want["down_scale"] * 3))
    assert fresh.is_gemm_resident and torch.equal(fresh(x, idx, w), y)
    back = gpu.cpu()
    assert not back.is_gemm_resident
    _assert_same_state(_state(back), want)


def _tiny_llama(dtype=torch.float16):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=320, intermediate_size=864, num_hidden_layers=2,
                                      num_attention_heads=5, num_key_value_heads=5, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(config).to(dtype)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _resident(model) -> int:
    return _nbytes({id(t): t for t in (*model.parameters(), *model.buffers())}.values())


def test_resident_bytes_of_a_small_model_equal_the_formula():
    model = _tiny_llama()
    kbit.quantize_model(model, bits=4, progress=False)
    model.cuda()
    layers = [m for m in model.modules() if isinstance(m, kbit.KbitLinear)]
    assert len(layers) == 14
    rest = _nbytes(p for n, p in model.named_parameters() if not isinstance(model.get_submodule(n.rpartition(".")[0]),
                                                                           kbit.KbitLinear))
    rest += _nbytes(b for n, b in model.named_buffers() if not isinstance(model.get_submodule(n.rpartition(".")[0]),
                                                                          kbit.KbitLinear))
    per_layer = 4 * 16 + 4 + 8 * 4  # codebook, scale, meta (no bias, no rotation in Llama)
    formula = rest + sum(gemm_layout_bytes(4, m.out_features, m.in_features) + per_layer for m in layers)
    assert _resident(model) == formula
    assert all(m.is_gemm_resident for m in layers)
    print(f"resident {_resident(model)} B; storage format would add "
          f"{sum(m.qweight.nbytes - 4 * 16 - 4 for m in layers)} B")


def _allocated_at_rest() -> int:
    """CUDA bytes allocated once earlier tests' garbage is collected (a cycle freed while the measured work runs would
    lower what it seems to hold), the peak counter reset there."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def test_loading_a_kbit_folder_onto_cuda_holds_one_form_but_for_one_layer(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _tiny_llama()
    kbit.quantize_model(model, bits=4, progress=False)
    want = _state(model)
    largest = max(m.in_features * m.out_features * 2 for m in model.modules() if isinstance(m, kbit.KbitLinear))
    model.save_pretrained(str(tmp_path))
    del model
    base = _allocated_at_rest()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float16, device_map="cuda")
    torch.cuda.synchronize()
    final, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    print(f"kbit folder -> cuda: final {final} B, peak {peak} B, largest layer in 16 bits {largest} B")
    assert all(m.is_gemm_resident for m in loaded.modules() if isinstance(m, kbit.KbitLinear))
    assert peak <= final + largest
    _assert_same_state(_state(loaded), want)


def test_quantizing_while_loading_onto_cuda_keeps_only_the_layouts(tmp_path):
    transformers = pytest.importorskip("transformers")
    _tiny_llama().save_pretrained(str(tmp_path))
    base = _allocated_at_rest()
    q = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float16, device_map="cuda",
                                                          quantization_config=kbit.KbitConfig(bits=4))
    torch.cuda.synchronize()
    final, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    layers = [m for m in q.modules() if isinstance(m, kbit.KbitLinear)]
    largest = max(m.in_features * m.out_features * 2 for m in layers)
    print(f"KbitConfig -> cuda: final {final} B, peak {peak} B, largest layer in 16 bits {largest} B")
    assert layers and all(m.is_gemm_resident for m in layers)
    # Nothing is held beyond the model's own tensors (the allocator rounds each up to 512 bytes): in particular no
    # storage-format copy of the codes, which would add half a byte per weight.
    storage = sum(m.qweight.nbytes for m in layers)
    assert _resident(q) <= final < _resident(q) + storage // 2


def test_saving_a_gpu_model_derives_one_layer_at_a_time():
    from kbit.hf import folder

    model = _tiny_llama()
    kbit.quantize_model(model, bits=4, progress=False)
    want = _state(model)
    model.cuda()
    layers = [m for m in model.modules() if isinstance(m, kbit.KbitLinear)]
    base = _allocated_at_rest()
    state = folder.saved_state_dict(model)
    peak = torch.cuda.max_memory_allocated() - base
    print(f"saved_state_dict on cuda: peak {peak} B over the model; the largest layer's storage "
          f"{max(m.qweight.nbytes for m in layers)} B; all layers' {sum(m.qweight.nbytes for m in layers)} B")
    assert peak <= max(m.qweight.nbytes for m in layers) + 4096
    for key, t in want.items():
        assert torch.equal(state[key.replace(".packed", ".weight")].cpu(), t), key


def _folder_tensors(folder) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def test_moe_model_saved_from_cuda_is_the_cpu_saved_folder(tmp_path):
    """A quantized MoE model moved to the GPU (every KbitLinear and KbitExperts GEMM-resident) saves the folder it
    saves on the CPU, bit for bit: the experts' storage derived from their stacked layouts, gate/up rows put back
    from the grouped GEMM's interleaved order. That folder loads back onto the GPU (layers built on meta from the
    checked header, then GEMM-resident) holding the same state."""
    transformers = pytest.importorskip("transformers")
    from test_moe import tiny_moe

    torch.manual_seed(5)
    model = kbit.quantize_model(tiny_moe("qwen3_moe", torch.float16), bits=3, progress=False)
    want = _state(model)
    kbit.save_quantized(model, tmp_path / "cpu")
    model.cuda()
    kinds = (kbit.KbitLinear, KbitExperts)
    experts = [m for m in model.modules() if isinstance(m, KbitExperts)]
    assert experts and all(m.is_gemm_resident and m.projection("gate_up").row_order is not None for m in experts)
    assert all(m.is_gemm_resident for m in model.modules() if isinstance(m, kinds))
    kbit.save_quantized(model, tmp_path / "cuda")
    saved, from_cuda = _folder_tensors(tmp_path / "cpu"), _folder_tensors(tmp_path / "cuda")
    assert sorted(from_cuda) == sorted(saved) and any(".experts.gate_up_packed" in key for key in saved)
    for key, t in saved.items():
        assert from_cuda[key].dtype == t.dtype and torch.equal(from_cuda[key], t), key
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "cuda"), dtype=torch.float16,
                                                               device_map="cuda")
    layers = [m for m in loaded.modules() if isinstance(m, kinds)]
    assert any(isinstance(m, KbitExperts) for m in layers) and all(m.is_gemm_resident for m in layers)
    got = _state(loaded)
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
