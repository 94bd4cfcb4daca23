import torch, kbit, transformers, time
from kbit.hf import from_config
torch.manual_seed(0)
cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
model = from_config(transformers.Qwen3ForCausalLM, cfg, dtype=torch.bfloat16).eval()
q = kbit.quantize_model(model, bits=4, progress=False, min_features=16)
for l in q.modules():
    if isinstance(l, kbit.KbitLinear):
        g = l.qweight.gemm_resident(); l.packed = l.absmax = None
        l.gemm_codes, l.gemm_absmax = g.gemm_layout()
for l in q.modules():
    if isinstance(l, kbit.KbitLinear): l.prepare()
ids = torch.randint(0, 256, (1, 6))
with torch.no_grad():
    ref = q(ids).logits
    torch._dynamo.reset()
    f = torch.compile(q, backend="eager", fullgraph=True)
    t = time.time()
    got = f(ids).logits
    print("compiled", time.time() - t, torch.equal(got, ref))
    print([l._fusion._held for l in q.modules() if isinstance(l, kbit.KbitLinear) and l._fusion][:2])
    got2 = f(ids).logits
    print(torch.equal(got2, ref))
