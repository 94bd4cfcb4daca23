"""Tensor parallel kbit models (kbit.tensor_parallel): storage shards against the whole weight, then two processes
on gloo (CPU) running a tiny Llama and a tiny Qwen3-MoE at TP=2 against TP=1."""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

import kbit
from kbit import tensor_parallel as tp

transformers = pytest.importorskip("transformers")

WORLD = 2
JOB_TIMEOUT_S = 120
RANK_STACKS_ENV = "KBIT_TEST_RANK_STACKS_S"  # seconds between each rank's stack dumps (unset: none)
VOCAB = 320


# ----------------------------------------------------------------------------- storage shards, one process
@pytest.mark.parametrize("bits", [2, 4, 5])
def test_column_shards_are_the_rows_of_the_whole_weight(bits):
    W = torch.randn(96, 200)  # in_features padded to 224: shards keep the padding of each row
    qw = kbit.quantize(W, bits=bits)
    whole = qw.dequantize()
    parts = [tp.column_shard(qw, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), whole)
    assert sum(p.packed.numel() for p in parts) == qw.packed.numel()
    assert parts[0].packed.untyped_storage().data_ptr() != qw.packed.untyped_storage().data_ptr()


@pytest.mark.parametrize("bits", [3, 4])
def test_row_shards_are_whole_blocks_of_every_row(bits):
    W = torch.randn(40, 256)
    qw = kbit.quantize(W, bits=bits)
    parts = [tp.row_shard(qw, r, 4) for r in range(4)]
    assert all(p.shape == (40, 64) for p in parts)
    assert torch.equal(torch.cat([p.dequantize() for p in parts], dim=1), qw.dequantize())
    x = torch.randn(3, 256)
    partial = sum(kbit.matmul(x[:, 64 * r:64 * (r + 1)], p) for r, p in enumerate(parts))
    torch.testing.assert_close(partial, kbit.matmul(x, qw), rtol=1e-5, atol=1e-5)


def _experts_weight(E, N, K, bits):
    """A QuantizedWeight [E, N, K] (each row kbit.quantize of one expert) and its experts' 2-D weights."""
    each = [kbit.quantize(torch.randn(N, K) * (e + 1), bits=bits) for e in range(E)]
    packed, absmax, scale = (torch.stack([getattr(q, key) for q in each]) for key in ("packed", "absmax", "scale"))
    return kbit.QuantizedWeight(packed, absmax, each[0].codebook, scale, bits, (E, N, K), torch.float32), each


def test_shards_of_a_weight_with_experts_are_each_experts_shards():
    qw, each = _experts_weight(3, 48, 128, 3)
    for r in range(2):
        rows, cols = tp.column_shard(qw, r, 2), tp.row_shard(qw, r, 2)
        assert rows.shape == (3, 24, 128) and cols.shape == (3, 48, 64)
        for e, q in enumerate(each):
            for got, want in ((rows[e], tp.column_shard(q, r, 2)), (cols[e], tp.row_shard(q, r, 2))):
                assert torch.equal(got.packed, want.packed) and torch.equal(got.absmax, want.absmax)
                assert torch.equal(got.scale, q.scale)
        halves = tp.column_shard(qw, r, 2, groups=2)  # gate rows, then up rows: each half split
        want = qw.dequantize().view(3, 2, 2, 12, 128)[:, :, r].reshape(3, 24, 128)
        assert torch.equal(halves.dequantize(), want)
    with pytest.raises(ValueError, match="out_features=48 does not split into 5 equal column shards of each of its 2"):
        tp.column_shard(qw, 0, 5, groups=2)


class _Rank(tp.RankGroup):
    """A rank of a group without torch.distributed: what sharding reads (it does not communicate)."""

    def __init__(self, rank: int, world: int):
        self.group, self.rank, self.world = None, rank, world


@pytest.mark.parametrize("resident", [False, True])
def test_experts_shards_hold_each_experts_gate_up_and_down_slices(resident):
    E, H, I = 3, 64, 64
    whole, _ = kbit.KbitExperts.from_weights(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05, bits=3)
    gate_up, down = whole.dequantize("gate_up"), whole.dequantize("down")
    if resident:
        whole._hold_layout()  # GEMM-resident, as on CUDA: the shards come from the storage derived from the layouts
    for r in range(2):
        local, how = tp._shard_experts(whole, _Rank(r, 2))
        assert how == "shard of every expert" and local.intermediate_dim == I // 2
        lo, hi = r * I // 2, (r + 1) * I // 2
        assert torch.equal(local.dequantize("gate_up"), torch.cat([gate_up[:, lo:hi], gate_up[:, I + lo:I + hi]], 1))
        assert torch.equal(local.dequantize("down"), down[:, :, lo:hi])


def test_row_split_needs_whole_blocks_and_whole_hadamard_blocks():
    assert tp.row_split_problem(256, 2) is None
    assert tp.row_split_problem(256, 2, rotation_block=128) is None
    assert "Hadamard blocks of 256" in tp.row_split_problem(256, 2, rotation_block=256)
    assert "blocks of 32" in tp.row_split_problem(96, 2)  # 48 per rank: a block would straddle two ranks
    with pytest.raises(ValueError, match="blocks of 32"):
        tp.row_shard(kbit.quantize(torch.randn(8, 96)), 0, 2)
    with pytest.raises(ValueError, match="out_features=9"):
        tp.column_shard(kbit.quantize(torch.randn(9, 64)), 0, 2)


@pytest.mark.parametrize("rotate", [False, True])
def test_a_gemm_resident_row_shard_sums_its_layout_product_then_adds_the_bias(rotate, monkeypatch):
    """A row-parallel shard holding its GEMM layout (CUDA's state, made by hand on the CPU) multiplies from its buffers
    as a whole KbitLinear does, without reading its QuantizedWeight view, all-reduces, then adds the bias once."""
    torch.manual_seed(0)
    qw = kbit.quantize(torch.randn(48, 64, dtype=torch.bfloat16), bits=4)
    rotation = kbit.rotation.Rotation(torch.randint(0, 2, (64,), dtype=torch.int8) * 2 - 1, 32) if rotate else None
    bias = torch.randn(48, dtype=torch.bfloat16)
    layer = tp.local_linear(tp.RowParallelKbitLinear, qw, bias, rotation, SimpleNamespace(group=None, rank=0, world=2))
    layer._hold_layout()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = kbit.matmul(x if rotation is None else rotation.rotate(x), layer.qweight) * 2 + bias
    monkeypatch.setattr(tp, "_all_reduce", lambda y, group: y * 2)  # two ranks holding the same shard
    monkeypatch.setattr(kbit.KbitLinear, "qweight", property(lambda self: pytest.fail("read the weight view")))
    assert torch.equal(layer(x), want)


def test_the_all_reduce_is_the_collective_unless_asked_and_off_cuda_always(monkeypatch):
    """KBIT_TP_ALL_REDUCE: the process group's collective by default, symmetric on request, anything else refused
    by name; a CPU tensor (gloo) is summed by the collective whatever it says (symmetric memory is on a GPU)."""
    from kbit import symmetric_all_reduce as sar

    monkeypatch.delenv(sar.ENV, raising=False)
    assert sar.mode() == "collective"
    monkeypatch.setenv(sar.ENV, "Symmetric")
    assert sar.mode() == "symmetric"
    assert sar.symmetric_sum(torch.ones(4), "0") is None
    monkeypatch.setenv(sar.ENV, "nvshmem")
    with pytest.raises(ValueError, match="KBIT_TP_ALL_REDUCE='nvshmem'"):
        sar.mode()


def test_loading_without_tp_plan_keeps_transformers_plan(tmp_path):
    """kbit renames the plan's styles of its layers while transformers loads; the model keeps the class's plan."""
    torch.manual_seed(3)
    model = tiny_llama()
    want = dict(model.tp_plan)
    model.save_pretrained(str(tmp_path / "fp"))
    q = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp"), quantization_config=kbit.KbitConfig(
        bits=4, min_features=32))
    assert isinstance(q.model.layers[0].self_attn.q_proj, kbit.KbitLinear)
    assert dict(q.tp_plan) == want
    kbit.save_quantized(q, tmp_path / "kbit")
    assert dict(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "kbit")).tp_plan) == want


def test_one_process_quantizes_while_loading_with_a_plan_entry_it_splits_apart(tmp_path):
    """Layer 0's q_proj skipped, layer 1's quantized: one tp_plan entry names both. Only a tp_plan load refuses that
    (test_shard_model_refusals); a one-process load, which never applies the plan, quantizes as asked."""
    torch.manual_seed(11)
    tiny_llama().save_pretrained(str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=kbit.KbitConfig(
        bits=4, min_features=32, skip=["lm_head", "model.layers.0.self_attn.q_proj"]))
    layers = model.model.layers
    assert type(layers[0].self_attn.q_proj) is torch.nn.Linear and isinstance(layers[1].self_attn.q_proj,
                                                                             kbit.KbitLinear)
    assert "kbit_" not in "".join(model.tp_plan.values()), model.tp_plan  # the plan's own names again


def test_shard_model_needs_torch_distributed():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        tp.shard_model(torch.nn.Linear(4, 4))


# ----------------------------------------------------------------------------- two processes on gloo
def tiny_llama(intermediate_size=256):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=intermediate_size, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(config)


def quantized(build, **settings):
    torch.manual_seed(11)
    model = build().eval()
    with torch.no_grad():  # non-trivial norms, so that a mix-up of tensors would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return kbit.quantize_model(model, bits=4, min_features=32, progress=False, **settings)


# Rotated: o_proj (in 128, Hadamard blocks of 128) cannot split in two and stays whole; down_proj (in 1024, blocks
# of 512) splits into one Hadamard block per rank. The last quantizes the lm_head too.
MODELS = {"llama": (tiny_llama, {}), "llama_rotated": (lambda: tiny_llama(1024), {"rotate": True}),
          "qwen3_moe": (tiny_qwen3_moe, {}), "llama_kbit_lm_head": (tiny_llama, {"skip": ()})}


def tiny_qwen2():
    """q/k/v with biases (loaded after their weights are quantized: the shards take them from the whole layer)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


# Full-precision folders quantized while loading under a tp_plan, and the settings; rotated: o_proj's Hadamard blocks
# of 256 do not split in two (it stays whole, its input gathered), down_proj's of 512 do.
FP_MODELS = {"llama_fp": (tiny_llama, kbit.KbitConfig(bits=4, min_features=32)),
             "qwen3_moe_fp": (tiny_qwen3_moe, kbit.KbitConfig(bits=4, min_features=32)),
             "qwen2_rotated_fp": (tiny_qwen2, kbit.KbitConfig(bits=4, min_features=32, rotate=True)),
             "llama_kbit_lm_head_fp": (tiny_llama, kbit.KbitConfig(bits=4, min_features=32, skip=[]))}


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recording_reads(reads: list):
    """transformers' shard-on-read, recording (checkpoint tensor's elements, elements read) of each int32 tensor (in
    a kbit folder: only the ``packed`` bit planes are int32)."""
    from transformers.distributed.sharding_utils import DtensorShardOperation

    shard_tensor = DtensorShardOperation.shard_tensor

    def recorded(self, source, *args, **kwargs):
        local = shard_tensor(self, source, *args, **kwargs)
        shape = list(source.shape) if isinstance(source, torch.Tensor) else source.get_shape()
        if local is not None and local.dtype == torch.int32:
            reads.append((int(torch.tensor(shape).prod()), local.numel()))
        return local

    DtensorShardOperation.shard_tensor = recorded


def _groups(model) -> list:
    """The sibling groups of ``model`` (kbit.fusion) by member name; a member no longer in the model is '?'."""
    names = {id(m): n for n, m in model.named_modules()}
    return sorted({tuple(names.get(id(m), "?") for m in layer._fusion.members)
                   for layer in model.modules() if isinstance(layer, kbit.KbitLinear) and layer._fusion is not None})


def _worker(rank: int, port: int, folder: str) -> None:
    """One rank: every model at TP=2, sharded by shard_model (logits, resident bytes, report), then whole again and
    saved by rank 0; then loaded with tp_plan="auto" (logits, greedy tokens, what was read)."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD, timeout=timedelta(seconds=JOB_TIMEOUT_S))
    try:
        root = Path(folder)
        ids = torch.load(root / "ids.pt")
        out, reads = {}, []
        _recording_reads(reads)
        for name in MODELS:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(root / name), dtype=torch.float32).eval()
            whole_bytes, whole_groups = tp.kbit_bytes(model), _groups(model)
            report = tp.shard_model(model)
            out[name] = {"report": report, "whole_bytes": whole_bytes, "bytes": tp.kbit_bytes(model),
                         "lm_head_rows": model.lm_head.weight.shape[0],
                         "lm_head": type(model.lm_head).__name__, "whole_groups": whole_groups,
                         "sharded_groups": _groups(model)}
            torch.save(logits(model, ids), root / f"{name}.tp2.rank{rank}.pt")
            tp.unshard_model(model)
            out[name]["unsharded_groups"] = _groups(model)
            torch.save(logits(model, ids), root / f"{name}.unsharded.rank{rank}.pt")
            if rank == 0:
                kbit.save_quantized(model, root / f"{name}.saved_at_tp2")
            torch.distributed.barrier()
            reads.clear()
            model = transformers.AutoModelForCausalLM.from_pretrained(str(root / name), dtype=torch.float32,
                                                                      tp_plan="auto").eval()
            out[name]["tp_plan_reads"] = list(reads)
            out[name]["tp_plan_bytes"] = tp.kbit_bytes(model)
            out[name]["tp_plan_groups"] = _groups(model)
            torch.save(logits(model, ids), root / f"{name}.tp_plan.rank{rank}.pt")
            with torch.no_grad():
                out[name]["tokens"] = model.generate(ids[:1], max_new_tokens=4, do_sample=False)[0].tolist()
        tied = tiny_llama()
        tied.config.tie_word_embeddings = True
        tied.tie_weights()
        out["tied_report"] = tp.shard_model(tied)
        out["errors"] = _refusals()
        for fp, (_, config) in FP_MODELS.items():  # quantized while loading: each layer whole, then this rank's shard
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(root / fp), quantization_config=config, **_auto_plan_in_distributed_config()).eval()
            out[fp] = {"bytes": tp.kbit_bytes(model), "groups": _groups(model),
                       "sharded": sorted({type(m).__name__ for m in model.modules() if isinstance(m, tp._PARALLEL)})}
            torch.save(logits(model, ids), root / f"{fp}.quantized_tp2.rank{rank}.pt")
        try:  # layer 0's q_proj left in full precision, layer 1's quantized: one plan entry cannot split both
            transformers.AutoModelForCausalLM.from_pretrained(
                str(root / "llama_fp"), tp_plan="auto", quantization_config=kbit.KbitConfig(
                    bits=4, min_features=32, skip=["lm_head", "model.layers.0.self_attn.q_proj"]))
            out["errors"].append("loaded")
        except ValueError as e:
            out["errors"].append(str(e))
        try:  # calibrated methods run the whole model: one process only
            transformers.AutoModelForCausalLM.from_pretrained(
                str(root / "llama_fp"), tp_plan="auto", quantization_config=kbit.KbitConfig(
                    bits=4, min_features=32, method="mse"))
            out["errors"].append("loaded")
        except ValueError as e:
            out["errors"].append(str(e))
        (root / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        torch.distributed.destroy_process_group()


def _auto_plan_in_distributed_config() -> dict:
    """from_pretrained's arguments for tp_plan="auto" as transformers now spells them (``distributed_config``; the
    ``tp_plan`` argument is deprecated there), where it has that spelling; the kbit folders above load with
    ``tp_plan``, so both are exercised."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def _refusals() -> list:
    """What shard_model says to a model sharded twice, to 3 heads over 2 ranks, and to a plan that is not a dict."""
    class Attention(torch.nn.Module):
        head_dim = 32

        def __init__(self):
            super().__init__()
            self.q_proj = kbit.KbitLinear(64, 96, bias=False)

    messages = []
    for model, plan in ((Attention(), {"q_proj": "colwise"}), (Attention(), ["q_proj"])):
        try:
            tp.shard_model(model, plan=plan)
            tp.shard_model(model, plan=plan)
        except (TypeError, ValueError) as e:
            messages.append(str(e))
    model = torch.nn.Sequential(kbit.KbitLinear(64, 64, bias=False))
    tp.shard_model(model, plan={"0": "colwise"})
    try:
        tp.shard_model(model, plan={"0": "colwise"})
    except ValueError as e:
        messages.append(str(e))
    return messages


def _rank(rank: int, worker, port: int, folder: str) -> None:
    """One rank: ``worker(rank, port, folder)``, its threads' stacks printed to stderr on SIGUSR1 (``run_ranks``
    sends it to a rank still running at its limit) and every ``$KBIT_TEST_RANK_STACKS_S`` seconds where set, so a
    rank stuck in a collective or a compile says where."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    every = float(os.environ.get(RANK_STACKS_ENV, "0"))
    if every > 0:
        faulthandler.dump_traceback_later(every, repeat=True)
    try:
        worker(rank, port, folder)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_ranks(worker, folder: Path, limit_s: float = JOB_TIMEOUT_S) -> None:
    """``worker(rank, port, folder)`` in WORLD spawned processes; a bounded wait, then each rank still running prints
    its stacks and is terminated."""
    import signal

    ctx = mp.start_processes(_rank, args=(worker, _free_port(), str(folder)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + limit_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                if hasattr(signal, "SIGUSR1"):
                    for p in ctx.processes:
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(2)  # the stacks are written from a signal handler: let them reach stderr
                raise TimeoutError(f"the {WORLD} ranks did not finish within {limit_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """{model: (TP=1 model, TP=1 logits)} and the folder the ranks wrote into."""
    root = tmp_path_factory.mktemp("tp")
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 12))
    torch.save(ids, root / "ids.pt")
    whole = {}
    for fp, (build, config) in FP_MODELS.items():  # and each quantized while loading on one process: TP=1's
        torch.manual_seed(11)
        build().save_pretrained(str(root / fp))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(root / fp), quantization_config=config).eval()
        whole[fp] = (model, logits(model, ids), None)
    for name, (build, settings) in MODELS.items():
        model = quantized(build, **settings)
        kbit.save_quantized(model, root / name)
        with torch.no_grad():
            tokens = model.generate(ids[:1], max_new_tokens=4, do_sample=False)[0].tolist()
        whole[name] = (model, logits(model, ids), tokens)
    sys.stdout.flush()
    run_ranks(_worker, root)
    results = [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return whole, root, ids, results


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_logits_equal_tp1(job, name):
    whole, root, _, _ = job
    ref = whole[name][1]
    for rank, how in ((r, h) for r in range(WORLD) for h in ("tp2", "tp_plan")):
        got = torch.load(root / f"{name}.{how}.rank{rank}.pt")
        # the same products summed in two parts: float32 rounding of the all-reduced sums only
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_each_rank_holds_about_half_the_kbit_bytes(job, name):
    *_, results = job
    for rank in range(WORLD):
        r = results[rank][name]
        # codebooks, scales and metadata are replicated: a little over half
        assert 0.45 * r["whole_bytes"] < r["bytes"] < 0.56 * r["whole_bytes"], r
        assert r["tp_plan_bytes"] == r["bytes"], r


@pytest.mark.parametrize("name", list(MODELS))
def test_tp_plan_auto_reads_only_this_ranks_shard(job, name):
    """transformers read half of the packed tensor of every sharded layer (two of a sharded experts module), and
    nothing else through its shard-on-read (the rotated o_proj, whole on each rank, is read whole)."""
    *_, results = job
    for rank in range(WORLD):
        reads, report = results[rank][name]["tp_plan_reads"], results[rank][name]["report"]
        sharded = sum(2 if how == "shard of every expert" else how.endswith("shard") for how in report.values())
        sharded += results[rank][name]["lm_head"] == "GatheredOutputKbitLinear"  # a 16-bit one reads no int32
        assert sharded and len(reads) == sharded, (reads, report)
        assert all(2 * got == full for full, got in reads), reads


@pytest.mark.parametrize("name", list(MODELS))
def test_tp_plan_auto_generates_tp1s_greedy_tokens(job, name):
    whole, *_, results = job
    for rank in range(WORLD):
        assert results[rank][name]["tokens"] == whole[name][2]


def test_every_kbit_layer_is_sharded(job):
    *_, results = job
    llama = dict(results[0]["llama"]["report"])
    assert llama.pop("lm_head") == "column shard, output gathered"
    assert llama and all(how in ("column shard", "row shard") for how in llama.values()), llama
    moe = dict(results[0]["qwen3_moe"]["report"])
    assert moe.pop("lm_head") == "column shard, output gathered"
    assert results[0]["llama"]["lm_head"] == "ColumnParallelLinear"
    assert {how for name, how in moe.items() if name.endswith("experts")} == {"shard of every expert"}
    assert all(how in ("column shard", "row shard") for name, how in moe.items() if not name.endswith("experts"))


@pytest.mark.parametrize("name", MODELS)
def test_sharded_sibling_projections_stay_grouped(job, name):
    """q/k/v and gate/up shards share one launch as the whole layers did (kbit.fusion), after shard_model,
    unshard_model and a tp_plan load; no group keeps a layer that left the model."""
    *_, results = job
    for rank in results:
        got = rank[name]
        rotated = MODELS[name][1].get("rotate", False)  # rotated siblings differ in their input rotations: apart
        assert bool(got["whole_groups"]) != rotated and all("?" not in g for g in got["whole_groups"])
        for key in ("sharded_groups", "unsharded_groups", "tp_plan_groups"):
            assert got[key] == got["whole_groups"], key


def test_the_lm_head_is_split_by_vocabulary_unless_tied(job):
    """The lm_head is a decode step's largest read at batch 1: each rank holds half its rows (its logits gathered,
    as test_tp2_logits_equal_tp1 shows), in 16 bits or quantized (GatheredOutputKbitLinear, whose tp_plan load reads
    half its rows: transformers' own gathered-output style would gather a whole layer's logits); tied to the
    embeddings it stays whole."""
    *_, results = job
    for rank in range(WORLD):
        for name in MODELS:
            assert results[rank][name]["lm_head_rows"] == VOCAB // WORLD
            want = "GatheredOutputKbitLinear" if name == "llama_kbit_lm_head" else "ColumnParallelLinear"
            assert results[rank][name]["lm_head"] == want, name
            assert results[rank][name]["report"]["lm_head"] == "column shard, output gathered"
        assert results[rank]["tied_report"] == {"lm_head": "whole: tied to another module's weight"}


def test_rotated_row_layers_shard_where_whole_hadamard_blocks_allow(job):
    """Rotated o_proj (in 128: one Hadamard block of 128) cannot split in two: it stays whole on each rank and
    gathers its input; down_proj (in 1024, blocks of 512) row-shards with its signs; column-parallel layers shard."""
    *_, results = job
    report = results[0]["llama_rotated"]["report"]
    gathered = {name for name, how in report.items() if how.startswith("whole (input gathered)")}
    assert gathered == {n for n in report if n.endswith("o_proj")}, report
    assert all("Hadamard blocks of 128" in report[n] for n in gathered)
    assert {report[n] for n in report if n.endswith("down_proj")} == {"row shard"}
    r = results[0]["llama_rotated"]
    assert r["bytes"] < 0.6 * r["whole_bytes"], r  # everything but the two o_proj halves


def test_shard_model_refusals(job):
    *_, results = job
    heads, plan, twice, mixed, calibrated = results[0]["errors"]
    assert "q_proj: out_features=96 does not split into 2 equal shards of whole heads of 32" in heads
    assert "plan must be a dict" in plan
    assert "sharded already" in twice
    assert "names layers kbit quantizes while loading and model.layers.0.self_attn.q_proj, which it does not" in mixed
    assert "kbit quantizes with method='mse', per-layer bits or tuning on one process" in calibrated


@pytest.mark.parametrize("fp", list(FP_MODELS))
def test_quantizing_while_loading_under_tp_plan_gives_the_shards_of_the_one_process_quantization(job, fp):
    """from_pretrained(fp_folder, quantization_config=KbitConfig(...), tp_plan="auto", spelled
    distributed_config=DistributedConfig(tp_plan="auto") where transformers has it): each rank reads every weight
    whole, quantizes it as one process would, and keeps its shard: the logits of TP=1's quantization, about half the
    kbit bytes a rank, every kbit layer sharded, siblings grouped."""
    whole, root, _, results = job
    model, ref, _ = whole[fp]
    for rank in range(WORLD):
        got = torch.load(root / f"{fp}.quantized_tp2.rank{rank}.pt")
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
        r = results[rank][fp]
        assert 0.45 * tp.kbit_bytes(model) < r["bytes"] < 0.56 * tp.kbit_bytes(model), r
        assert [tuple(g) for g in r["groups"]] == _groups(model), r
    sharded = {"ColumnParallelKbitLinear", "RowParallelKbitLinear"}
    sharded |= {"TensorParallelKbitExperts"} if "moe" in fp else set()
    sharded |= {"GatheredOutputKbitLinear"} if "lm_head" in fp else set()
    assert sharded <= set(results[0][fp]["sharded"]), results[0][fp]


@pytest.mark.parametrize("name", list(MODELS))
def test_saved_at_tp2_loads_at_tp1_as_the_same_model(job, name):
    whole, root, ids, _ = job
    model, ref, _ = whole[name]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(root / f"{name}.saved_at_tp2"),
                                                               dtype=torch.float32).eval()
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    assert torch.equal(logits(loaded, ids), ref)
    for rank in range(WORLD):  # the ranks run one thread: float32 sums in another order than this process
        got = torch.load(root / f"{name}.unsharded.rank{rank}.pt")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


# ----------------------------------------------------------------------------- two GPUs on NCCL
# Llama-3-70B's layer shapes, 4 layers; a smaller vocabulary keeps the replicated embeddings small.
SHAPE_70B = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                 num_hidden_layers=4, vocab_size=32000)
NEW_TOKENS = 16


def _greedy(model, prompt):
    """Greedy tokens and each step's scores (transformers' generate, eager)."""
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences[0, prompt.shape[1]:].tolist(), [s[0].float() for s in out.scores]


def _cuda_worker(rank: int, port: int, folder: str) -> None:
    """One GPU: the 70B-shaped model quantized to K=4 at TP=1, then sharded over both GPUs (TP=2), in fp16 and
    bf16: greedy tokens, prefill logits, the TP=1 score margins (to tell a near-tie from an error), kbit bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kbit.hf import from_config

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD, timeout=timedelta(seconds=600), device_id=device)
    try:
        out = {}
        for dtype in (torch.float16, torch.bfloat16):
            torch.manual_seed(0)  # the same weights on both GPUs
            with device:
                model = from_config(LlamaForCausalLM, LlamaConfig(**SHAPE_70B), dtype=dtype).eval()
            kbit.quantize_model(model, bits=4, progress=False)
            prompt = torch.randint(0, SHAPE_70B["vocab_size"], (1, 32), device=device)
            want, scores = _greedy(model, prompt)
            ref = logits(model, prompt).float()
            whole_bytes = tp.kbit_bytes(model)
            report = tp.shard_model(model)
            got, _ = _greedy(model, prompt)
            diverged = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
            margin = None
            if diverged is not None:
                top2 = scores[diverged].topk(2).values
                margin = float(top2[0] - top2[1])
            out[str(dtype)] = dict(
                want=want, got=got, margin=margin, whole_bytes=whole_bytes, bytes=tp.kbit_bytes(model),
                report=sorted(set(report.values())), logit_scale=float(ref.abs().max()),
                logit_diff=float((logits(model, prompt).float() - ref).abs().max()),
                symmetric_buffers=len(kbit.symmetric_all_reduce._buffers))
            del model
            torch.cuda.empty_cache()
        (Path(folder) / f"cuda_rank{rank}.json").write_text(json.dumps(out))
    finally:
        torch.distributed.destroy_process_group()


def _run_cuda_ranks(worker, folder: Path) -> None:
    """``run_ranks`` on WORLD GPUs, one rank each (skipped with fewer)."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    run_ranks(worker, folder, limit_s=900)


@pytest.mark.cuda
@pytest.mark.parametrize("all_reduce", ["collective", "symmetric"])
def test_nccl_tp2_greedy_tokens_equal_tp1_on_a_70b_shaped_model(all_reduce, tmp_path, monkeypatch):
    """TP=2 on two GPUs against TP=1, the decode sums through NCCL or (KBIT_TP_ALL_REDUCE=symmetric) through
    symmetric memory (the prompt's still through NCCL: larger than SYMMETRIC_BYTES)."""
    monkeypatch.setenv(kbit.symmetric_all_reduce.ENV, all_reduce)  # the spawned ranks inherit it
    _run_cuda_ranks(_cuda_worker, tmp_path)
    for rank in range(WORLD):
        for dtype, r in json.loads((tmp_path / f"cuda_rank{rank}.json").read_text()).items():
            print(rank, dtype, {k: v for k, v in r.items() if k not in ("want", "got")})
            assert r["report"] == ["column shard", "column shard, output gathered", "row shard"], r["report"]
            assert (r["symmetric_buffers"] > 0) == (all_reduce == "symmetric"), r["symmetric_buffers"]
            assert 0.45 * r["whole_bytes"] < r["bytes"] < 0.55 * r["whole_bytes"]
            # 16-bit all-reduces sum in another order than one GPU's GEMM: logits agree to a few 16-bit roundings
            assert r["logit_diff"] <= 0.05 * r["logit_scale"], r
            # greedy tokens equal; a divergence is allowed only at a near-tie of TP=1's two best scores
            assert r["got"] == r["want"] or r["margin"] <= 2 * r["logit_diff"], (dtype, r)


def _divergence_is_a_near_tie(want, got, scores, logit_diff: float) -> bool:
    """Greedy tokens ``got`` equal ``want``, or part from them where ``want``'s two best scores are within twice the
    logits' difference (random weights have near-ties; all-reduces sum in another order)."""
    diverged = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if diverged is None:
        return len(got) == len(want)
    top2 = scores[diverged].topk(2).values
    return float(top2[0] - top2[1]) <= 2 * logit_diff


def _logits_and_routes(model, ids):
    """Prefill logits and each MoE layer's router logits (float; none for a dense model)."""
    routers = [m.mlp.gate for m in model.model.layers if hasattr(getattr(m, "mlp", None), "gate")]
    routes = []
    hooks = [r.register_forward_hook(lambda mod, args, out: routes.append(out[0].float())) for r in routers]
    try:
        return logits(model, ids).float(), routes
    finally:
        for h in hooks:
            h.remove()


def _compare_routed(ref, ref_routes, got, got_routes, top_k: int) -> dict:
    """TP=2's prefill against TP=1's where routing may part. A token routed to other experts than at TP=1 (in any
    layer) changes its own and, through attention, later tokens' logits; the logits compare before the first such
    token, and each parting must be a near-tie of TP=1's router: its k-th and (k+1)-th logits within twice the
    router logits' difference there (16-bit router logits of sums in another order)."""
    first, partings = ref.shape[1], []
    for layer, (want, have) in enumerate(zip(ref_routes, got_routes)):
        parted = (want.topk(top_k).indices.sort().values != have.topk(top_k).indices.sort().values).any(-1)
        for pos in parted.nonzero().flatten().tolist():
            ranked = want[pos].sort(descending=True).values
            gap, noise = float(ranked[top_k - 1] - ranked[top_k]), float((have[pos] - want[pos]).abs().max())
            partings.append(dict(layer=layer, position=pos, gap=gap, noise=noise, near_tie=gap <= 2 * noise))
            first = min(first, pos)
    diff = float((got - ref)[:, :first].abs().max()) if first else float("nan")  # none compared: fails the test
    return dict(compared=first, partings=partings, logit_diff=diff)


def _cuda_tp_plan_worker(rank: int, port: int, folder: str) -> None:
    """One GPU: TP=1 from the kbit folder (greedy tokens, scores, logits), then TP=2 with transformers' tp_plan="auto"
    from the folder ``source.txt`` names: the kbit one, or the full-precision one quantized while loading. Logits,
    generate's tokens, and the tokens of a compiled decode (bench_e2e.GreedyDecoder: torch.compile reduce-overhead,
    CUDA graphs)."""
    from transformers import AutoModelForCausalLM

    from repo_script import load_script

    root, device = Path(folder), torch.device("cuda", rank)
    torch.cuda.set_device(device)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD, timeout=timedelta(seconds=600), device_id=device)
    try:
        decoder = load_script("benchmarks/bench_e2e.py").GreedyDecoder
        ids = torch.load(root / "ids.pt").to(device)
        whole = AutoModelForCausalLM.from_pretrained(str(root / "kbit"), dtype=torch.float16,
                                                     device_map={"": device}).eval()
        want, scores = _greedy(whole, ids)
        ref, ref_routes = _logits_and_routes(whole, ids)
        del whole
        source = (root / "source.txt").read_text()
        kwargs = {"quantization_config": kbit.KbitConfig(bits=4)} if source == "fp" else {}
        model = AutoModelForCausalLM.from_pretrained(str(root / source), dtype=torch.float16, tp_plan="auto",
                                                     **kwargs).eval()
        top_k = getattr(model.config, "num_experts_per_tok", 0)
        prefill = _compare_routed(ref, ref_routes, *_logits_and_routes(model, ids), top_k=top_k)
        diff = prefill["logit_diff"]
        got, _ = _greedy(model, ids)
        dec = decoder(model, 1, ids.shape[1] + NEW_TOKENS + 8, "compile").prepare(ids)
        compiled = dec.generate(ids, NEW_TOKENS - 1)[0].tolist()  # the prefill's token and one a step
        out = dict(sharded=sorted({type(m).__name__ for m in model.modules() if isinstance(m, tp._PARALLEL)}),
                   logit_scale=float(ref.abs().max()), **prefill,
                   generate_ok=_divergence_is_a_near_tie(want, got, scores, diff),
                   compiled_ok=_divergence_is_a_near_tie(want, compiled, scores, diff), want=want, got=got,
                   compiled=compiled)
        (root / f"tp_plan_rank{rank}.json").write_text(json.dumps(out))
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    # The results are written. destroy_process_group, like the interpreter's end, hangs for minutes on torch 2.11
    # after CUDA-graphed NCCL collectives (H200 x2: both ranks stood in it past 80 s); as bench_tp.py ends, the
    # process's end frees what NCCL holds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _cuda_tp_plan_model(family: str):
    """A 2-layer fp16 model of ``family`` whose heads, blocks and rows (and, for Qwen3-MoE, experts' rows) split in
    two, and the parallel layer types a tp_plan load of it holds."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shared = dict(vocab_size=2048, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  tie_word_embeddings=False)
    linear = {"ColumnParallelKbitLinear", "RowParallelKbitLinear"}
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(intermediate_size=2816, **shared)).half(), linear
    config = Qwen3MoeConfig(intermediate_size=2816, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
                            head_dim=128, **shared)
    return Qwen3MoeForCausalLM(config).half(), linear | {"TensorParallelKbitExperts"}


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("source", ["kbit", "fp"])
def test_nccl_tp_plan_auto_generates_and_compiles_as_tp1(source, family, tmp_path):
    """from_pretrained(kbit_folder, tp_plan="auto") or from_pretrained(fp_folder, quantization_config=KbitConfig(4),
    tp_plan="auto") on two GPUs over NCCL (fp16, a 2-layer Llama or Qwen3-MoE, ``_cuda_tp_plan_model``): every kbit
    layer sharded, logits within a few 16-bit roundings of TP=1's, greedy tokens of generate and of a compiled,
    CUDA-graphed decode equal TP=1's but at near-ties. Random routers have near-ties too: a token routed otherwise
    than at TP=1 must be one (``_compare_routed``), and the logits compare before it."""
    from transformers.quantizers.base import HfQuantizer

    if not hasattr(HfQuantizer, "update_parallel_plan"):
        pytest.skip("this transformers has no HfQuantizer.update_parallel_plan (kbit's tp_plan loading needs it)")
    torch.manual_seed(0)
    model, sharded = _cuda_tp_plan_model(family)
    model.save_pretrained(str(tmp_path / "fp"))
    quantized = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp"), dtype=torch.float16,
                                                                  quantization_config=kbit.KbitConfig(bits=4))
    kbit.save_quantized(quantized, tmp_path / "kbit")
    torch.save(torch.randint(0, 2048, (1, 16)), tmp_path / "ids.pt")
    (tmp_path / "source.txt").write_text(source)
    _run_cuda_ranks(_cuda_tp_plan_worker, tmp_path)
    for rank in range(WORLD):
        r = json.loads((tmp_path / f"tp_plan_rank{rank}.json").read_text())
        print(rank, family, source, {k: v for k, v in r.items() if k not in ("want", "got", "compiled")})
        assert sharded <= set(r["sharded"]), r
        assert all(p["near_tie"] for p in r["partings"]) and r["compared"] >= 4, r
        assert r["logit_diff"] <= 0.05 * r["logit_scale"], r
        assert r["generate_ok"] and r["compiled_ok"], r


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shards_of_cuda_resident_layers_equal_the_cpu_shards():
    """On CUDA a KbitLinear and a KbitExperts hold only their GEMM layouts: their shards come from the storage format
    derived there (the unrepack kernel; the experts' gate/up rows put back from the grouped GEMM's order). Each
    rank's shard equals the CPU layer's shard bit for bit, and holds its own layout on the GPU."""
    torch.manual_seed(0)
    linear = kbit.KbitLinear.from_linear(torch.nn.Linear(256, 96).half(), bits=3)
    experts, _ = kbit.KbitExperts.from_weights(torch.randn(4, 128, 64) * 0.05, torch.randn(4, 64, 64) * 0.05, bits=3)
    gpu_linear, gpu_experts = copy.deepcopy(linear).cuda(), copy.deepcopy(experts).cuda()
    assert gpu_linear.is_gemm_resident and gpu_experts.is_gemm_resident

    def same_state(got, want) -> None:
        got, want = got.state_dict(), want.state_dict()
        assert list(got) == list(want)
        for key, t in want.items():
            assert got[key].is_cuda and got[key].dtype == t.dtype and torch.equal(got[key].cpu(), t), key

    for r in range(2):
        rank = _Rank(r, 2)
        for style in (tp.COLWISE, tp.ROWWISE):
            want, how = tp._shard_linear(linear, style, rank, 1, "layer")
            got, got_how = tp._shard_linear(gpu_linear, style, rank, 1, "layer")
            assert type(got) is type(want) and got_how == how and how in ("column shard", "row shard")
            assert got.is_gemm_resident
            same_state(got, want)
        want, how = tp._shard_experts(experts, rank)
        got, _ = tp._shard_experts(gpu_experts, rank)
        assert how == "shard of every expert" and got.is_gemm_resident and got.gate_up_gemm_codes.is_cuda
        same_state(got, want)
