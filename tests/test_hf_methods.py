"""The calibrated methods through from_pretrained (KbitConfig(method="gptq", calibration=..., rotate=...)) and
``python -m kbit quantize --method``, and model.dequantize() back to a plain transformers model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import kbit  # noqa: E402
from kbit.convert import cli_quantize  # noqa: E402
from kbit.hf import from_config  # noqa: E402

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, one_thread):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    model = from_config(LlamaForCausalLM, LlamaConfig(**COMMON, intermediate_size=256), dtype=torch.float32)
    model.save_pretrained(str(path))
    return path


def load(path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_gptq_while_loading_equals_quantize_model_and_is_recorded(llama_dir, tmp_path):
    calibration = torch.randint(0, VOCAB, (4, 16))
    ids = torch.randint(0, VOCAB, (1, 9))
    config = kbit.KbitConfig(bits=4, method="gptq", calibration=calibration, rotate=True)
    model = load(llama_dir, quantization_config=config)
    expect = kbit.quantize_model(load(llama_dir), bits=4, method="gptq", calibration=calibration, rotate=True,
                                 progress=False)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, kbit.KbitLinear)}
    assert len(layers) == 2 * 7 and all(m.rotation is not None for m in layers.values())
    for name, m in expect.named_modules():
        if isinstance(m, kbit.KbitLinear):
            assert torch.equal(layers[name].packed, m.packed) and torch.equal(layers[name].codebook, m.codebook), name
    assert torch.equal(logits(model, ids), logits(expect, ids))

    model.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["method"] == "gptq" and saved["rotate"] is True and "calibration" not in saved
    again = load(tmp_path)  # a gptq folder loads with no calibration
    assert again.config.quantization_config.method == "gptq"
    assert torch.equal(logits(again, ids), logits(model, ids))


def test_method_errors(llama_dir):
    with pytest.raises(ValueError, match="calibration="):
        load(llama_dir, quantization_config=kbit.KbitConfig(bits=4, method="gptq"))
    with pytest.raises(ValueError, match="used by method='gptq', bit budgets and tune_steps only"):
        kbit.KbitConfig(bits=4, calibration=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="method must be one of"):
        kbit.KbitConfig(bits=4, method="awq")
    with pytest.raises(ValueError, match="calibration must be token ids"):
        kbit.KbitConfig(bits=4, method="gptq", calibration=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="used by method='gptq', bit budgets and tune_steps only"):
        kbit.KbitConfig(bits=4, calibration="some text")
    with pytest.raises(ValueError, match="needs a tokenizer"):  # text, and no tokenizer saved with the model
        load(llama_dir, quantization_config=kbit.KbitConfig(bits=4, method="gptq", calibration="some text"))


def test_cli_says_when_it_turns_float32_into_float16(llama_dir, tmp_path, capsys):
    assert cli_quantize([str(llama_dir), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    assert "float32 checkpoint" in capsys.readouterr().err
    assert load(tmp_path / "a").model.embed_tokens.weight.dtype == torch.float16
    assert cli_quantize([str(llama_dir), "--out", str(tmp_path / "b"), "--dtype", "float32", "--no-progress"]) == 0
    assert "float32 checkpoint" not in capsys.readouterr().err


@pytest.mark.slow
def test_cli_gptq_from_a_text_file(llama_dir, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = tmp_path / "src"
    model = load(llama_dir)
    model.save_pretrained(str(src))
    words = [f"w{i}" for i in range(VOCAB - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>"] + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(src))
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(words[i % len(words)] for i in range(600)))

    out = tmp_path / "out"
    assert cli_quantize([str(src), "--out", str(out), "--method", "gptq"]) == 1
    assert "--calibration" in capsys.readouterr().err
    assert cli_quantize([str(src), "--out", str(out), "--bits", "3", "--method", "gptq", "--rotate",
                         "--calibration", str(text), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "float32 checkpoint" in err and "float16" in err  # the dtype change is said
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (saved["bits"], saved["method"], saved["rotate"]) == (3, "gptq", True)
    q = load(out)
    assert all(m.rotation is not None for m in q.modules() if isinstance(m, kbit.KbitLinear))

    # the text is mixed with kbit's built-in text, on the CLI as through KbitConfig(calibration=text)
    from kbit.calibration_text import MIXED_BUILTIN_SEQUENCES, calibration_tokens
    from kbit.convert import calibration_ids

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(src))
    mixed = calibration_tokens(tokenizer, text.read_text())
    assert mixed.shape[0] == 2 + MIXED_BUILTIN_SEQUENCES  # 600 words: 2 sequences of 256 tokens
    assert torch.equal(calibration_ids(src, text), mixed)
    loaded = load(src, quantization_config=kbit.KbitConfig(bits=3, method="gptq", calibration=text.read_text()))
    expect = kbit.quantize_model(load(src), bits=3, method="gptq", calibration=mixed, progress=False)
    ids = torch.randint(0, VOCAB, (1, 9))
    assert torch.equal(logits(loaded, ids), logits(expect, ids))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_moe"])
def test_dequantize_gives_back_a_plain_model(family, tmp_path, one_thread):
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)
    from transformers.pytorch_utils import Conv1D

    cls, config = {
        "llama": (LlamaForCausalLM, LlamaConfig(**COMMON, intermediate_size=256)),
        "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=128, n_positions=32)),
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, intermediate_size=256, moe_intermediate_size=128,
                                                          num_experts=4, num_experts_per_tok=2)),
    }[family]
    q = kbit.quantize_model(from_config(cls, config, dtype=torch.float32).eval(), bits=4, progress=False)
    kbit_layers = {n: copy.deepcopy(m) for n, m in q.named_modules() if isinstance(m, (kbit.KbitLinear, kbit.KbitExperts))}
    ids = torch.randint(0, VOCAB, (1, 8))
    expect = logits(q, ids)

    plain = q.dequantize()
    assert not any(isinstance(m, (kbit.KbitLinear, kbit.KbitExperts)) for m in plain.modules())
    assert not hasattr(plain.config, "quantization_config") and getattr(plain, "hf_quantizer", None) is None
    for name, old in kbit_layers.items():
        new = plain.get_submodule(name)
        if isinstance(old, kbit.KbitExperts):
            assert torch.equal(new.gate_up_proj, old.dequantize("gate_up")) and torch.equal(new.down_proj,
                                                                                          old.dequantize("down"))
        elif family == "gpt2":
            assert type(new) is Conv1D and torch.equal(new.weight, old.dequantize().t())
        else:
            assert type(new) is nn.Linear and torch.equal(new.weight, old.dequantize())
    torch.testing.assert_close(logits(plain, ids), expect, rtol=1e-4, atol=1e-4)

    plain.save_pretrained(str(tmp_path))
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    torch.testing.assert_close(logits(load(tmp_path), ids), expect, rtol=1e-4, atol=1e-4)
