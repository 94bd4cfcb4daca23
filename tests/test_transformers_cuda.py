"""kbit through transformers on the GPU (skipped without CUDA): a small Llama-shaped model (head_dim 128, grouped
KV heads) and a tiny Qwen3-MoE saved to a folder, then

* ``from_pretrained(folder, quantization_config=KbitConfig(bits=4), device_map="cuda")`` quantizes on the GPU as
  it loads, into exactly what ``kbit.quantize_model`` makes of the 16-bit model, and ``generate`` gives the
  same greedy tokens;
* the kbit folder ``save_pretrained`` writes loads back onto the GPU with the same tokens.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kbit  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
]

VOCAB = 2048
CONFIGS = {
    "llama": ("LlamaConfig", dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                                  num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                                         num_experts=16, num_experts_per_tok=4, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=128, norm_topk_prob=True)),
}


def _generate(model, ids):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                         do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.fixture(scope="module", params=list(CONFIGS))
def folder(request, tmp_path_factory):
    """The 16-bit model's folder (random weights, non-trivial norms)."""
    config_name, extra = CONFIGS[request.param]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=512,
                                                **extra)
    torch.manual_seed(23)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(path))
    return request.param, path


def test_quantize_while_loading_generates_the_quantize_model_tokens(folder, tmp_path):
    family, path = folder
    load = dict(dtype=torch.float16, device_map="cuda")
    q = transformers.AutoModelForCausalLM.from_pretrained(str(path), quantization_config=kbit.KbitConfig(bits=4),
                                                          **load)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), **load)
    kbit.quantize_model(ref, bits=4, skip=kbit.hf.quantizer.default_skip(ref), progress=False)
    kinds = (kbit.KbitLinear, kbit.KbitExperts) if family == "qwen3_moe" else (kbit.KbitLinear,)
    for kind in kinds:
        names = sorted(n for n, m in q.named_modules() if isinstance(m, kind))
        assert names and names == sorted(n for n, m in ref.named_modules() if isinstance(m, kind)), kind.__name__
    qs, rs = q.state_dict(), ref.state_dict()
    assert set(qs) == set(rs)
    for key in qs:
        assert qs[key].is_cuda and qs[key].dtype == rs[key].dtype and torch.equal(qs[key], rs[key]), key

    ids = torch.randint(0, VOCAB, (2, 12), device="cuda")
    tokens = _generate(q, ids)
    assert torch.equal(tokens, _generate(ref, ids))

    q.save_pretrained(str(tmp_path))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), **load)
    assert torch.equal(_generate(again, ids), tokens)
