"""transformers models: quantize_model on Llama, generate, save_quantized / from_pretrained, the CLI, CUDA graphs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from repo_script import load_script

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import kbit  # noqa: E402
from kbit.convert import cli_quantize  # noqa: E402
from kbit.hf import from_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Small enough to be fast, large enough that every projection passes quantize_model's default
# min_features (128): hidden 128, 2 heads of 64, 2 KV heads -> k/v out 128. The vocabulary (320)
# differs from every projection dimension so that no weight shape collides with the embedding's.
TINY = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=256)


def tiny_llama(tie: bool, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY, tie_word_embeddings=tie)
    model = from_config(LlamaForCausalLM, config, dtype=dtype).eval()
    with torch.no_grad():  # make the norms non-trivial so that a mix-up of tensors would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def quantized(request):
    """(original fp32 model, a K=4 quantized copy) per tie_word_embeddings setting."""
    torch.manual_seed(1234)
    model = tiny_llama(request.param)
    q = kbit.quantize_model(copy.deepcopy(model), bits=4, progress=False)
    return model, q


# ----------------------------------------------------------------------------- quantize_model
def test_quantize_model_swaps_llama_projections(quantized):
    model, q = quantized
    names = sorted(n for n, m in q.named_modules() if isinstance(m, kbit.KbitLinear))
    expected = sorted(
        f"model.layers.{i}.{'self_attn' if p in PROJ[:4] else 'mlp'}.{p}"
        for i in range(TINY["num_hidden_layers"]) for p in PROJ
    )
    assert names == expected
    assert type(q.lm_head) is nn.Linear and type(q.model.embed_tokens) is nn.Embedding
    assert q.lm_head.weight.dtype == torch.float32 and torch.equal(q.lm_head.weight, model.lm_head.weight)
    assert torch.equal(q.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert (q.lm_head.weight is q.model.embed_tokens.weight) == model.config.tie_word_embeddings


def test_quantized_llama_matches_dequantized_reference(quantized):
    """The quantized model computes exactly what the original computes with W_hat in place of W."""
    model, q = quantized
    ref = copy.deepcopy(model)
    qmods = dict(q.named_modules())
    with torch.no_grad():
        for name, m in ref.named_modules():
            if isinstance(qmods.get(name), kbit.KbitLinear):
                m.weight.copy_(qmods[name].dequantize(torch.float32))
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    a, b, full = logits(q, ids), logits(ref, ids), logits(model, ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.equal(a, full)  # it is quantized
    # K=4 stays near the full-precision model (measured ~0.15 relative logit error on this random model,
    # whose weight error is ~0.09 per layer).
    assert float((a - full).norm() / full.norm()) < 0.3


def test_generate_on_cpu(quantized):
    _, q = quantized
    ids = torch.randint(0, TINY["vocab_size"], (2, 5))
    out = q.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                     pad_token_id=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], ids)
    assert int(out.min()) >= 0 and int(out.max()) < TINY["vocab_size"]
    again = q.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                       pad_token_id=0)
    assert torch.equal(out, again)


# ----------------------------------------------------------------------------- save / load
def test_quantize_model_reports_the_share_quantized(caplog):
    model = tiny_llama(False)
    with caplog.at_level("INFO", logger="kbit"):
        kbit.quantize_model(model, bits=4, progress=False)
    share = 100 * kbit.quantized_fraction(model)
    assert 50 < share < 100
    assert f"{share:.1f}% of LlamaForCausalLM's weights quantized to 4 bits (14 layers)" in caplog.text


def test_save_load_roundtrip(quantized, tmp_path):
    """save_quantized (save_pretrained, atomically) of a quantize_model'ed model; from_pretrained loads it back."""
    model, q = quantized
    tie = model.config.tie_word_embeddings
    kbit.save_quantized(q, tmp_path)
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {p.name for p in tmp_path.iterdir()}
    qcfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "kbit" and qcfg["bits"] == 4 and qcfg["skip"] == ["lm_head"]
    assert qcfg["codebook"] is None and qcfg["min_features"] == 128 and qcfg["format_version"] == 1
    saved = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in saved) == (not tie)
    layer0 = "model.layers.0.self_attn.q_proj."
    assert {layer0 + s for s in ("weight", "absmax", "codebook", "scale", "meta")} <= set(saved)
    assert layer0 + "packed" not in saved  # saved under the layer's weight name: see kbit.hf.folder
    assert torch.equal(saved[layer0 + "weight"], q.model.layers[0].self_attn.q_proj.packed)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert not loaded.training and isinstance(loaded.model.layers[1].mlp.down_proj, kbit.KbitLinear)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    qs, ls = q.state_dict(), loaded.state_dict()
    assert set(qs) == set(ls)
    for key in qs:
        assert qs[key].dtype == ls[key].dtype and torch.equal(qs[key], ls[key]), key
    ids = torch.randint(0, TINY["vocab_size"], (2, 7))
    assert torch.equal(logits(q, ids), logits(loaded, ids))
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(q.generate(ids, **gen), loaded.generate(ids, **gen))


def test_load_does_not_materialize_weights(quantized, tmp_path):
    """No full-size Linear weight is ever written on a real device while loading a kbit folder."""
    from torch.utils._python_dispatch import TorchDispatchMode

    _, q = quantized
    kbit.save_quantized(q, tmp_path)
    shapes = {tuple(m.weight.shape) for m in tiny_llama(False).modules()
              if isinstance(m, nn.Linear) and m.out_features != TINY["vocab_size"]}
    written = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "empty" not in func.__name__:  # an untouched allocation, as for an empty model
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if (isinstance(t, torch.Tensor) and t.device.type != "meta" and t.is_floating_point()
                            and tuple(t.shape) in shapes):
                        written.append((str(func), tuple(t.shape)))
            return out

    with Recorder():
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert not written, written[:5]
    assert isinstance(loaded.model.layers[0].mlp.down_proj, kbit.KbitLinear)


def test_load_in_another_dtype(quantized, tmp_path):
    _, q = quantized
    kbit.save_quantized(q, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), **{kbit.hf.dtype_kwarg(): torch.bfloat16})
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.norm.weight.dtype == torch.bfloat16
    layer = loaded.model.layers[1].self_attn.o_proj
    assert isinstance(layer, kbit.KbitLinear) and layer.codebook.dtype == torch.float32
    assert layer.scale.dtype == torch.float32 and layer.weight_dtype == torch.float32  # quantized from fp32
    assert torch.equal(layer.packed, q.model.layers[1].self_attn.o_proj.packed)
    out = logits(loaded, torch.randint(0, TINY["vocab_size"], (1, 6)))
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())


def test_save_errors(tmp_path):
    with pytest.raises(ValueError, match="not a kbit-quantized transformers model"):
        kbit.save_quantized(tiny_llama(False), tmp_path / "a")
    with pytest.raises(ValueError, match="not a kbit-quantized transformers model"):
        kbit.save_quantized(kbit.quantize_model(nn.Sequential(nn.Linear(256, 256)), progress=False), tmp_path / "b")
    q = kbit.quantize_model(tiny_llama(False), progress=False)
    with pytest.raises(ValueError, match="push_to_hub"):
        kbit.save_quantized(q, tmp_path / "c", push_to_hub=True)
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- tied weights, unloadable saves
def _tied_models():
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, T5Config,
                              T5ForConditionalGeneration)

    v = TINY["vocab_size"]
    return {  # (model, the tied layer, what it is tied to, skip given to quantize_model)
        "llama": (lambda: tiny_llama(True), "lm_head", "model.embed_tokens", ["*.mlp.gate"]),
        "gpt2": (lambda: from_config(GPT2LMHeadModel, GPT2Config(vocab_size=v, n_layer=1, n_head=2, n_embd=128,
                                                                  n_positions=64, bos_token_id=0, eos_token_id=0)),
                 "lm_head", "transformer.wte", []),
        # an encoder: the masked-LM decoder is tied to the word embeddings; the default skip (lm_head) misses it
        "bert": (lambda: from_config(BertForMaskedLM, BertConfig(vocab_size=v, hidden_size=128, intermediate_size=256,
                                                                 num_hidden_layers=1, num_attention_heads=2)),
                 "cls.predictions.decoder", "bert.embeddings.word_embeddings", ("lm_head",)),
        "t5": (lambda: from_config(T5ForConditionalGeneration, T5Config(vocab_size=v, d_model=128, d_ff=256,
                                                                        num_layers=1, num_heads=2, d_kv=64)),
               "lm_head", "shared", []),
    }


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "t5"])
def test_quantize_model_keeps_tied_weights(family, tmp_path):
    """A weight tied to another stays in full precision whatever ``skip`` says: quantizing it broke the tie and
    save_quantized wrote a folder that did not load ('weight' is not an nn.Parameter)."""
    torch.manual_seed(5)
    build, head, embedding, skip = _tied_models()[family]
    q = kbit.quantize_model(build().eval(), bits=4, skip=skip, min_features=0, progress=False)
    assert isinstance(q.get_submodule(head), nn.Linear)
    assert q.get_submodule(head).weight is q.get_submodule(embedding).weight
    assert any(isinstance(m, kbit.KbitLinear) for m in q.modules())
    kbit.save_quantized(q, tmp_path)
    loaded = type(q).from_pretrained(str(tmp_path))
    assert loaded.get_submodule(head).weight is loaded.get_submodule(embedding).weight
    qs, ls = q.state_dict(), loaded.state_dict()
    assert set(qs) == set(ls) and all(torch.equal(qs[k], ls[k]) for k in qs)


def test_save_refuses_a_quantized_tied_weight_before_writing(tmp_path):
    out = tmp_path / "ckpt"
    good = kbit.quantize_model(tiny_llama(True), bits=4, progress=False)
    kbit.save_quantized(good, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    broken = kbit.quantize_model(tiny_llama(True), bits=4, progress=False)
    broken.lm_head = kbit.KbitLinear.from_linear(broken.lm_head, bits=4)  # by hand: the tie to embed_tokens is gone
    with pytest.raises(ValueError, match=r"lm_head\.weight is tied to model\.embed_tokens\.weight.*nothing written"):
        kbit.save_quantized(broken, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_save_refuses_a_folder_that_does_not_load(tmp_path, monkeypatch):
    """Whatever the cause, a written folder that from_pretrained cannot load never replaces the old one."""
    out = tmp_path / "ckpt"
    q = kbit.quantize_model(tiny_llama(False), bits=4, progress=False)
    kbit.save_quantized(q, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = kbit.hf.folder.saved_state_dict

    def lossy(model):  # a save that loses a layer's block scales
        state = real(model)
        del state["model.layers.1.mlp.up_proj.absmax"]
        return state

    monkeypatch.setattr(kbit.hf.folder, "saved_state_dict", lossy)
    with pytest.raises(ValueError, match=r"does not load back.*model\.layers\.1\.mlp\.up_proj.*nothing was replaced"):
        kbit.save_quantized(q, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ----------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def src_dir(tmp_path_factory):
    torch.manual_seed(99)
    model = tiny_llama(True, dtype=torch.float16)
    path = tmp_path_factory.mktemp("src")
    model.save_pretrained(str(path))
    (path / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    (path / "pytorch_model.bin.index.json").write_text("{}")  # not copied: weight index
    return path


def _quantization_config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_cli_quantize_roundtrip(src_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_quantize([str(src_dir), "--bits", "3", "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "quantized 14 layers" in err and "% of the model's weights" in err
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert "pytorch_model.bin.index.json" not in names
    qcfg = _quantization_config(out)
    assert qcfg["quant_method"] == "kbit" and qcfg["bits"] == 3 and qcfg["skip"] is None  # None: default_skip

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert isinstance(loaded.model.layers[0].mlp.up_proj, kbit.KbitLinear) and loaded.model.layers[0].mlp.up_proj.bits == 3
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    direct = transformers.AutoModelForCausalLM.from_pretrained(str(src_dir), **{kbit.hf.dtype_kwarg(): torch.float16})
    kbit.quantize_model(direct, bits=3, progress=False)
    ids = torch.randint(0, TINY["vocab_size"], (1, 6))
    assert torch.equal(logits(loaded, ids), logits(direct, ids))

    # a second conversion into the same, now non-empty directory needs --overwrite
    assert cli_quantize([str(src_dir), "--out", str(out), "--no-progress"]) == 1
    assert "not empty" in capsys.readouterr().err
    assert cli_quantize([str(src_dir), "--out", str(out), "--no-progress", "--overwrite", "--bits", "5"]) == 0
    assert _quantization_config(out)["bits"] == 5 and (out / "tokenizer.json").is_file()


def test_cli_skip_lists_leave_the_model_dir_alone(src_dir, tmp_path):
    """--skip takes comma-separated names and repeats; it never takes the positional model directory."""
    out = tmp_path / "out"
    args = ["--skip", "lm_head,down_proj", "--skip", "*.self_attn.o_proj", str(src_dir), "--out", str(out)]
    assert cli_quantize(args + ["--no-progress"]) == 0
    assert _quantization_config(out)["skip"] == ["lm_head", "down_proj", "*.self_attn.o_proj"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    layer = loaded.model.layers[1]
    assert type(layer.mlp.down_proj) is nn.Linear and type(layer.self_attn.o_proj) is nn.Linear
    assert isinstance(layer.mlp.up_proj, kbit.KbitLinear) and isinstance(layer.self_attn.q_proj, kbit.KbitLinear)


def test_cli_progress_is_readable_in_a_log(src_dir, tmp_path):
    """stderr not a terminal: one line per tenth of the layers, no carriage-return redraws of a bar."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kbit", "quantize", str(src_dir), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "Loading weights" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert "kbit: quantized while loading: 14/14 (100%)" in lines, lines
    counted = [line for line in lines if line.startswith("kbit: quantized while loading:")]
    assert 5 <= len(counted) <= 10, counted
    assert any("% of the model's weights" in line for line in lines), lines


def _write_config(path: Path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields))
    return path


@pytest.mark.parametrize("case", ["missing", "file", "no_config", "bad_json", "no_model_type", "unknown_type",
                                  "no_weights", "tf_only", "prequantized", "kbit_dir", "same_out"])
def test_cli_quantize_errors(case, src_dir, tmp_path, capsys):
    out = tmp_path / "out"
    if case == "missing":
        src, msg = tmp_path / "nope", "does not exist"
    elif case == "file":
        src, msg = tmp_path / "file.txt", "not a directory"
        src.write_text("x")
    elif case == "no_config":
        src, msg = tmp_path / "d", "no config.json"
        src.mkdir()
        (src / "model.safetensors").write_bytes(b"")
    elif case == "bad_json":
        src, msg = tmp_path / "d", "not valid JSON"
        src.mkdir()
        (src / "config.json").write_text("{nope")
    elif case == "no_model_type":
        src, msg = _write_config(tmp_path / "d", hidden_size=4), "not a transformers model config"
    elif case == "unknown_type":
        src, msg = _write_config(tmp_path / "d", model_type="no-such-arch-xyz"), "unsupported architecture"
        (src / "model.safetensors").write_bytes(b"")
    elif case == "no_weights":
        src, msg = _write_config(tmp_path / "d", **json.loads((src_dir / "config.json").read_text())), "no weights"
    elif case == "tf_only":
        src, msg = _write_config(tmp_path / "d", **json.loads((src_dir / "config.json").read_text())), "no PyTorch"
        (src / "tf_model.h5").write_bytes(b"")
    elif case == "prequantized":
        cfg = json.loads((src_dir / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
        src, msg = _write_config(tmp_path / "d", **cfg), "already quantized (gptq)"
    elif case == "kbit_dir":
        src, msg = _write_config(tmp_path / "d", model_type="llama", quantization_config={"quant_method": "kbit"}), \
            "already a kbit checkpoint"
    else:
        src, out, msg = src_dir, src_dir, "must differ"
    assert cli_quantize([str(src), "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "kbit quantize: error:" in err and msg in err, err
    assert not (out.exists() and case != "same_out" and any(out.iterdir()))


@pytest.mark.parametrize("device, msg", [("cuda", "CUDA is not available"), ("cuda:7", None), ("meta", "kbit quantizes on cpu"),
                                         ("not a device", "is not a device")])
def test_cli_quantize_device_errors(device, msg, src_dir, tmp_path, capsys):
    if device.startswith("cuda") and torch.cuda.is_available():
        if torch.cuda.device_count() > 7:
            pytest.skip("this machine has a cuda:7")
        msg = "CUDA device(s) are visible"
    msg = msg or "CUDA is not available"
    out = tmp_path / "out"
    assert cli_quantize([str(src_dir), "--out", str(out), "--device", device, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "kbit quantize: error:" in err and msg in err, err
    assert not out.exists()


def _no_space(*args, **kwargs):
    from safetensors import SafetensorError  # what safetensors' writer raises for an I/O error

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _no_space_os(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("writer", [_no_space, _no_space_os], ids=["safetensors", "os"])
def test_cli_quantize_on_a_full_disk_is_one_line_and_keeps_the_old_output(writer, src_dir, tmp_path, capsys,
                                                                          monkeypatch):
    out = tmp_path / "out"
    assert cli_quantize([str(src_dir), "--bits", "3", "--out", str(out), "--no-progress"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", writer)
    assert cli_quantize([str(src_dir), "--bits", "5", "--out", str(out), "--overwrite", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kbit quantize: error: ") and "No space left on device" in err[-1], err
    assert f"{out} was left as it was" in err[-1] and not any("Traceback" in line for line in err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_quantize_usage(capsys):
    assert cli_quantize(["--help"]) == 0
    assert "--bits" in capsys.readouterr().out
    assert cli_quantize(["somewhere", "--bits", "7", "--out", "x"]) == 2
    assert cli_quantize(["somewhere"]) == 2  # --out is required


def test_python_m_kbit_quantize(src_dir, tmp_path):
    if not (ROOT / "kbit" / "__main__.py").is_file():
        pytest.skip("kbit/__main__.py not present")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kbit", "quantize", str(src_dir), "--bits", "2", "--out", str(out),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert _quantization_config(out)["bits"] == 2
    bad = subprocess.run([sys.executable, "-m", "kbit", "quantize", str(tmp_path / "nope"), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "does not exist" in bad.stderr


def _bench_e2e():
    return load_script("benchmarks/bench_e2e.py")


def test_bench_e2e_compiles_each_decoder_afresh_with_static_shapes(monkeypatch):
    """Every decoder's step is one static graph of its batch size: dynamo reset first (every decoder's _next_token
    shares one code object, so a second batch size recompiled it with the batch symbolic), dynamic=False."""
    be = _bench_e2e()
    config = be.llama_config(layers=1, hidden=64, intermediate=128, heads=2, kv_heads=1, vocab=100)
    model = be.build_model(config, "cpu", torch.float32, seed=0)
    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("reset"))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)  # eager: the bookkeeping only
    for batch in (1, 2):
        dec = be.GreedyDecoder(model, batch, 32, "compile").prepare(torch.randint(0, 100, (batch, 4)))
        assert dec.generate(torch.randint(0, 100, (batch, 4)), 2).shape == (batch, 3)
    assert calls == ["reset", {"mode": "reduce-overhead", "dynamic": False}] * 2


def test_bench_e2e_says_when_a_compiled_step_is_not_one_cuda_graph(monkeypatch):
    """A compiled row's time is a CUDA-graphed step's only where its step compiled to one graph, unbroken, replayed as
    a CUDA graph: each row records torch.compile's counts since its decoder compiled (``compile``), and the table names
    the rows where they say otherwise. The counters are torch's own (a real compile on the CPU is a cudagraph skip)."""
    from torch._dynamo.utils import counters

    be = _bench_e2e()
    before = be.compile_counts()
    torch._dynamo.reset()
    torch.compile(lambda x: x * 2 + 1, mode="reduce-overhead")(torch.randn(4))
    after = be.compile_counts()
    assert (after["graphs"] - before["graphs"], after["cudagraph_skips"] - before["cudagraph_skips"]) == (1, 1)

    def compile_badly(fn, **kw):  # a step that inductor split in two graphs and ran one of them without CUDA graphs
        counters["stats"]["unique_graphs"] += 2
        counters["inductor"]["cudagraph_skips"] += 1
        return fn

    config = be.llama_config(layers=1, hidden=64, intermediate=128, heads=2, kv_heads=1, vocab=100)
    model = be.build_model(config, "cpu", torch.float32, seed=0)
    monkeypatch.setattr(torch, "compile", compile_badly)
    dec = be.GreedyDecoder(model, 1, 32, "compile").prepare(torch.randint(0, 100, (1, 4)))
    report = dec.compile_report()
    assert report == {"graphs": 2, "graph_breaks": 0, "cudagraph_skips": 1}
    row = {"format": "kbit K=4", "bits": 4, "resident_bytes": 1e9, "batches": {"1": {"tokens_per_s": 9.0}}}
    result = {"model": "llama3-8b", "shape": {"layers": 1, "hidden": 64, "intermediate": 128, "heads": 2,
                                              "kv_heads": 1, "vocab": 100},
              "dtype": "float16", "mode": "compile", "prompt_len": 4, "prefill_len": 0, "new_tokens": 8, "repeats": 1,
              "env": {"device": "cuda:0", "torch": "x", "transformers": "y", "date": "d"}, "rows": [row]}
    assert "Not one CUDA graph" not in be.markdown(result)
    row["batches"]["1"]["compile"] = report
    assert "Not one CUDA graph per compiled step" in be.markdown(result) and "kbit K=4 batch 1" in be.markdown(result)
    row["batches"]["1"]["compile"] = dict(be.ONE_CUDA_GRAPH)
    assert "Not one CUDA graph" not in be.markdown(result)


def test_bench_e2e_times_the_peer_row_last():
    """The torchao row takes minutes to build and compile: timed after fp16 and every kbit row, so that a run cut short
    by a time limit keeps them."""
    be = _bench_e2e()
    args = be.parse_args(["--bits", "4,2", "--torchao", "--fuse-ab"])
    assert be.row_settings([None, 4, 2], args) == [(None, None), (4, True), (4, False), (2, True), (2, False),
                                                   (be.TORCHAO, None)]
    assert be.row_settings([4], be.parse_args(["--bits", "4", "--no-fp16", "--torchao"])) == [(4, True),
                                                                                             (be.TORCHAO, None)]


def test_bench_e2e_groups_kernels_and_tables_the_decode_step_and_the_prefill():
    """Kernel times by group per run (first matching group wins, case-insensitive), launches per run; the profile
    table has a row per profiled decode batch and per profiled prefill, idle = time minus kernel time."""
    be = _bench_e2e()
    kernels = [("kbit_cuda::gemm_ws_kernel<4>", 300.0, 6), ("nvjet_hsh_128x64", 60.0, 2),
               ("flash_fwd_kernel", 30.0, 2), ("void at::native::elementwise", 10.0, 4),
               ("triton_red_fused__to_copy_add_gemm_mean_mul_pow_rsqrt_view_13", 8.0, 2),
               ("ncclDevKernel_AllReduce_Sum_f16_RING_LL", 4.0, 2)]
    prof = be.kernel_time_by_group(kernels, 2)
    assert prof == {"kernel_us_per_step": {"Triton (inductor)": 4.0, "kbit GEMM": 150.0, "cuBLAS GEMM": 30.0,
                                           "attention": 15.0, "collectives": 2.0, "other kernels": 5.0},
                    "kernels_per_step": 9.0,
                    "top_kernels": [["kbit_cuda::gemm_ws_kernel<4>", "kbit GEMM", 150.0, 3.0],
                                    ["nvjet_hsh_128x64", "cuBLAS GEMM", 30.0, 1.0],
                                    ["flash_fwd_kernel", "attention", 15.0, 1.0],
                                    ["void at::native::elementwise", "other kernels", 5.0, 2.0],
                                    ["triton_red_fused__to_copy_add_gemm_mean_mul_pow_rsqrt_view_13",
                                     "Triton (inductor)", 4.0, 1.0],
                                    ["ncclDevKernel_AllReduce_Sum_f16_RING_LL", "collectives", 2.0, 1.0]]}
    assert len(be.kernel_time_by_group([(f"k{i}", float(i), 1) for i in range(30)], 1)["top_kernels"]) == \
        be.TOP_KERNELS
    result = {"prefill_len": 2048, "rows": [
        {"format": "kbit K=4", "batches": {"1": {"steps_per_s": 4000.0, "profile": prof}}, "prefill_s": 0.0005,
         "prefill_profile": prof},
        {"format": "fp16", "batches": {"1": {"steps_per_s": 100.0}}, "prefill_s": 0.06}]}
    table = be._profile_table(result)
    rows = [line for line in table if line.startswith("| kbit")]
    assert rows == ["| kbit K=4 | 1 | 250 | 4 | 150 | 30 | 15 | 2 | 5 | 44 | 9 |",
                    "| kbit K=4 | prefill 2048 | 500 | 4 | 150 | 30 | 15 | 2 | 5 | 294 | 9 |"]
    assert not any(line.startswith("| fp16") for line in table)
    assert be._profile_table({"prefill_len": 0, "rows": result["rows"][1:]}) == []


def test_bench_e2e_counts_the_sibling_groups_that_still_launch_as_one():
    """Two groups per Llama layer (q/k/v, gate/up); on the CPU none launches as one (no stacked GEMM layout there);
    switched off, none are left."""
    be = _bench_e2e()
    config = be.llama_config(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=100)
    model = be.build_model(config, "cpu", torch.float32, seed=0, bits=4)
    assert be.fused_groups(model) == [0, 4]
    kbit.fuse_projections(model, False)
    assert be.fused_groups(model) == [0, 0]


def test_bench_e2e_writes_its_results_after_each_row(tmp_path, monkeypatch):
    """A run cut short (a time limit, the torchao row last) keeps the rows it finished: the files are written after
    each row, each a whole result."""
    be = _bench_e2e()
    argv = ["--device", "cpu", "--layers", "1", "--hidden", "256", "--intermediate", "512", "--heads", "4",
            "--kv-heads", "2", "--vocab", "1000", "--bits", "4", "--batch", "1", "--new-tokens", "2", "--repeats", "1",
            "--prefill-len", "0", "--out-dir", str(tmp_path), "--tag", "t", "--fuse-ab"]
    write, seen = be.write, []

    def write_then_stop(partial, args):
        seen.append(json.loads(write(partial, args).with_suffix(".json").read_text()))
        if len(seen) == 2:
            raise KeyboardInterrupt  # as a time limit would, before the last row

    monkeypatch.setattr(be, "write", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        be.main(argv)
    assert [[r["format"] for r in result["rows"]] for result in seen] == [["float32"], ["float32", "kbit K=4"]]
    assert "kbit K=4" in (tmp_path / "e2e_t.md").read_text()



@pytest.mark.parametrize("model", ["llama3-8b", "qwen3-moe"])
def test_bench_e2e_packed_gqa_attention_decodes_as_sdpa(model, monkeypatch):
    """--attention packed-gqa: a decode step's logits are sdpa's, eager and traced by torch.compile, and nothing is
    repeated (transformers' repeat_kv never called); transformers' sdpa repeats each key/value head when traced."""
    from transformers.integrations import sdpa_attention

    be = _bench_e2e()
    small = dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=96)
    config = (be.llama_config(intermediate=256, **small) if model == "llama3-8b" else
              be.qwen3_moe_config(head_dim=32, experts=4, top_k=2, moe_intermediate=64, **small))
    prompt = torch.randint(0, 96, (2, 5))
    repeats = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda h, n: repeats.append(n) or real(h, n))
    logits = {}
    for attention in ("sdpa", "packed-gqa"):
        dec = be.GreedyDecoder(be.build_model(config, "cpu", torch.float32, seed=3, attention=attention), 2, 16,
                               "eager").prepare(prompt)
        for mode in ("eager", "traced"):
            torch._dynamo.reset()
            step = dec._logits if mode == "eager" else torch.compile(dec._logits, backend="aot_eager", fullgraph=True)
            repeats.clear()
            with torch.no_grad():
                logits[attention, mode] = step(dec.tok, dec.pos).float()
            if attention == "packed-gqa":
                assert not repeats, mode
            elif mode == "traced":
                assert repeats, "transformers' sdpa no longer repeats key/value heads when traced"
    for mode in ("eager", "traced"):
        torch.testing.assert_close(logits["packed-gqa", mode], logits["sdpa", mode], rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_bench_e2e_inductor_pdl_switches_inductor_and_says_so(monkeypatch):
    """--inductor-pdl sets inductor's switch (compile mode only: eager has no inductor kernels to launch so) and the
    table's header names it."""
    import torch._inductor.config as inductor_config

    be = _bench_e2e()
    assert be.parse_args(["--inductor-pdl"]).inductor_pdl and not be.parse_args([]).inductor_pdl
    with pytest.raises(SystemExit, match="mode compile"):
        be.use_inductor_pdl("eager")
    monkeypatch.setattr(inductor_config.triton, "enable_pdl", False)
    assert be.use_inductor_pdl("compile") and inductor_config.triton.enable_pdl is True
    result = {"model": "llama3-8b", "shape": {"layers": 1, "hidden": 8, "intermediate": 16, "heads": 1, "kv_heads": 1,
                                              "vocab": 10},
              "dtype": "float16", "mode": "compile", "prompt_len": 4, "new_tokens": 2, "repeats": 1, "prefill_len": 0,
              "env": {"device": "cuda", "torch": "t", "transformers": "x", "date": "d", "inductor_pdl": True},
              "rows": [{"format": "fp16", "bits": None, "resident_bytes": 1, "batches": {"1": {"tokens_per_s": 1.0}}}]}
    assert "programmatic dependent launch" in be.markdown(result)
    result["env"].pop("inductor_pdl")
    assert "programmatic dependent launch" not in be.markdown(result)


# ----------------------------------------------------------------------------- CUDA

@pytest.mark.cuda
def test_bench_e2e_sibling_groups_launch_as_one_on_cuda_through_decode_and_prefill():
    """On CUDA every q/k/v and gate/up group holds its stacked layout and stays switched on through a compiled decode
    (torch.compile, reduce-overhead) and then an eager prefill: the order bench_e2e.py times them in."""
    be = _bench_e2e()
    config = be.llama_config(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=1000)
    model = be.build_model(config, "cuda", torch.float16, seed=0, bits=4)
    assert be.fused_groups(model) == [4, 4]
    prompt = torch.randint(0, 1000, (1, 7), device="cuda")
    be.GreedyDecoder(model, 1, 64, mode="compile").prepare(prompt).generate(prompt, 8)
    be.time_prefill(model, torch.randint(0, 1000, (1, 300), device="cuda"), 1)
    assert be.fused_groups(model) == [4, 4]


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [None, 2, 4, 5], ids=lambda b: "fp16" if b is None else f"k{b}")
def test_cuda_graph_decode_matches_eager(bits):
    """Greedy decoding with the decode step captured in a CUDA graph gives the eager tokens."""
    be = _bench_e2e()
    config = be.llama_config(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=1000)
    model = be.build_model(config, "cuda", torch.float16, seed=0, bits=bits)
    if bits is not None:
        assert isinstance(model.model.layers[1].mlp.down_proj, kbit.KbitLinear)
    for batch in (1, 3):
        prompt = torch.randint(0, 1000, (batch, 7), device="cuda")
        eager = be.GreedyDecoder(model, batch, 64, mode="eager").generate(prompt, 24)
        dec = be.GreedyDecoder(model, batch, 64, mode="graph").prepare(prompt)
        graph = dec.generate(prompt, 24)
        assert torch.equal(eager, graph), f"batch {batch}: {eager} vs {graph}"
        assert torch.equal(dec.generate(prompt, 24), graph)  # replaying again from a fresh prefill


@pytest.mark.cuda
def test_cuda_load_and_generate(quantized, tmp_path):
    _, q = quantized
    kbit.save_quantized(q, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), device_map="cuda",
                                                              **{kbit.hf.dtype_kwarg(): torch.float16})
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.gemm_codes.is_cuda and q_proj.packed is None  # one resident copy: the GEMM layout
    ids = torch.randint(0, TINY["vocab_size"], (2, 5), device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                         do_sample=False, pad_token_id=0)
    assert out.shape == (2, 9)
