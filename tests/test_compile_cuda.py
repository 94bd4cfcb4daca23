"""torch.compile of a kbit-quantized transformers model on the GPU (skipped without CUDA).

* ``mode="reduce-overhead"`` (inductor + CUDA graph trees) and ``mode="max-autotune"``: several calls
  with fresh inputs give the eager model's logits within a tolerance taken from the same model compiled
  in fp16 (inductor reorders fp16 arithmetic, so bit equality is not expected), and nothing kbit
  allocates lands in a graph pool (the failure mode this guards against raised "Detected 1 tensor(s)
  in the cudagraph pool not tracked as outputs").
* The transformers fast path: ``model.generate(..., cache_implementation="static")`` with the forward
  compiled gives eager greedy decoding's tokens. Random tiny models have small logit gaps, so a
  divergence is accepted only where eager's top two logits are within the compile tolerance.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kbit  # noqa: E402
from kbit.hf import from_config  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
]

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def _llama(bits):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    with torch.device("cuda"):
        model = from_config(LlamaForCausalLM, LlamaConfig(**TINY), dtype=torch.float16, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    if bits is not None:
        kbit.quantize_model(model, bits=bits, progress=False)
        kbit.prepare(model)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _compile_error(mode, ids_list):
    """max |compiled - eager| of the fp16 model: the tolerance that compilation alone costs."""
    model = _llama(None)
    compiled = torch.compile(model, mode=mode)
    return max((_logits(compiled, ids) - _logits(model, ids)).abs().max().item() for ids in ids_list)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("bits", [2, 4])
def test_compiled_quantized_model_matches_eager(mode, bits):
    torch._dynamo.reset()
    ids_list = [torch.randint(0, TINY["vocab_size"], (2, 9), device="cuda") for _ in range(4)]
    tol = 4 * _compile_error(mode, ids_list) + 2e-2
    torch._dynamo.reset()
    model = _llama(bits)
    compiled = torch.compile(model, mode=mode)
    for ids in ids_list:  # the first calls record/warm up the CUDA graph, the later ones replay it
        got, want = _logits(compiled, ids), _logits(model, ids)
        assert torch.isfinite(got).all()
        err = (got - want).abs().max().item()
        assert err <= tol, f"{mode} K={bits}: max |compiled - eager| = {err:.4g} > {tol:.4g}"


def _eager_gaps(model, prompt, tokens):
    """Eager top-1 minus top-2 logit at each generated position [B, T]."""
    logits = _logits(model, torch.cat([prompt, tokens[:, :-1]], dim=1))[:, prompt.shape[1] - 1:]
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


@pytest.mark.parametrize("bits", [2, 4])
def test_generate_static_cache_compiled_equals_eager(bits):
    """transformers' own fast path: a static cache makes ``generate`` compile the decode step."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = _llama(bits)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 7), device="cuda")
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False, pad_token_id=0)
    eager = model.generate(prompt, **kw)[:, prompt.shape[1]:]
    gaps = _eager_gaps(model, prompt, eager)

    model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    torch._dynamo.utils.counters.clear()
    fast = model.generate(prompt, cache_implementation="static", **kw)[:, prompt.shape[1]:]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "generate did not compile the decode step"
    again = model.generate(prompt, cache_implementation="static", **kw)[:, prompt.shape[1]:]
    assert torch.equal(fast, again), "replaying the compiled static-cache decode changed the tokens"
    diverged = (eager != fast).any(dim=0).nonzero()
    if len(diverged):
        i = int(diverged[0])
        assert gaps[:, i].min().item() <= 2e-2, f"K={bits}: compiled tokens leave eager's at step {i}: {eager} vs {fast}"
