"""The calibrated methods through from_pretrained (KbitConfig(method="gptq", calibration=..., rotate=...,
fp_targets=..., block_tune_steps=...)) and ``python -m kbit quantize --method``, and model.dequantize() back to a
plain transformers model."""

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


# ----------------------------------------------------------------------------- gptq's refinements
REFINEMENTS = ("fp_targets", "block_tune_steps")


@pytest.fixture
def refinements_seen(monkeypatch):
    """The (fp_targets, block tuning steps) each calibrated quantization ran with (kbit.calibration.quantize_layers,
    as quantize_model calls it), the real one running."""
    import kbit.nn

    seen, real = [], kbit.nn.quantize_layers

    def spy(*args, fp_targets=False, block_tuner=None, **kwargs):
        seen.append((fp_targets, block_tuner.keywords["steps"] if block_tuner is not None else 0))
        return real(*args, fp_targets=fp_targets, block_tuner=block_tuner, **kwargs)

    monkeypatch.setattr(kbit.nn, "quantize_layers", spy)
    return seen


def test_kbitconfig_saves_the_gptq_refinements_and_reads_configs_without_them():
    config = kbit.KbitConfig(bits=3, method="gptq", fp_targets=True, block_tune_steps=2)
    saved = config.to_dict()
    assert (saved["fp_targets"], saved["block_tune_steps"]) == (True, 2)
    again = kbit.KbitConfig.from_dict(saved)
    assert (again.fp_targets, again.block_tune_steps) == (True, 2) and again.to_dict() == saved
    older = {key: value for key, value in saved.items() if key not in REFINEMENTS}  # saved before they existed
    assert (kbit.KbitConfig.from_dict(older).fp_targets, kbit.KbitConfig.from_dict(older).block_tune_steps) == (False, 0)


@pytest.mark.parametrize("settings, error, match", [
    (dict(method="gptq", fp_targets=1), TypeError, "fp_targets must be a bool"),
    (dict(method="gptq", fp_targets=None), TypeError, "fp_targets must be a bool"),
    (dict(method="gptq", block_tune_steps=-1), ValueError, "block_tune_steps must be >= 0"),
    (dict(method="gptq", block_tune_steps=2.0), TypeError, "block_tune_steps must be an int"),
    (dict(method="gptq", block_tune_steps=True), TypeError, "block_tune_steps must be an int"),
    (dict(fp_targets=True), ValueError, "refine method='gptq', got method='rtn'"),
    (dict(method="mse", block_tune_steps=3), ValueError, "refine method='gptq', got method='mse'"),
])
def test_bad_gptq_refinements_are_refused_as_quantize_model_refuses_them(settings, error, match):
    with pytest.raises(error, match=match):
        kbit.KbitConfig(bits=4, **settings)
    with pytest.raises(error, match=match):
        kbit.quantize_model(nn.Sequential(nn.Linear(128, 128)), bits=4, progress=False, **settings)


def test_gptq_refinements_through_from_pretrained_are_quantize_model_s(llama_dir, tmp_path, refinements_seen):
    settings = dict(bits=3, method="gptq", calibration=torch.randint(0, VOCAB, (4, 16)), fp_targets=True,
                    block_tune_steps=2)
    model = load(llama_dir, quantization_config=kbit.KbitConfig(**settings))
    expect = kbit.quantize_model(load(llama_dir), progress=False, **settings)
    assert refinements_seen == [(True, 2), (True, 2)]
    layers = {n: m for n, m in model.named_modules() if isinstance(m, kbit.KbitLinear)}
    for name, m in expect.named_modules():
        if isinstance(m, kbit.KbitLinear):
            for key in ("packed", "absmax", "codebook", "scale"):
                assert torch.equal(getattr(layers[name], key), getattr(m, key)), (name, key)
    ids = torch.randint(0, VOCAB, (1, 9))
    assert torch.equal(logits(model, ids), logits(expect, ids))
    # quantize_model records the same settings on the model it quantized (save_pretrained writes them); skip is
    # recorded as quantize_model's own default, KbitConfig's stays None (default_skip)
    recorded, configured = expect.config.quantization_config.to_dict(), model.config.quantization_config.to_dict()
    assert recorded.pop("skip") == ["lm_head"] and configured.pop("skip") is None and recorded == configured

    model.save_pretrained(str(tmp_path))
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    assert {key: raw["quantization_config"][key] for key in REFINEMENTS} == {"fp_targets": True, "block_tune_steps": 2}
    again = load(tmp_path)
    assert (again.config.quantization_config.fp_targets, again.config.quantization_config.block_tune_steps) == (True, 2)
    assert torch.equal(logits(again, ids), logits(model, ids))
    for key in REFINEMENTS:  # a folder written before these settings existed
        del raw["quantization_config"][key]
    path.write_text(json.dumps(raw))
    older = load(tmp_path)
    assert (older.config.quantization_config.fp_targets, older.config.quantization_config.block_tune_steps) == (False, 0)
    assert torch.equal(logits(older, ids), logits(model, ids))


def test_cli_gptq_refinements_reach_quantize_model(llama_dir, tmp_path, capsys, refinements_seen):
    from test_bit_budget import _save_with_tokenizer

    from kbit.convert import build_parser

    src, text = tmp_path / "src", tmp_path / "calib.txt"
    _save_with_tokenizer(load(llama_dir), src)
    text.write_text("Some words to calibrate on, and some more of them. " * 8)
    assert cli_quantize([str(src), "--out", str(tmp_path / "out"), "--bits", "3", "--method", "gptq", "--calibration",
                         str(text), "--fp-targets", "--block-tune-steps", "2", "--dtype", "float32",
                         "--no-progress"]) == 0
    assert refinements_seen == [(True, 2)]
    assert "to 3 bits (gptq, fp targets, 2 block tuning steps)" in capsys.readouterr().err
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert {key: saved[key] for key in REFINEMENTS} == {"fp_targets": True, "block_tune_steps": 2}
    assert "--fp-targets" in build_parser().format_help() and "--block-tune-steps N" in build_parser().format_help()


@pytest.mark.parametrize("flags, match", [
    (["--method", "gptq", "--block-tune-steps", "-1"], "block_tune_steps must be >= 0"),
    (["--fp-targets"], "refine method='gptq', got method='rtn'"),
    (["--method", "mse", "--block-tune-steps", "2"], "refine method='gptq', got method='mse'"),
])
def test_cli_refuses_bad_gptq_refinements(llama_dir, tmp_path, capsys, flags, match):
    out = tmp_path / "out"
    assert cli_quantize([str(llama_dir), "--out", str(out), "--calibration", str(tmp_path / "calib.txt"), *flags,
                         "--no-progress"]) == 1
    assert match in capsys.readouterr().err and not out.exists()
    assert cli_quantize([str(llama_dir), "--out", str(out), "--block-tune-steps", "two"]) == 2  # argparse: not an int


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

    # without --calibration: kbit's built-in text, as quantize_model without calibration
    builtin = tmp_path / "builtin"
    assert cli_quantize([str(src), "--out", str(builtin), "--method", "gptq", "--dtype", "float32",
                         "--no-progress"]) == 0
    expect = kbit.quantize_model(load(src), bits=4, method="gptq", progress=False)
    ids = torch.randint(0, VOCAB, (1, 9))
    assert torch.equal(logits(load(builtin), ids), logits(expect, ids))

    out = tmp_path / "out"
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
