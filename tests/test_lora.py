"""PEFT LoRA on kbit layers (kbit.lora): adapters train through kbit.matmul while the k-bit weights stay frozen."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import kbit  # noqa: E402
import kbit.lora  # noqa: E402
from kbit.hf import from_config  # noqa: E402

VOCAB = 320


@pytest.fixture
def model(tmp_path):
    """A tiny Llama quantized while loading (K=4), as a user of from_pretrained gets it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    from_config(LlamaForCausalLM, config, dtype=torch.float32).save_pretrained(str(tmp_path))
    return transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=kbit.KbitConfig(bits=4))


def lora_config(**kwargs):
    return kbit.lora.register(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **kwargs))


def test_peft_refuses_kbit_layers_without_registration(model):
    with pytest.raises(ValueError, match="not supported"):
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))


def test_lora_trains_through_kbit_layers(model):
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        base_logits = model(ids).logits
    frozen = {name: t.clone() for name, t in model.state_dict().items()}
    pm = peft.get_peft_model(model, lora_config())
    wrapped = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(wrapped, kbit.lora.KbitLoraLinear) and isinstance(wrapped.base_layer, kbit.KbitLinear)
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # A and B, q and v, two layers
    with torch.no_grad():  # LoRA B starts at zero: the model is unchanged
        assert torch.equal(pm(ids).logits, base_logits)

    optimizer = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(4):
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        # backward runs through every kbit layer above an adapter; A's gradient is zero while B is still zero
        grads = {n: p.grad for n, p in pm.named_parameters() if "lora_B" in n or ("lora_A" in n and step)}
        assert all(g is not None and bool(g.abs().sum() > 0) for g in grads.values()), grads
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().item())
    assert losses[-1] < losses[0] - 0.05, losses

    state = pm.base_model.model.state_dict()
    for name, t in frozen.items():  # the quantized storage (and every other base tensor) is untouched
        key = name if name in state else name.replace(".q_proj.", ".q_proj.base_layer.").replace(
            ".v_proj.", ".v_proj.base_layer.")
        assert torch.equal(state[key], t), name
    # the adapted layer computes x @ (W_hat + s * B @ A).T
    x = torch.randn(3, 128)
    delta = wrapped.lora_B["default"].weight @ wrapped.lora_A["default"].weight * wrapped.scaling["default"]
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), x @ (wrapped.base_layer.dequantize() + delta).T, rtol=1e-5, atol=1e-5)


def test_adapters_save_and_load(model, tmp_path):
    pm = peft.get_peft_model(model, lora_config())
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        expect = pm(ids).logits
    pm.save_pretrained(str(tmp_path / "adapter"))
    base = pm.unload()  # the kbit model without adapters
    config = kbit.lora.register(peft.LoraConfig.from_pretrained(str(tmp_path / "adapter")))
    again = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"), config=config)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, expect)


def test_merge_is_refused(model):
    pm = peft.get_peft_model(model, lora_config())
    with pytest.raises(NotImplementedError, match="re-quantize"):
        pm.merge_and_unload()
    with pytest.raises(TypeError, match="LoraConfig"):
        kbit.lora.register({"r": 4})


def test_lora_on_a_gpt2_conv1d_model():
    """GPT-2's Conv1D layers become KbitLinear ([out, in]); a LoRA config written for Conv1D still fits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=128, n_positions=32)
    q = kbit.quantize_model(from_config(GPT2LMHeadModel, config).eval(), bits=4, progress=False)
    pm = peft.get_peft_model(q, kbit.lora.register(peft.LoraConfig(r=4, target_modules=["c_attn"],
                                                                     fan_in_fan_out=True)))
    layer = pm.base_model.model.transformer.h[0].attn.c_attn
    assert isinstance(layer, kbit.lora.KbitLoraLinear) and not layer.fan_in_fan_out
    assert layer.lora_A["default"].weight.shape == (4, 128) and layer.lora_B["default"].weight.shape == (384, 4)
    ids = torch.randint(0, VOCAB, (1, 6))
    loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    assert layer.lora_A["default"].weight.grad is not None
    assert isinstance(layer.base_layer, kbit.KbitLinear) and type(layer.base_layer.weight) is kbit.DequantizedWeight
    assert not any(isinstance(m, nn.Linear) and "c_attn" in n for n, m in pm.named_modules() if "lora" not in n)
