"""End-to-end decode speed: kbit K = 2..5 vs 16-bit weights, with CUDA graphs, on a Llama-3-8B-shaped model or a
Qwen3-MoE-shaped one (Qwen3-30B-A3B's dimensions, fewer layers).

    python benchmarks/bench_e2e.py                          # GPU: 32 layers, batch 1 and 16, K = 2..5 + fp16
    python benchmarks/bench_e2e.py --check                  # also: graph decode == eager greedy decode
    python benchmarks/bench_e2e.py --layers 4 --bits 4      # a quicker, shallower run
    python benchmarks/bench_e2e.py --model qwen3-moe --layers 4 --bits 4 --check    # MoE: kbit K=4 vs bf16
    python benchmarks/bench_e2e.py --bits 4 --no-fp16 --fuse-ab     # q/k/v, gate/up fused vs apart (--no-fuse: apart)
    python benchmarks/bench_e2e.py --bits 4 --torchao       # + torchao's int4 weight-only row (tinygemm, g128, bf16)
    python benchmarks/bench_e2e.py --device cpu --layers 2 --hidden 256 --intermediate 512 \\
        --heads 4 --kv-heads 2 --vocab 1000 --new-tokens 8 --check      # tiny end-to-end smoke run
    python benchmarks/bench_e2e.py --device cpu --model qwen3-moe --layers 2 --hidden 256 --heads 4 --kv-heads 2 \\
        --head-dim 64 --experts 8 --top-k 2 --moe-intermediate 128 --vocab 1000 --new-tokens 8 --check   # MoE smoke

``--model llama3-8b`` (default) is ``transformers.LlamaForCausalLM`` (Llama-3-8B shapes: hidden 4096, intermediate
14336, 32 heads, 8 KV heads, vocab 128256, 32 layers), in fp16 on CUDA. ``--model qwen3-moe`` is
``transformers.Qwen3MoeForCausalLM`` with Qwen3-30B-A3B's shapes (hidden 2048, 128 routed experts of intermediate
768, top-8, 32 heads / 4 KV heads of head_dim 128, vocab 151936, 48 layers; ``--layers`` takes fewer), in bf16 on
CUDA, its experts run by transformers' default experts implementation (``grouped_mm`` where it can dispatch). Both
have random weights (seeded, so every format starts from the same model), on the device; for a kbit row
``kbit.quantize_model`` swaps the Linear projections (q/k/v/o, gate/up/down; ``lm_head``, the embeddings and the
MoE routers stay 16-bit) and the routed experts (``kbit.KbitExperts``). ``--torchao`` adds a peer row: torchao's
``Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")`` (the tinygemm kernel, which takes
bf16) on the same Linear projections, the model in bf16; torchao is an optional dependency of this benchmark only.

Decoding is greedy with a ``transformers.StaticCache`` (fixed shapes, fixed addresses). One
decode step -- the model forward for one token per sequence, argmax, and advancing the position --
runs in one of three modes (``--mode``):

* ``compile`` (default on CUDA, the fastest 16-bit path): ``torch.compile(step, mode="reduce-overhead",
  dynamic=False)`` (inductor fuses norms, rotary and the rest; CUDA graphs remove launch gaps), one static graph per
  decoder (row and batch size), dynamo reset before each; kbit layers prepared by ``kbit.prepare`` first; each row
  records torch.compile's counts since its decoder compiled (``compile``: graphs, breaks, graphs run without CUDA
  graphs), and the table names a row whose step was not one CUDA graph (its time is then not a graphed step's);
* ``graph``: the eager step captured once in a ``torch.cuda.CUDAGraph`` and replayed;
* ``eager`` (default on CPU): plain calls.

``--inductor-pdl`` (``compile``, every row alike) has inductor launch its Triton kernels with programmatic dependent
launch (``torch._inductor.config.triton.enable_pdl``): a kbit GEMM after a norm or rotary kernel may then start, and
fetch its weights, while that kernel drains, as it does after another kbit GEMM (docs/DESIGN.md, dependent launch).

``--attention packed-gqa`` (every row alike) runs the decode's attention with a key/value head's query heads packed
as its query rows (``benchmarks/packed_gqa_attention.py``), where transformers' ``sdpa`` under ``torch.compile``
copies each cached key/value head for its query heads first (two kernels a layer, 600 µs of a 4.7 ms batch-16 step
on the H200).

Throughput is ``batch * new_tokens / time`` of the decode steps after the prefill (median of
``--repeats`` runs, timed with CUDA events). ``--check`` also decodes every configuration
eagerly and requires the graph (or compiled) tokens to equal the eager ones exactly (``compile``
may legitimately differ in the last bits of a logit, so it reports the first divergence instead),
and reports whether ``model.generate(do_sample=False)`` gives the same tokens. Results go to
``benchmarks/results/e2e_<device>.md`` and ``.json`` (``e2e_<model>_<device>`` for a model other than Llama).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):  # kbit; the benchmarks' modules (packed_gqa_attention)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import kbit  # noqa: E402
from kbit.hf import from_config  # noqa: E402
from kbit.timing import capture_cuda_graph  # noqa: E402

# The shape of each --model (its command-line defaults), and the dtype of its 16-bit baseline on CUDA.
MODELS = {
    "llama3-8b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
    "qwen3-moe": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936, experts=128,
                      moe_intermediate=768, top_k=8),
}
CUDA_DTYPES = {"llama3-8b": "float16", "qwen3-moe": "bfloat16"}
SHAPE_ARGS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "experts",
              "moe_intermediate", "top_k")


# ---------------------------------------------------------------------- model
def llama_config(layers, hidden, intermediate, heads, kv_heads, vocab, max_positions=8192):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def qwen3_moe_config(layers, hidden, heads, kv_heads, head_dim, vocab, experts, moe_intermediate, top_k,
                     max_positions=8192):
    """Every decoder layer sparse (Qwen3-30B-A3B: decoder_sparse_step 1, no MLP-only layers)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=experts, moe_intermediate_size=moe_intermediate,
        num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )


def model_config(model: str, shape: dict):
    return (llama_config if model == "llama3-8b" else qwen3_moe_config)(**shape)


ATTENTIONS = ("sdpa", "packed-gqa")  # --attention: transformers' sdpa, or benchmarks/packed_gqa_attention.py's


def build_model(config, device, dtype, seed: int = 0, bits=None, lm_head_bits=None, attention: str = "sdpa"):
    """The random-weight causal LM of ``config`` on ``device``; Linear projections and routed experts
    kbit-quantized if ``bits``, the lm_head too (to ``lm_head_bits``) if that is given (sibling projections fused,
    the default: ``kbit.fuse_projections`` switches that on the built model); ``attention``: one of ``ATTENTIONS``
    (``packed-gqa``: benchmarks/packed_gqa_attention.py)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    implementation = "sdpa"
    if attention == "packed-gqa":
        import packed_gqa_attention  # registers its attention with transformers

        implementation = packed_gqa_attention.ATTENTION
    torch.manual_seed(seed)
    with torch.device(device):
        model = from_config(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], config, dtype=dtype,
                            attn_implementation=implementation)
    model.eval().requires_grad_(False)
    if bits is not None:
        kbit.quantize_model(model, bits=bits, progress=False)
        if lm_head_bits:
            kbit.quantize_model(model, bits=lm_head_bits, skip=(), progress=False)  # only lm_head is left
    return model


def _nbytes(tensors) -> int:
    return sum(_tensor_bytes(t) for t in tensors)


def _tensor_bytes(t) -> int:
    """Bytes held: a tensor subclass that wraps others (torchao's int4 weights) counts the tensors it holds."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def model_bytes(model) -> dict:
    """Resident bytes of parameters and buffers (``total``; a kbit layer on the GPU holds one copy of its codes,
    the GEMM layout); the bytes every decode step reads (``per_step``: everything but the embedding table and the
    routed experts); the routed experts' bytes (``experts``: a step reads the share of them its tokens are routed
    to, ``experts_read``), with ``num_experts`` and ``top_k``."""
    total = _nbytes(list(model.parameters()) + list(model.buffers()))
    unread = _nbytes([model.get_input_embeddings().weight])
    experts = 0
    for m in model.modules():
        if isinstance(m, kbit.KbitExperts) or kbit.moe.is_fused_experts(m):
            experts += _nbytes(list(m.parameters()) + list(m.buffers()))
    config = model.config
    return {"total": total, "per_step": total - unread - experts, "experts": experts,
            "num_experts": getattr(config, "num_experts", 0), "top_k": getattr(config, "num_experts_per_tok", 0)}


def experts_read(batch: int, top_k: int, num_experts: int) -> float:
    """The expected share of a layer's experts that ``batch`` tokens routed uniformly at random (top-k distinct
    experts each; random weights route close to uniformly) read in one decode step."""
    return 1 - (1 - top_k / num_experts) ** batch if num_experts else 0.0


def step_bytes(nbytes: dict, batch: int) -> float:
    return nbytes["per_step"] + nbytes["experts"] * experts_read(batch, nbytes["top_k"], nbytes["num_experts"])


# ---------------------------------------------------------------------- decoding
def make_static_cache(config, batch: int, max_len: int, device, dtype):
    """A ``StaticCache``; keyword arguments that every transformers from 4.40 to 5.x accepts."""
    from transformers import StaticCache

    return StaticCache(config=config, max_batch_size=batch, max_cache_len=max_len, device=device, dtype=dtype)


ONE_CUDA_GRAPH = {"graphs": 1, "graph_breaks": 0, "cudagraph_skips": 0}  # a healthy compiled step on CUDA


def compile_counts() -> dict:
    """torch.compile's running counts that say whether a compiled step stayed one graph replayed as a CUDA graph:
    graphs compiled, graph breaks, and graphs inductor ran without CUDA graphs (``cudagraph_skips``: a CPU tensor,
    a mutated input, ...; only its perf_hints log says why)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


class GreedyDecoder:
    """Greedy decoding with a static KV cache; the decode step runs eagerly, as a captured CUDA
    graph (``mode="graph"``) or through ``torch.compile(mode="reduce-overhead")``.

    The step reads the current tokens ``self.tok`` [B, 1] and position ``self.pos`` [1] and writes
    the next tokens and position back in place, so a captured graph needs no inputs.
    """

    def __init__(self, model, batch: int, max_len: int, mode: str = "eager"):
        if mode not in ("eager", "graph", "compile"):
            raise ValueError(f"mode must be eager, graph or compile, got {mode!r}")
        emb = model.get_input_embeddings().weight
        self.model, self.batch, self.max_len, self.mode = model, batch, max_len, mode
        self.device, self.dtype = emb.device, emb.dtype
        if mode == "graph" and self.device.type != "cuda":
            raise ValueError("mode='graph' needs a CUDA model")
        self.cache = make_static_cache(model.config, batch, max_len, self.device, self.dtype)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        params = inspect.signature(model.forward).parameters
        self._cache_position = "cache_position" in params  # transformers < 5.x-ish; newer caches track it
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.graph = None
        self.compiled = None
        self._counts_before = None  # compile_counts() before this decoder's step was compiled

    def _logits(self, ids, positions):
        kw = {"input_ids": ids, "position_ids": positions.unsqueeze(0).expand(ids.shape[0], -1),
              self._cache_kw: self.cache, "use_cache": True}
        if self._cache_position:
            kw["cache_position"] = positions
        if self._logits_kw:
            kw[self._logits_kw] = 1
        return self.model(**kw).logits[:, -1, :]

    def _step(self):
        nxt = self._logits(self.tok, self.pos).argmax(dim=-1, keepdim=True)
        self.tok.copy_(nxt)
        self.pos.add_(1)

    def _next_token(self, tok, pos):  # the function torch.compile sees
        return self._logits(tok, pos).argmax(dim=-1, keepdim=True)

    @torch.no_grad()
    def prefill(self, prompt):
        """Reset the cache and run the prompt [B, P]; returns the first generated tokens [B, 1]."""
        if prompt.shape[0] != self.batch:
            raise ValueError(f"prompt batch {prompt.shape[0]} != decoder batch {self.batch}")
        self.cache.reset()
        P = prompt.shape[1]
        logits = self._logits(prompt.to(self.device), torch.arange(P, device=self.device))
        self.tok.copy_(logits.argmax(dim=-1, keepdim=True))
        self.pos.fill_(P)
        return self.tok.clone()

    @torch.no_grad()
    def prepare(self, prompt, warmup: int = 3):
        """Capture the graph / compile the step, or (eager) run it: ``warmup`` steps in every mode, so that no timed
        step loads a kernel, plans a GEMM or builds an attention plan for the first time (this dirties the cache:
        ``prefill`` again after)."""
        self.prefill(prompt)
        if self.mode == "graph":  # warm-up calls derive kbit's GEMM layouts before the capture
            # one replay after capture, not warm_seconds of them: each step advances the cache, and on a small model
            # 30 ms of replays wrote past max_len (index_copy_ out of bounds in the StaticCache)
            self.graph = capture_cuda_graph([self._step], warmup_calls=warmup, warm_seconds=0.0)
        elif self.mode == "compile":
            kbit.prepare(self.model)  # GEMM layouts exist (and are static) before anything is captured
            # A fresh, static graph per decoder, as a server keeps one per batch size: dynamo caches by code object,
            # which every decoder's _next_token shares, so without the reset a second batch size or model recompiled
            # it with the batch dimension symbolic (automatic dynamic shapes), and past the recompile limit ran eagerly.
            torch._dynamo.reset()
            self._counts_before = compile_counts()
            self.compiled = torch.compile(self._next_token, mode="reduce-overhead", dynamic=False)
        if self.mode != "graph":  # the capture ran its own warm-up calls
            for _ in range(warmup):
                self.step()
        return self

    def compile_report(self) -> dict:
        """``compile_counts`` since this decoder compiled its step (mode ``compile``): a healthy step is one graph, no
        break, no skip on CUDA (every CPU graph is a skip: CUDA graphs are CUDA's)."""
        now = compile_counts()
        return {k: now[k] - self._counts_before[k] for k in now}

    def step(self):
        if self.mode == "graph":
            self.graph.replay()
        elif self.mode == "compile":
            nxt = self.compiled(self.tok, self.pos)
            self.tok.copy_(nxt)
            self.pos.add_(1)
        else:
            self._step()

    @torch.no_grad()
    def generate(self, prompt, new_tokens: int):
        """Greedy tokens [B, 1 + new_tokens]: the prefill's token, then one per decode step."""
        if prompt.shape[1] + new_tokens + 1 > self.max_len:
            raise ValueError(f"prompt {prompt.shape[1]} + {new_tokens} tokens exceed max_len={self.max_len}")
        out = torch.empty(self.batch, new_tokens + 1, dtype=torch.long, device=self.device)
        out[:, :1] = self.prefill(prompt)
        for i in range(new_tokens):
            self.step()
            out[:, i + 1:i + 2].copy_(self.tok)
        return out

    @torch.no_grad()
    def time_decode(self, prompt, new_tokens: int, repeats: int = 3) -> float:
        """Median seconds for ``new_tokens`` decode steps after a prefill."""
        times = []
        for _ in range(repeats):
            self.prefill(prompt)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(new_tokens):
                    self.step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                for _ in range(new_tokens):
                    self.step()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def fused_groups(model) -> list:
    """[launching, all]: the model's groups of sibling projections (kbit.fusion) and how many of them still run as one
    GEMM launch (switched on, their stacked layout built: on CUDA); a group that met a call pattern it cannot fuse
    switches itself off for good, which this shows."""
    groups = {id(m._fusion): m._fusion for m in model.modules()
              if isinstance(m, kbit.KbitLinear) and m._fusion is not None}
    return [sum(g.launching for g in groups.values()), len(groups)]


@torch.no_grad()
def prefill_decoder(model, prompt) -> "GreedyDecoder":
    """An eager decoder with a static cache for a [1, P] prompt, warmed up (cuBLAS heuristics, kbit's plans and
    dequantize workspace)."""
    dec = GreedyDecoder(model, 1, -(-(prompt.shape[1] + 8) // 64) * 64, mode="eager")
    dec.prefill(prompt)
    return dec


@torch.no_grad()
def time_prefill(model, prompt, repeats: int) -> float:
    """Median seconds from a [1, P] prompt to its first token (eager forward into a static cache)."""
    dec = prefill_decoder(model, prompt)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.prefill(prompt)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# Kernel-name substrings per group of the step profile, first match wins. Inductor's kernels come first: their names
# list the ops fused into them (an RMSNorm fused with the next GEMM's input cast reads "..._gemm_mean_...", a rotary
# embedding "..._scaled_dot_product_..."), which would otherwise count them as GEMMs or attention.
KERNEL_GROUPS = (("Triton (inductor)", ("triton_",)), ("kbit GEMM", ("kbit",)),
                 ("cuBLAS GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
                 ("attention", ("flash", "attention", "fmha", "sdpa")), ("collectives", ("nccl",)))


def kernel_group(name: str) -> str:
    """The group (``KERNEL_GROUPS``, first match wins, case-insensitive; else "other kernels") of a CUDA kernel."""
    name = name.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "other kernels")


TOP_KERNELS = 12  # the largest kernels by time, named in the JSON: what a group's time is made of


def kernel_time_by_group(kernels, runs: int) -> dict:
    """``kernels``: (name, total GPU microseconds, launches) of each CUDA kernel a profile saw over ``runs`` runs of the
    same work: microseconds per run by group (``kernel_group``) and launches per run; ``top_kernels``: the
    ``TOP_KERNELS`` largest as [name, group, µs per run, launches per run]."""
    groups = {name: 0.0 for name, _ in KERNEL_GROUPS}
    groups["other kernels"] = 0.0
    for name, us, _ in kernels:
        groups[kernel_group(name)] += us / runs
    top = sorted(kernels, key=lambda kernel: -kernel[1])[:TOP_KERNELS]
    return {"kernel_us_per_step": groups, "kernels_per_step": sum(count for _, _, count in kernels) / runs,
            "top_kernels": [[name[:160], kernel_group(name), us / runs, count / runs] for name, us, count in top]}


def _profiled_kernels(work, runs: int, trace: Optional[str] = None) -> dict:
    """``work()`` run ``runs`` times under the torch profiler (CUDA kernels only), grouped by kernel_time_by_group.
    With ``trace`` (a file name) the host's side is recorded too and the whole written there as a Chrome trace: what
    the CPU did while the GPU sat idle."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(runs):
            work()
        torch.cuda.synchronize()
    if trace:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)
    kernels = []
    for ev in prof.key_averages():
        if ev.device_type == DeviceType.CUDA:
            us = getattr(ev, "self_device_time_total", None)
            kernels.append((ev.key, ev.self_cuda_time_total if us is None else us, ev.count))
    return kernel_time_by_group(kernels, runs)


@torch.no_grad()
def profile_steps(dec: "GreedyDecoder", prompt, steps: int = 16, trace: Optional[str] = None) -> dict:
    """GPU kernel time per decode step by group (torch profiler), in microseconds; ``trace``: see _profiled_kernels."""
    dec.prefill(prompt)
    return _profiled_kernels(dec.step, steps, trace)


@torch.no_grad()
def profile_prefill(model, prompt) -> dict:
    """GPU kernel time of one eager prefill of ``prompt`` [1, P] by group, as time_prefill runs it (its launches
    tell whether the sibling projections ran as one GEMM)."""
    dec = prefill_decoder(model, prompt)
    return _profiled_kernels(lambda: dec.prefill(prompt), 1)


def hf_generate(model, prompt, new_tokens: int):
    """``model.generate`` greedy tokens [B, 1 + new_tokens] (dynamic cache), for comparison."""
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens + 1,
                         do_sample=False, pad_token_id=0)
    return out[:, prompt.shape[1]:]


# ---------------------------------------------------------------------- driver
def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "_", name.split()[0] if name else "cuda").strip("_") or "cuda"


def use_inductor_pdl(mode: str) -> bool:
    """Switch inductor's programmatic dependent launch on for the rest of the process (``--inductor-pdl``)."""
    import torch._inductor.config as inductor_config

    if mode != "compile":
        raise SystemExit(f"--inductor-pdl: inductor compiles only in mode compile, not {mode}")
    if not hasattr(inductor_config.triton, "enable_pdl"):
        raise SystemExit(f"--inductor-pdl: torch {torch.__version__}'s inductor has no triton.enable_pdl")
    inductor_config.triton.enable_pdl = True
    return True


def run(args, on_row=None) -> dict:
    """Every row's measurements; ``on_row(result so far)`` after each row, so that a run cut short keeps its rows."""
    device = torch.device(args.device)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[
        args.dtype if args.dtype != "auto" else (CUDA_DTYPES[args.model] if device.type == "cuda" else "float32")]
    mode = args.mode if args.mode != "auto" else ("compile" if device.type == "cuda" else "eager")
    shape = {k: getattr(args, k) for k in MODELS[args.model]}
    config = model_config(args.model, shape)
    batches = [int(b) for b in args.batch.split(",") if b]
    formats = ([None] if not args.no_fp16 else []) + [int(b) for b in args.bits.split(",") if b]
    max_len = -(-(args.prompt_len + max(args.new_tokens, args.check_tokens) + 8) // 64) * 64
    gen = torch.Generator().manual_seed(args.seed)
    prompts = {b: torch.randint(0, args.vocab, (b, args.prompt_len), generator=gen).to(device) for b in batches}

    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "kbit": kbit.__version__,
           "python": platform.python_version(), "device": str(device), "date": datetime.date.today().isoformat()}
    env["git"] = _git_revision()
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    experts_implementation = getattr(config, "_experts_implementation", None)
    if experts_implementation is not None:
        env["experts_implementation"] = experts_implementation
    if args.inductor_pdl:
        env["inductor_pdl"] = use_inductor_pdl(mode)
    env["attention"] = args.attention

    def summary(rows: list, ok: bool) -> dict:
        return {"model": args.model, "shape": shape, "dtype": str(dtype).replace("torch.", ""), "mode": mode,
                "prompt_len": args.prompt_len, "prefill_len": args.prefill_len, "new_tokens": args.new_tokens,
                "repeats": args.repeats, "max_cache_len": max_len, "env": env, "rows": list(rows),
                "check_passed": ok if args.check else None}

    rows = []
    ok = True
    model, built_bits = None, None
    for bits, fused in row_settings(formats, args):
        label = "fp16" if bits is None else TORCHAO_LABEL if bits == TORCHAO else f"kbit K={bits}"
        if bits is None and dtype != torch.float16:
            label = str(dtype).replace("torch.", "")
        t0 = time.perf_counter()
        if bits is not None and args.quantize_lm_head:
            label += f" + lm_head K={args.quantize_lm_head}"
        if fused is False:
            label += ", q/k/v gate/up apart"
        if model is None or bits != built_bits:  # --fuse-ab: both settings on one quantized model
            model = built_bits = None
            gc.collect()
            if bits == TORCHAO:
                model = build_torchao_int4(config, device, seed=args.seed, attention=args.attention)
            else:
                model = build_model(config, device, dtype, seed=args.seed, bits=bits,
                                    lm_head_bits=args.quantize_lm_head, attention=args.attention)
            built_bits = bits
        if fused is not None:
            kbit.fuse_projections(model, fused)
        nbytes = model_bytes(model)
        row = {"format": label, "bits": None if bits == TORCHAO else bits, "peer": bits == TORCHAO,
               "fused_projections": fused, "resident_bytes": nbytes["total"],
               "build_s": time.perf_counter() - t0, "batches": {}}
        for b in batches:
            res = {"bytes_per_step": step_bytes(nbytes, b)}
            dec = GreedyDecoder(model, b, max_len, mode=mode).prepare(prompts[b])
            if args.check:
                n = args.check_tokens
                eager = GreedyDecoder(model, b, max_len, mode="eager")
                ref = eager.generate(prompts[b], n)
                got = dec.generate(prompts[b], n)
                same = bool(torch.equal(ref, got))
                res["check_tokens"] = n
                res["graph_equals_eager"] = same
                if not same:
                    diff = (ref != got).any(dim=0).nonzero()
                    res["first_divergence"] = int(diff[0]) if len(diff) else None
                    if mode != "compile":
                        ok = False
                hf = hf_generate(model, prompts[b], n)
                res["hf_generate_equals_eager"] = bool(torch.equal(hf.to(ref.device), ref))
                if device.type == "cpu" and not res["hf_generate_equals_eager"] and args.strict_generate:
                    ok = False
                del eager
            if not args.no_timing:
                secs = dec.time_decode(prompts[b], args.new_tokens, args.repeats)
                res["decode_s"] = secs
                res["tokens_per_s"] = b * args.new_tokens / secs
                res["steps_per_s"] = args.new_tokens / secs
                res["effective_GBps"] = res["bytes_per_step"] * args.new_tokens / secs / 1e9
            if mode == "compile":
                res["compile"] = dec.compile_report()
                if device.type == "cuda" and res["compile"] != ONE_CUDA_GRAPH:
                    print(f"warning: {label} batch {b}: the compiled step is not one CUDA graph ({res['compile']}): "
                          "its time is not a CUDA-graphed step's (TORCH_LOGS=perf_hints says why)", file=sys.stderr)
            if args.profile and device.type == "cuda":
                trace = args.trace and str(Path(args.trace) / f"{re.sub(r'[^a-z0-9]+', '_', label.lower())}_b{b}.json")
                res["profile"] = profile_steps(dec, prompts[b], trace=trace)
            row["batches"][str(b)] = res
            print(f"{label:>10}  batch {b:>3}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), file=sys.stderr,
                flush=True)
            del dec
        if args.prefill_len and device.type == "cuda" and not args.no_timing:
            prompt = torch.randint(0, args.vocab, (1, args.prefill_len), generator=gen).to(device)
            row["prefill_s"] = time_prefill(model, prompt, args.repeats)
            if args.profile:
                row["prefill_profile"] = profile_prefill(model, prompt)
            if bits not in (None, TORCHAO):
                row["fused_groups_launching"] = fused_groups(model)
            print(f"{label:>10}  prefill {args.prefill_len}: {1e3 * row['prefill_s']:.1f} ms"
                  + "".join(f", {k}={row[k]}" for k in ("fused_groups_launching", "prefill_profile") if k in row),
                  file=sys.stderr, flush=True)
        rows.append(row)
        if on_row is not None:
            on_row(summary(rows, ok))
        print(f"{label:>10}  row done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del model
    return summary(rows, ok)


def row_settings(formats, args) -> list:
    """(bits, fused) of each row: fp16 (None, None); a kbit format with its sibling projections fused (one GEMM launch
    for q/k/v and one for gate/up, the default), apart with ``--no-fuse``, or both with ``--fuse-ab``; last, with
    ``--torchao``, torchao's int4 (TORCHAO, None): its build and compilation take minutes, so a run cut short by a
    time limit keeps the kbit rows."""
    fused = (True, False) if args.fuse_ab else (not args.no_fuse,)
    settings = []
    for bits in formats:
        settings += [(None, None)] if bits is None else [(bits, f) for f in fused]
    if args.torchao:
        settings.append((TORCHAO, None))
    return settings


TORCHAO, TORCHAO_LABEL = "torchao", "torchao int4 g128 (bf16)"


def build_torchao_int4(config, device, seed: int, attention: str = "sdpa"):
    """The same random model in bf16 with torchao's int4 weight-only quantization (tinygemm layout, groups of 128) on
    the Linear projections kbit quantizes (``lm_head`` stays 16-bit, as in the kbit rows)."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_
    except ImportError as e:
        raise SystemExit(f"--torchao needs torchao (pip install torchao): {e}") from None
    model = build_model(config, device, torch.bfloat16, seed=seed, attention=attention)
    quantize_(model, Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"),
              filter_fn=lambda module, name: type(module) is torch.nn.Linear and name.rpartition(".")[2] != "lm_head")
    return model


def _git_revision() -> str:
    """``<short hash>[+dirty]`` of the checkout, or "unknown" (the kernels change fast: record which ran)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "kbit"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head + ("+dirty" if dirty else "")) if head else "unknown"
    except Exception:
        return "unknown"


def markdown(result: dict) -> str:
    s, env = result["shape"], result["env"]
    batches = sorted({int(b) for r in result["rows"] for b in r["batches"]})
    base = next((r for r in result["rows"] if r["bits"] is None and not r.get("peer")), None)
    head = (f"{_describe_model(result.get('model', 'llama3-8b'), s)}, random weights, "
            f"{result['dtype']}, greedy decode with a static KV cache, mode `{result['mode']}`, "
            f"prompt {result['prompt_len']}, {result['new_tokens']} timed tokens, median of {result['repeats']}; "
            f"{env.get('gpu', env['device'])}, torch {env['torch']}, transformers {env['transformers']}, "
            f"{env['date']}" + ("; inductor's Triton kernels with programmatic dependent launch" if
                                 env.get("inductor_pdl") else "")
            + ("; decode attention with grouped-query heads packed" if env.get("attention") == "packed-gqa" else "")
            + ".")
    base_name = base["format"] if base else "fp16"
    cols = ["weights", "resident GB"]
    for b in batches:
        cols += [f"B={b} tok/s", f"B={b} vs {base_name}", f"B={b} eff. GB/s"]
    prefill = any("prefill_s" in r for r in result["rows"])
    if prefill:
        cols += [f"TTFT {result['prefill_len']} ms", f"TTFT vs {base_name}"]
    checked = any("graph_equals_eager" in res for r in result["rows"] for res in r["batches"].values())
    if checked:
        cols.append(f"{result['mode']} tokens == eager")
    lines = [head, "", "| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in result["rows"]:
        gb = r["resident_bytes"] / 1e9
        cells = [r["format"], f"{gb:.2f}" if gb >= 0.1 else f"{gb:.4f}"]
        for b in batches:
            res = r["batches"].get(str(b), {})
            tps = res.get("tokens_per_s")
            ref = base["batches"].get(str(b), {}).get("tokens_per_s") if base else None
            cells += [f"{tps:.1f}" if tps else "-", f"{tps / ref:.2f}x" if tps and ref else "-",
                      f"{res['effective_GBps']:.0f}" if res.get("effective_GBps", 0) >= 10
                      else f"{res['effective_GBps']:.3f}" if "effective_GBps" in res else "-"]
        if prefill:
            ttft, ref = r.get("prefill_s"), base.get("prefill_s") if base else None
            cells += [f"{1e3 * ttft:.1f}" if ttft else "-", f"{ttft / ref:.2f}x" if ttft and ref else "-"]
        if checked:
            flags = [res.get("graph_equals_eager") for res in r["batches"].values()]
            cells.append("yes" if all(flags) else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("resident GB: parameters and buffers on the device (``resident_bytes``; a kbit layer on the GPU holds "
                 "its GEMM layout alone). eff. GB/s: the weight bytes one decode step reads (all but the embedding table; "
                 "routed experts at the share a batch's tokens reach under uniform routing), times steps/s (KV-cache "
                 "traffic not counted).")
    if prefill:
        lines.append(f"TTFT: batch 1, a {result['prefill_len']}-token prompt, eager forward into the static cache.")
    lost = [f"{r['format']} batch {b}" for r in result["rows"] for b, res in r["batches"].items()
            if res.get("compile", ONE_CUDA_GRAPH) != ONE_CUDA_GRAPH]
    if lost and env["device"].startswith("cuda"):
        lines.append("Not one CUDA graph per compiled step (more graphs, graph breaks or graphs run without CUDA "
                     "graphs: each row's ``compile`` in the JSON): " + ", ".join(lost) + ".")
    lines += _profile_table(result)
    return "\n".join(lines) + "\n"


def _describe_model(model: str, s: dict) -> str:
    if model == "qwen3-moe":
        return (f"Qwen3-MoE-shaped model ({s['layers']} layers, hidden {s['hidden']}, {s['experts']} routed experts of "
                f"intermediate {s['moe_intermediate']}, top-{s['top_k']}, {s['heads']} heads / {s['kv_heads']} KV heads "
                f"of {s['head_dim']}, vocab {s['vocab']})")
    return (f"Llama-shaped model ({s['layers']} layers, hidden {s['hidden']}, intermediate {s['intermediate']}, "
            f"{s['heads']} heads / {s['kv_heads']} KV heads, vocab {s['vocab']})")


def _profile_table(result: dict) -> list:
    # (weights, what ran, its time in µs or None, its profile): each decode batch's step, then each row's prefill
    rows = [(r["format"], b, 1e6 / res["steps_per_s"] if res.get("steps_per_s") else None, res["profile"])
            for r in result["rows"] for b, res in r["batches"].items() if "profile" in res]
    rows += [(r["format"], f"prefill {result['prefill_len']}", 1e6 * r["prefill_s"] if "prefill_s" in r else None,
              r["prefill_profile"]) for r in result["rows"] if "prefill_profile" in r]
    if not rows:
        return []
    lines = ["", "Where one decode step's (and one prefill's) time goes (torch profiler, GPU kernel time, µs; idle = "
             "the time minus kernel time: launch gaps and host work):", "",
             "| " + " | ".join(["weights", "batch"] + PROFILE_HEADERS) + " |",
             "|---|---:|" + "---:|" * len(PROFILE_HEADERS)]
    for fmt, ran, us, prof in rows:
        lines.append("| " + " | ".join(str(c) for c in [fmt, ran] + profile_cells(us, prof)) + " |")
    return lines


PROFILE_GROUPS = [g for g, _ in KERNEL_GROUPS] + ["other kernels"]
PROFILE_HEADERS = ["µs"] + PROFILE_GROUPS + ["idle", "kernels"]  # the columns of profile_cells


def profile_cells(us: Optional[float], prof: dict) -> list:
    """A step-profile table's cells after a row's labels: its time (µs, "-" where not timed), kernel µs per group,
    idle (the time less kernel time) and kernels launched."""
    busy = sum(prof["kernel_us_per_step"].values())
    return ([f"{us:.0f}" if us else "-"] + [f"{prof['kernel_us_per_step'][g]:.0f}" for g in PROFILE_GROUPS]
            + [f"{us - busy:.0f}" if us else "-", f"{prof['kernels_per_step']:.0f}"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="llama3-8b", choices=tuple(MODELS),
                   help="llama3-8b (dense) or qwen3-moe (Qwen3-30B-A3B's shapes); the shape options default to its")
    for k in SHAPE_ARGS:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--bits", default="2,3,4,5", help="comma-separated K values ('' for fp16 only)")
    p.add_argument("--no-fp16", action="store_true", help="skip the fp16 baseline row")
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128, help="timed decode steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"),
                   help="auto: float32 on CPU; on CUDA float16 for llama3-8b, bfloat16 for qwen3-moe")
    p.add_argument("--mode", default="auto", choices=("auto", "graph", "compile", "eager"),
                   help="how a decode step runs (auto: compile on CUDA, the best fp16 path; eager on CPU)")
    p.add_argument("--check", action="store_true", help="compare graph/compiled decoding with eager greedy decoding")
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--strict-generate", action="store_true",
                   help="with --check on CPU, also fail when model.generate differs from the static-cache loop")
    p.add_argument("--no-timing", action="store_true", help="check only")
    p.add_argument("--prefill-len", type=int, default=2048,
                   help="time to first token of a batch-1 prompt this long (CUDA; 0: skip)")
    p.add_argument("--quantize-lm-head", type=int, default=0, metavar="BITS",
                   help="also quantize lm_head (to 4 or 5 bits, say) in the kbit rows (default: fp16)")
    p.add_argument("--no-fuse", action="store_true",
                   help="kbit rows: q/k/v and gate/up as separate GEMM launches (kbit.fuse_projections(model, False))")
    p.add_argument("--fuse-ab", action="store_true",
                   help="kbit rows: each K timed fused and then apart, on one quantized model")
    p.add_argument("--torchao", action="store_true",
                   help="also time torchao's int4 weight-only model (tinygemm, groups of 128, bf16): a peer row")
    p.add_argument("--profile", action="store_true",
                   help="GPU kernel time per decode step and per prefill by group (kbit GEMM, cuBLAS, attention, "
                        "other) and kernel launches")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: each profiled decode batch's steps as a Chrome trace (CPU and CUDA) in DIR")
    p.add_argument("--attention", default="sdpa", choices=ATTENTIONS,
                   help="every row's attention: transformers' sdpa, or packed-gqa (decode reads each cached key/value "
                        "head once for its query heads; benchmarks/packed_gqa_attention.py)")
    p.add_argument("--inductor-pdl", action="store_true",
                   help="compile mode: inductor's Triton kernels launched with programmatic dependent launch "
                        "(torch._inductor.config.triton.enable_pdl), in every row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", default=None, help="results file suffix (default: the device, e.g. h100)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    unused = [k for k in SHAPE_ARGS if getattr(args, k) is not None and k not in MODELS[args.model]]
    if unused:
        p.error(f"--model {args.model} has no {', '.join('--' + k.replace('_', '-') for k in unused)}")
    for k, v in MODELS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def write(result: dict, args) -> Path:
    """The result as ``e2e_<tag>.md`` and ``.json`` in ``--out-dir``; returns the markdown file."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or device_slug(torch.device(args.device))
    if not args.tag and args.model != "llama3-8b":
        tag = f"{args.model.replace('-', '_')}_{tag}"
    (out / f"e2e_{tag}.md").write_text(f"# kbit end-to-end decode ({tag})\n\n" + markdown(result))
    (out / f"e2e_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    return out / f"e2e_{tag}.md"


def main(argv=None) -> int:
    args = parse_args(argv)
    written = []  # the files after each row; the last row's hold the whole result
    result = run(args, on_row=None if args.no_write else lambda partial: written.append(write(partial, args)))
    print(markdown(result))
    if result["check_passed"] is not None:
        print("check: " + ("PASSED" if result["check_passed"] else "FAILED"), file=sys.stderr)
    if written:
        print(f"wrote {written[-1]} and .json", file=sys.stderr)
    return 0 if result["check_passed"] in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
