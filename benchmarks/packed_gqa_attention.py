"""The benchmarks' ``--attention packed-gqa``: transformers' SDPA attention with grouped-query decode packed.

At one query token per sequence, transformers' ``sdpa`` attention under ``torch.compile`` repeats each key/value head
for its query heads (``repeat_kv``: a copy of the whole static cache, two kernels a layer) before SDPA reads the
copies; it packs the query heads instead only outside ``torch.compile``. Packed, a key/value head's query heads are
its query rows: query (batch, heads, 1, dim) viewed as (batch, kv_heads, heads / kv_heads, dim), so SDPA reads each
cached key and value once and nothing is copied; the mask (batch, 1, 1, length) broadcasts over the rows as it did
over the heads. The same products and softmax per (head, position) as the repeated form: the model's output is the
same up to the order SDPA sums in. Every other call (prompts, masks per head, position biases) is transformers'
``sdpa``, unchanged. Registered as ``ATTENTION`` with transformers' ``AttentionInterface`` and, with sdpa's masks,
its ``AttentionMaskInterface``; each benchmark row (fp16, kbit, torchao) takes the same attention.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "sdpa_packed_gqa"


def packed_gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                    **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_length, dim = query.shape
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    if groups == 1 or q_length != 1 or not shared_mask or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    packed = query.reshape(batch, heads // groups, groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling)
    return out.reshape(out.shape[0], heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, packed_gqa_sdpa)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # sdpa's masks: an attention without one gets none at all
