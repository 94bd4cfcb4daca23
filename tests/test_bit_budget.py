"""Per-layer K under an average-bits budget (kbit.bit_budget), kbit's built-in calibration text
(kbit.calibration_text), and mixed-K models through quantize_model, save_pretrained / from_pretrained, KbitConfig
and the CLI."""

import copy
import types

import pytest
import torch
from torch import nn

import kbit
from kbit import bit_budget
from kbit import calibration_text
from kbit.calibration_text import CALIBRATION_TEXT, calibration_batches, calibration_tokens, default_calibration

transformers = pytest.importorskip("transformers")


def _tiny_llama(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _stored_average_bits(model) -> float:
    """Average bits per weight counted from the stored tensors: packed codes and E4M4 block scales."""
    layers = [m for m in model.modules() if isinstance(m, kbit.KbitLinear)]
    stored = sum(m.packed.numel() * 32 + m.absmax.numel() * 8 for m in layers)
    return stored / sum(m.in_features * m.out_features for m in layers)


def _layer_ks(model) -> dict:
    return {n: m.bits for n, m in model.named_modules() if isinstance(m, kbit.KbitLinear)}


class _WordTokenizer:
    """A tokenizer stand-in: one id per byte (mod vocab)."""

    def __init__(self, vocab=256):
        self.vocab = vocab

    def __call__(self, text, return_tensors=None):
        ids = torch.tensor([list(text.encode())], dtype=torch.long) % self.vocab
        return {"input_ids": ids}


# ----------------------------------------------------------------------------- counting and allocation
def test_layer_bits_counts_codes_and_block_scales_of_padded_rows():
    assert bit_budget.layer_bits(8, 64, 3) == 8 * 64 * 3 + 8 * 2 * 8
    assert bit_budget.layer_bits(8, 40, 2) == 8 * 64 * 2 + 8 * 2 * 8  # 40 inputs are stored as 64
    assert bit_budget.average_bits({"a": (16, 128), "b": (32, 256)}, {"a": 4, "b": 4}) == 4.25


def _random_problem(seed, n=12):
    g = torch.Generator().manual_seed(seed)
    shapes = {f"l{i}": (int(torch.randint(1, 9, (1,), generator=g)) * 32,
                        int(torch.randint(1, 9, (1,), generator=g)) * 32) for i in range(n)}
    errors = {}
    for name in shapes:
        scale = float(torch.rand(1, generator=g)) * 10
        errors[name] = {k: scale * 4.0 ** -k * (1 + 0.3 * float(torch.rand(1, generator=g))) for k in (2, 3, 4, 5)}
    return shapes, errors


@pytest.mark.parametrize("budget", [2.25, 2.6, 3.25, 3.5, 4.25, 4.9, 5.25])
def test_allocation_meets_the_budget_and_leaves_no_upgrade_that_fits(budget):
    shapes, errors = _random_problem(int(budget * 100))
    ks = bit_budget.allocate_bits(shapes, errors, budget)
    assert bit_budget.average_bits(shapes, ks) <= budget
    total = sum(o * i for o, i in shapes.values())
    left = budget * total - bit_budget.average_bits(shapes, ks) * total
    for name, (o, i) in shapes.items():  # greedy stops only when nothing fits
        if ks[name] < 5:
            extra = bit_budget.layer_bits(o, i, ks[name] + 1) - bit_budget.layer_bits(o, i, ks[name])
            assert extra > left + 1e-6
    if budget == 2.25:
        assert set(ks.values()) == {2}
    if budget == 5.25:
        assert set(ks.values()) == {5}


def test_allocation_spends_bits_on_the_sensitive_layer():
    shapes = {"quiet": (64, 64), "loud": (64, 64)}
    errors = {"quiet": {k: 4.0 ** -k for k in (2, 3, 4, 5)}, "loud": {k: 100 * 4.0 ** -k for k in (2, 3, 4, 5)}}
    assert bit_budget.allocate_bits(shapes, errors, 3.25) == {"quiet": 2, "loud": 4}
    assert bit_budget.allocate_bits(shapes, errors, 4.25) == {"quiet": 3, "loud": 5}


def test_allocation_beats_uniform_on_the_estimate():
    shapes, errors = _random_problem(7, n=30)
    ks = bit_budget.allocate_bits(shapes, errors, 3.25)
    assert sum(errors[n][ks[n]] for n in shapes) < sum(errors[n][3] for n in shapes)


@pytest.mark.parametrize("bits, error", [(2.2, ValueError), (5.3, ValueError), (True, TypeError), ("3", TypeError),
                                         ({}, ValueError), ({"*": 6}, ValueError), ({1: 3}, ValueError)])
def test_bad_bit_settings_are_refused(bits, error):
    with pytest.raises(error):
        bit_budget.check_bits_setting(bits)


# ----------------------------------------------------------------------------- sensitivity
class _TwoBranchLM(nn.Module):
    """logits = head(a(emb) + 0 * b(emb)): the loss does not depend on b."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 128)
        self.a, self.b = nn.Linear(128, 128), nn.Linear(128, 128)
        self.head = nn.Linear(128, 64)

    def forward(self, ids, use_cache=False):
        x = self.emb(ids)
        return types.SimpleNamespace(logits=self.head(self.a(x) + 0.0 * self.b(x)))


def test_fisher_is_the_mean_squared_output_gradient():
    model = _TwoBranchLM()
    ids = torch.randint(0, 64, (3, 10))
    layers = [("a", model.a), ("b", model.b)]
    errors = bit_budget.layer_sensitivities(model, layers, [((ids,), {})], lambda m: m.weight, {}, False, 0.1)
    # by hand: F = mean over tokens of (d loss / d a(x))**2, error = 1/4 sum_o F_o (dW H dW^T)_oo
    x = model.emb(ids).detach()
    y = model.a(x).detach().requires_grad_()
    loss = nn.functional.cross_entropy(model.head(y)[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    (g,) = torch.autograd.grad(loss, y)
    F = (g.reshape(-1, 128) ** 2).mean(0)
    X = x.reshape(-1, 128)
    H = 2 * X.T @ X / X.shape[0]
    for k in (2, 3, 4, 5):
        W = model.a.weight.detach()
        dW = W - kbit.quantize(W, bits=k).dequantize(torch.float32)
        want = 0.25 * float((F * ((dW @ H) * dW).sum(1)).sum())
        assert errors["a"][k] == pytest.approx(want, rel=1e-4)
        assert errors["b"][k] == 0.0
    assert all(errors["a"][k] > errors["a"][k + 1] for k in (2, 3, 4))


def test_budget_gives_the_unused_layer_the_fewest_bits():
    model = _TwoBranchLM()
    ids = torch.randint(0, 64, (4, 16))
    kbit.quantize_model(model, bits=3.25, calibration=ids, skip=("head",), progress=False)
    assert (model.a.bits, model.b.bits) == (4, 2)


# ----------------------------------------------------------------------------- quantize_model
@pytest.mark.parametrize("method", ["rtn", pytest.param("gptq", marks=pytest.mark.slow)])
def test_quantize_model_meets_the_budget_as_stored(method):
    model = _tiny_llama()
    ids = torch.randint(0, 256, (2, 32))
    q = kbit.quantize_model(copy.deepcopy(model), bits=3.5, method=method, calibration=ids, progress=False)
    assert _stored_average_bits(q) <= 3.5
    assert _stored_average_bits(q) > 3.25  # the budget is used, not merely respected
    assert len(set(_layer_ks(q).values())) >= 2


def test_integer_bits_are_unchanged():
    model = _tiny_llama()
    q = kbit.quantize_model(copy.deepcopy(model), bits=3, progress=False)
    assert set(_layer_ks(q).values()) == {3}
    assert _stored_average_bits(q) == 3.25


def test_bits_mapping_sets_each_layer_and_must_cover_all():
    model = _tiny_llama()
    q = kbit.quantize_model(copy.deepcopy(model), bits={"*.down_proj": 5, "q_proj": 2, "*": 3}, progress=False)
    for name, k in _layer_ks(q).items():
        assert k == (5 if name.endswith("down_proj") else 2 if name.endswith("q_proj") else 3), name
    with pytest.raises(ValueError, match="no K for"):
        kbit.quantize_model(copy.deepcopy(model), bits={"*.down_proj": 5}, progress=False)


def test_budget_refuses_a_custom_codebook_and_calibration_without_use():
    model = _tiny_llama()
    with pytest.raises(ValueError, match="codebook"):
        kbit.quantize_model(model, bits=3.5, codebook=torch.linspace(-1, 1, 8), progress=False)
    with pytest.raises(ValueError, match="calibration"):
        kbit.quantize_model(model, bits=3, calibration=torch.randint(0, 256, (2, 8)), progress=False)


def test_mixed_k_model_reloads_bit_for_bit(tmp_path):
    ids = torch.randint(0, 256, (2, 32))
    q = kbit.quantize_model(_tiny_llama(), bits=3.5, calibration=ids, progress=False)
    q.save_pretrained(str(tmp_path))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert _layer_ks(again) == _layer_ks(q) and len(set(_layer_ks(q).values())) >= 2
    assert again.config.quantization_config.bits == 3.5
    mods = dict(again.named_modules())
    for name, m in q.named_modules():
        if isinstance(m, kbit.KbitLinear):
            for key, t in m.state_dict().items():
                assert torch.equal(t, mods[name].state_dict()[key]), f"{name}.{key}"
    with torch.no_grad():
        assert torch.equal(q(ids).logits, again(ids).logits)


# ----------------------------------------------------------------------------- built-in calibration
def test_calibration_tokens_mix_builtin_and_user_text():
    tok = _WordTokenizer()
    builtin_ids = tok(CALIBRATION_TEXT)["input_ids"][0]
    alone = calibration_tokens(tok, seq_len=32)  # no text: the built-in text alone, 16 sequences
    assert alone.shape == (calibration_text.BUILTIN_SEQUENCES, 32)
    assert torch.equal(alone.reshape(-1), builtin_ids[:16 * 32])
    text = "user text " * 20  # 200 tokens: 12 sequences of 16, the rest dropped
    user = tok(text)["input_ids"][0]
    mixed = calibration_tokens(tok, text, seq_len=16)
    assert mixed.shape == (12 + calibration_text.MIXED_BUILTIN_SEQUENCES, 16)
    for i in range(12):  # the two sources alternate, each in order
        assert torch.equal(mixed[2 * i], user[16 * i:16 * (i + 1)])
        assert torch.equal(mixed[2 * i + 1], builtin_ids[16 * i:16 * (i + 1)])
    capped = calibration_tokens(tok, text, builtin_sequences=2, seq_len=16, text_sequences=5)
    assert capped.shape == (7, 16) and torch.equal(capped[4:].reshape(-1), user[32:80])  # 5 of the text, 2 built-in
    only = calibration_tokens(tok, text, builtin_sequences=0, seq_len=16)
    assert torch.equal(only.reshape(-1), user[:192])
    short = calibration_tokens(tok, "short", builtin_sequences=0, seq_len=8)  # repeated to fill one sequence
    assert torch.equal(short[0], tok("shortsho")["input_ids"][0])
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="builtin_sequences"):
            calibration_tokens(tok, text, builtin_sequences=bad)
    with pytest.raises(ValueError, match="needs a text"):
        calibration_tokens(tok, builtin_sequences=0)
    with pytest.raises(TypeError, match="text must be a str"):
        calibration_tokens(tok, [1, 2, 3])
    with pytest.raises(ValueError, match="gives no tokens"):
        calibration_tokens(tok, "")


@pytest.mark.slow
def test_text_calibration_is_mixed_with_the_builtin_text():
    """calibration="..." is the user's text with the built-in text beside it, as calibration_tokens makes it."""
    model, tok = _tiny_llama(), _WordTokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 6  # one sequence of 256 tokens
    a = kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=text, tokenizer=tok,
                            progress=False)
    b = kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=calibration_tokens(tok, text),
                            progress=False)
    c = kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=tok(text)["input_ids"][:, :256],
                            progress=False)
    layers = [(n, x, y, z) for (n, x), (_, y), (_, z) in zip(a.named_modules(), b.named_modules(), c.named_modules())
              if isinstance(x, kbit.KbitLinear)]
    assert all(torch.equal(x.packed, y.packed) and torch.equal(x.absmax, y.absmax) for _, x, y, _ in layers)
    assert any(not torch.equal(x.packed, z.packed) for _, x, _, z in layers)  # token ids are used as given
    with pytest.raises(ValueError, match="tokenizer"):  # text needs a tokenizer: none given, none saved
        kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=text, progress=False)
    with pytest.raises(ValueError, match="calibration is used by"):
        kbit.quantize_model(copy.deepcopy(model), bits=3, calibration=text, tokenizer=tok, progress=False)


def _padding_tokenizer():
    """A transformers tokenizer (one id per character) that pads: what calibration_batches needs."""
    tokenizers = pytest.importorskip("tokenizers")
    chars = sorted(set(CALIBRATION_TEXT + "abcdefghijklmnopqrstuvwxyz .,"))
    vocab = {"[PAD]": 0, "[UNK]": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                                                model_max_length=128)


def test_calibration_batches_pad_texts_and_mix_in_the_builtin_lines():
    tok = _padding_tokenizer()
    texts = ["a cat sat.", "the dog ran far away.", "rain."]
    batches = calibration_batches(tok, texts, batch_size=2)
    lines = calibration_text.builtin_lines()
    assert len(lines) > 20 and all(len(line) >= 20 for line in lines)
    n_builtin = -(-len(lines) // 2)
    assert len(batches) == 2 + n_builtin
    first = batches[0]
    assert first["input_ids"].shape == (2, len("the dog ran far away."))  # padded to its longest text
    assert first["attention_mask"].sum(1).tolist() == [len("a cat sat."), len("the dog ran far away.")]
    assert torch.equal(batches[1]["input_ids"], tok(lines[:2], padding=True, return_tensors="pt")["input_ids"])
    assert batches[2]["input_ids"].shape[0] == 1  # the user's last batch, between the built-in ones
    assert len(calibration_text.calibration_batches(tok, texts, builtin=False)) == 1
    for bad in ("one text", [], ["ok", 3], ["ok", ""]):
        with pytest.raises(TypeError, match="texts must be"):
            calibration_batches(tok, bad)
    with pytest.raises(ValueError, match="batch_size"):
        calibration_batches(tok, texts, batch_size=0)


def test_vocabulary_sentences_draw_whole_words_of_the_vocabulary():
    """Pseudo-sentences of 8 distinct whole words (3+ ASCII letters) from the tokenizer's vocabulary, seeded; a
    vocabulary of characters gives none; ``calibration_batches`` puts them after the built-in lines."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["river", "stone", "piano", "garden", "yellow", "market", "orbit", "candle", "violin", "harbor"]
    vocab = {"[PAD]": 0, "[UNK]": 1, "the": 2, ".": 3, "a": 4, "x1": 5, "##ing": 6,
             **{w: i + 7 for i, w in enumerate(words)}}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]")
    sentences = calibration_text.vocabulary_sentences(tok, 5)
    assert len(sentences) == 5 and sentences == calibration_text.vocabulary_sentences(tok, 5)
    assert sentences != calibration_text.vocabulary_sentences(tok, 5, seed=1)
    for sentence in sentences:
        assert sentence.startswith("The ") and sentence.endswith(".")
        drawn = sentence[4:-1].split()
        assert len(drawn) == len(set(drawn)) == calibration_text.WORDS_PER_SENTENCE and set(drawn) <= {"the", *words}
    assert calibration_text.vocabulary_sentences(_padding_tokenizer(), 5) == []
    batches = calibration_batches(tok, ["the river ."], batch_size=4)
    n_lines = -(-len(calibration_text.builtin_lines()) // 4)
    vocabulary_batches = -(-calibration_text.VOCABULARY_SENTENCES // 4)
    assert len(batches) == 1 + n_lines + vocabulary_batches
    assert torch.equal(batches[-1]["input_ids"], tok(calibration_text.vocabulary_sentences(tok)[-4:], padding=True,
                                                     return_tensors="pt")["input_ids"])


@pytest.mark.slow
def test_a_list_of_texts_calibrates_an_encoder_with_the_builtin_lines():
    tok = _padding_tokenizer()
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=256, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    texts = ["a cat sat on the mat.", "the dog ran far away.", "rain fell all day."]
    a = kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=texts, tokenizer=tok,
                            progress=False)
    b = kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=calibration_batches(tok, texts),
                            progress=False)
    layers = [(x, y) for x, y in zip(a.modules(), b.modules()) if isinstance(x, kbit.KbitLinear)]
    assert len(layers) == 2 * 6
    assert all(torch.equal(x.packed, y.packed) and torch.equal(x.absmax, y.absmax) for x, y in layers)


def test_builtin_text_is_diverse():
    text = CALIBRATION_TEXT
    assert 4000 < len(text.encode()) < 20000
    for marker in ("def ", "SELECT", "| ---" if "| ---" in text else "|---", "# ", '"', "é", "ü", "日", "д", "1."):
        assert marker in text, marker


@pytest.mark.slow
def test_gptq_without_calibration_uses_the_builtin_text():
    model, tok = _tiny_llama(), _WordTokenizer()
    a = kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", tokenizer=tok, progress=False)
    b = kbit.quantize_model(copy.deepcopy(model), bits=3, method="gptq", calibration=calibration_tokens(tok),
                            progress=False)
    for (n, x), (_, y) in zip(a.named_modules(), b.named_modules()):
        if isinstance(x, kbit.KbitLinear):
            assert torch.equal(x.packed, y.packed) and torch.equal(x.absmax, y.absmax), n
    with pytest.raises(ValueError, match="tokenizer"):
        default_calibration(_tiny_llama())  # a model built from a config has no saved tokenizer


# ----------------------------------------------------------------------------- transformers and the CLI
def _save_with_tokenizer(model, path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(33 + i): i for i in range(200)}
    vocab["[UNK]"] = 200
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(str(path))
    model.save_pretrained(str(path))


def test_kbitconfig_budget_quantizes_once_loaded(tmp_path):
    _save_with_tokenizer(_tiny_llama(), tmp_path / "src")
    q = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "src"),
                                                          quantization_config=kbit.KbitConfig(bits=3.5))
    assert 3.25 < _stored_average_bits(q) <= 3.5
    q.save_pretrained(str(tmp_path / "out"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert _layer_ks(again) == _layer_ks(q)


def test_cli_takes_a_budget(tmp_path):
    from kbit.convert import build_parser, cli_quantize

    parser = build_parser()
    assert parser.parse_args(["m", "-o", "x", "--bits", "3.25"]).bits == 3.25
    assert parser.parse_args(["m", "-o", "x", "--bits", "3"]).bits == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "-o", "x", "--bits", "6"])
    _save_with_tokenizer(_tiny_llama(), tmp_path / "src")
    assert cli_quantize([str(tmp_path / "src"), "--bits", "4.25", "--out", str(tmp_path / "out"), "--no-progress",
                         "--dtype", "float32"]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert 4.0 < _stored_average_bits(again) <= 4.25
