"""PEFT LoRA on kbit models through PEFT's own calls (get_peft_model, PeftModel.from_pretrained): adapters train
through kbit.matmul while the k-bit weights stay frozen, save, reload, stack; merging is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import kbit  # noqa: E402
from kbit.hf import from_config  # noqa: E402

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=256)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, one_thread):
    """Each family's tiny random model saved once in full precision (fp32)."""
    out = {}
    for family, (config_name, class_name, extra) in FAMILIES.items():
        path = tmp_path_factory.mktemp(family)
        config = getattr(transformers, config_name)(**COMMON, **extra)
        from_config(getattr(transformers, class_name), config, dtype=torch.float32).save_pretrained(str(path))
        out[family] = str(path)
    return out


@pytest.fixture(scope="module")
def models(folders):
    """Each folder quantized while loading (K=4), as a user of from_pretrained gets it; tests take copies."""
    return {family: transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=kbit.KbitConfig(bits=4))
            for family, path in folders.items()}


def lora_config(**kwargs):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **kwargs)


def lora_layers(pm):
    return {n: m for n, m in pm.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plain_peft_trains_saves_and_reloads(models, family, tmp_path):
    model = copy.deepcopy(models[family])
    if family == "qwen3_moe":
        assert any(isinstance(m, kbit.KbitExperts) for m in model.modules())
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        base_logits = model(ids).logits
    frozen = {name: t.clone() for name, t in model.state_dict().items()}
    pm = peft.get_peft_model(model, lora_config(modules_to_save=["lm_head"]))
    layers = lora_layers(pm)
    assert len(layers) == 2 * 2 and all(isinstance(m.get_base_layer(), kbit.KbitLinear) for m in layers.values())
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert sum("lora_" in n for n in trainable) == 2 * 2 * 2  # A and B, q and v, two layers
    assert trainable - {n for n in trainable if "lora_" in n} == {"base_model.model.lm_head.modules_to_save.default.weight"}
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
        key = name.replace(".q_proj.", ".q_proj.base_layer.").replace(".v_proj.", ".v_proj.base_layer.")
        key = key.replace("lm_head.", "lm_head.original_module.")
        assert torch.equal(state[key], t), name
    # an adapted layer computes x @ (W_hat + s * B @ A).T
    wrapped = next(iter(layers.values()))
    x = torch.randn(3, 128)
    delta = wrapped.lora_B["default"].weight @ wrapped.lora_A["default"].weight * wrapped.scaling["default"]
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), x @ (wrapped.get_base_layer().dequantize() + delta).T,
                                   rtol=1e-5, atol=1e-5)
        expect = pm(ids).logits

    pm.save_pretrained(str(tmp_path / "adapter"))
    again = peft.PeftModel.from_pretrained(copy.deepcopy(models[family]), str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, expect)  # adapters and the trained lm_head copy came back


def stored_elements(model):
    """Elements of the weights a kbit model holds quantized (buffers, not parameters)."""
    return sum(m.out_features * m.in_features if isinstance(m, kbit.KbitLinear)
               else 3 * m.num_experts * m.hidden_dim * m.intermediate_dim
               for m in model.modules() if isinstance(m, (kbit.KbitLinear, kbit.KbitExperts)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_counts_the_quantized_weights(folders, models, family, capsys, tmp_path):
    """print_trainable_parameters' "all params" is the unquantized model's count (plus the adapters), with nothing
    kbit-specific; state_dict, num_parameters() and get_memory_footprint() still describe what is stored."""
    original = transformers.AutoModelForCausalLM.from_pretrained(folders[family])
    everything = sum(p.numel() for p in original.parameters())
    model = copy.deepcopy(models[family])
    if family == "qwen3_moe":
        assert any(isinstance(m, kbit.KbitExperts) for m in model.modules())
    assert model.num_parameters() == everything - stored_elements(model)
    state = model.state_dict()  # the footprint is what is held: the saved tensors and the unsaved buffers (rotary)
    unsaved = sum(b.nbytes for name, b in model.named_buffers() if name not in state)
    assert model.get_memory_footprint() == sum(t.nbytes for t in state.values()) + unsaved
    assert not any(key.endswith("_count") for key in state)

    pm = peft.get_peft_model(model, lora_config())
    lora = sum(p.numel() for n, p in pm.named_parameters() if "lora_" in n)
    assert lora == 2 * 2 * 4 * (128 + 128)  # A [4, 128] and B [128, 4] on q_proj and v_proj of two layers
    assert pm.get_nb_trainable_parameters() == (lora, everything + lora)
    pm.print_trainable_parameters()
    assert f"trainable params: {lora:,d} || all params: {everything + lora:,d}" in capsys.readouterr().out
    models[family].save_pretrained(str(tmp_path / "kbit"))  # a kbit folder loads with the same count
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "kbit"))
    assert peft.get_peft_model(reloaded, lora_config()).get_nb_trainable_parameters() == (lora, everything + lora)


def test_modules_to_save_naming_a_kbit_layer_asks_for_deepspeed(models):
    """The README's caveat: PEFT's modules_to_save takes a module with an empty parameter carrying ds_numel (a kbit
    layer's count, kbit._counted) for a DeepSpeed ZeRO-3 one. Full-precision modules are unaffected (lm_head in
    test_plain_peft_trains_saves_and_reloads)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("deepspeed is installed: PEFT's gathering is then a no-op")
    with pytest.raises(ModuleNotFoundError, match="deepspeed"):
        peft.get_peft_model(copy.deepcopy(models["llama"]), lora_config(modules_to_save=["mlp"]))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_several_adapters(models, family, tmp_path):
    model = copy.deepcopy(models[family])
    ids = torch.randint(0, VOCAB, (1, 7))
    pm = peft.get_peft_model(model, lora_config())
    pm.add_adapter("other", peft.LoraConfig(r=2, target_modules=["o_proj"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        outputs = {}
        for adapter in ("default", "other"):
            pm.set_adapter(adapter)
            outputs[adapter] = pm(ids).logits
    assert not torch.equal(outputs["default"], outputs["other"])
    pm.save_pretrained(str(tmp_path / "adapters"))  # "other" goes to a subfolder of its name

    again = peft.PeftModel.from_pretrained(copy.deepcopy(models[family]), str(tmp_path / "adapters"))
    again.load_adapter(str(tmp_path / "adapters" / "other"), adapter_name="other")
    with torch.no_grad():
        for adapter in ("default", "other"):
            again.set_adapter(adapter)
            assert torch.equal(again(ids).logits, outputs[adapter]), adapter


@pytest.mark.parametrize("family, safe_merge", [("llama", False), ("llama", True), ("qwen3_moe", False)])
def test_merge_is_refused(models, family, safe_merge):
    pm = peft.get_peft_model(copy.deepcopy(models[family]), lora_config())
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        before = pm(ids).logits
    with pytest.raises(TypeError, match="re-quantize"):
        pm.merge_and_unload(safe_merge=safe_merge)
    assert not any(m.merged for m in lora_layers(pm).values())
    with torch.no_grad():  # nothing was merged, nothing lost
        assert torch.equal(pm(ids).logits, before)


def test_register_is_deprecated_and_harmless(models):
    import kbit.lora

    config = lora_config()
    with pytest.warns(DeprecationWarning, match="no longer needed"):
        assert kbit.lora.register(config) is config
    assert config._custom_modules is None
    with pytest.raises(TypeError, match="LoraConfig"):
        kbit.lora.register({"r": 4})
    with pytest.warns(DeprecationWarning):
        pm = peft.get_peft_model(copy.deepcopy(models["llama"]), kbit.lora.register(lora_config()))
    assert len(lora_layers(pm)) == 4


def test_all_linear_targets_the_kbit_layers(models):
    model = copy.deepcopy(models["llama"])
    kbit_names = {n for n, m in model.named_modules() if isinstance(m, kbit.KbitLinear)}
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules="all-linear"))
    wrapped = {n.removeprefix("base_model.model.") for n in lora_layers(pm)}
    assert wrapped == kbit_names  # every projection; lm_head is PEFT's to leave out


def test_lora_on_a_gpt2_conv1d_model():
    """GPT-2's Conv1D layers become KbitLinear ([out, in]); a LoRA config written for Conv1D still fits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=128, n_positions=32)
    q = kbit.quantize_model(from_config(GPT2LMHeadModel, config).eval(), bits=4, progress=False)
    with pytest.warns(UserWarning, match="fan_in_fan_out"):  # PEFT's note: the layer is an nn.Linear
        pm = peft.get_peft_model(q, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    layer = pm.base_model.model.transformer.h[0].attn.c_attn
    assert isinstance(layer.base_layer, kbit.KbitLinear) and not layer.fan_in_fan_out
    assert layer.lora_A["default"].weight.shape == (4, 128) and layer.lora_B["default"].weight.shape == (384, 4)
    ids = torch.randint(0, VOCAB, (1, 6))
    loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    assert layer.lora_A["default"].weight.grad is not None
    assert type(layer.base_layer.weight) is kbit.DequantizedWeight
    assert not any(type(m) is nn.Linear and "c_attn" in n for n, m in pm.named_modules() if "lora_" not in n)
