"""Nothing lost, nothing hung: atomic checkpoint saves (a process killed mid-save leaves the old checkpoint whole)
and the CUDA build's lock (a build killed mid-compile never blocks later ones)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")

import kbit  # noqa: E402
from kbit import _atomic, _build  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# The child builds the same one-layer Llama from a seed, so parent and child agree on its shape.
MODEL_SRC = """
import torch
import kbit
from transformers import LlamaConfig, LlamaForCausalLM

def build(seed, k):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    return kbit.quantize_model(model, bits=k, min_features=0, progress=False)
"""


def _model_module(tmp_path: Path) -> Path:
    (tmp_path / "tiny_model.py").write_text(MODEL_SRC)
    return tmp_path


def _build_model(tmp_path: Path, seed: int, k: int):
    sys.path.insert(0, str(_model_module(tmp_path)))
    try:
        import importlib

        import tiny_model

        importlib.reload(tiny_model)
        return tiny_model.build(seed, k)
    finally:
        sys.path.remove(str(tmp_path))


def _load(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path))


def _outputs(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _ids():
    return torch.randint(0, 96, (2, 5))


# Each kill point SIGKILLs the child at one moment of save_quantized over an existing checkpoint.
KILL_POINTS = {
    # half of the new weights file written (before transformers, which binds save_file when it loads, is imported)
    "weights": """
import safetensors.torch as st
real = st.save_file
def save_file(tensors, path, metadata=None):
    real(tensors, path, metadata=metadata)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = save_file
""",
    # every file written, the directories not yet swapped
    "swap": """
import kbit._atomic as a
def _replace(tmp, target):
    os.kill(os.getpid(), signal.SIGKILL)
a._replace = _replace
""",
    # swapped, the old directory not yet deleted
    "cleanup": """
import kbit._atomic as a, shutil
real_rmtree = shutil.rmtree
def rmtree(path, *args, **kwargs):
    if a._TMP_MARK in str(path):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rmtree(path, *args, **kwargs)
a.shutil.rmtree = rmtree
""",
}


def _kill_during_save(tmp_path: Path, out: Path, point: str) -> None:
    script = "import os, signal, sys\n" + textwrap.dedent(KILL_POINTS[point]) + textwrap.dedent(f"""
        sys.path.insert(0, {str(tmp_path)!r})
        import tiny_model, kbit
        kbit.save_quantized(tiny_model.build(2, 5), {str(out)!r})
        print("save finished: the kill point was never reached")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_kill_during_save_leaves_a_whole_checkpoint(point, tmp_path):
    _model_module(tmp_path)
    out = tmp_path / "ckpt"
    old, new = _build_model(tmp_path, 1, 3), _build_model(tmp_path, 2, 5)
    kbit.save_quantized(old, out)
    (out / "tokenizer.json").write_text('{"kept": true}')
    x = _ids()

    _kill_during_save(tmp_path, out, point)

    loaded = _load(out)
    # before the swap the old checkpoint is there; after it, the new one: never a mix of the two
    expect = new if point == "cleanup" else old
    assert torch.equal(_outputs(loaded, x), _outputs(expect, x))
    bits = json.loads((out / "config.json").read_text())["quantization_config"]["bits"]
    assert bits == (5 if point == "cleanup" else 3)
    assert (out / "tokenizer.json").read_text() == '{"kept": true}'
    leftovers = [p for p in tmp_path.iterdir() if _atomic._TMP_MARK in p.name]
    assert leftovers, "the killed save's temporary directory should be what is left"

    kbit.save_quantized(new, out)  # the next save removes the dead process's temporary directory
    assert not [p for p in tmp_path.iterdir() if _atomic._TMP_MARK in p.name]
    assert torch.equal(_outputs(_load(out), x), _outputs(new, x))


def test_save_replaces_checkpoint_files_and_keeps_others(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "README.md").write_text("notes")
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "vocab.txt").write_text("a b c")
    model = _build_model(tmp_path, 3, 4)
    kbit.save_quantized(model, out)
    names = {p.name for p in out.iterdir()}
    assert names == {"model.safetensors", "config.json", "generation_config.json", "README.md", "tokenizer"}
    assert (out / "tokenizer" / "vocab.txt").read_text() == "a b c"
    x = _ids()
    assert torch.equal(_outputs(_load(out), x), _outputs(model, x))


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    old = _build_model(tmp_path, 1, 3)
    kbit.save_quantized(old, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", fail)
    with pytest.raises(OSError, match="No space"):
        kbit.save_quantized(_build_model(tmp_path, 2, 5), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_save_without_rename_exchange(tmp_path, monkeypatch):
    """Where renameat2 is missing the fallback renames aside; the result is the same."""
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    out = tmp_path / "ckpt"
    kbit.save_quantized(_build_model(tmp_path, 1, 3), out)
    new = _build_model(tmp_path, 2, 5)
    kbit.save_quantized(new, out)
    x = _ids()
    assert torch.equal(_outputs(_load(out), x), _outputs(new, x))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ----------------------------------------------------------------------------- the CUDA build's lock
pytest.importorskip("fcntl")

HOLD_LOCK = """
import os, signal, sys, time
from pathlib import Path
from kbit import _build
with _build.build_lock(Path(sys.argv[1]), timeout=5):
    print("holding", flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)  # like nvcc's OOM kill of a build: no cleanup runs
    time.sleep(60)
"""


def _holder(directory: Path, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(directory), mode], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_build_lock_of_a_killed_build_is_not_stale(tmp_path):
    proc = _holder(tmp_path, "die")
    proc.wait(timeout=30)
    (tmp_path / _build.TORCH_LOCK_NAME).write_text("")  # torch's baton, left by the killed build
    t0 = time.monotonic()
    with _build.build_lock(tmp_path, timeout=5):
        assert not (tmp_path / _build.TORCH_LOCK_NAME).exists()
        assert (tmp_path / _build.LOCK_NAME).read_text() == str(os.getpid())
    assert time.monotonic() - t0 < 2


def test_build_lock_waits_then_names_the_holder(tmp_path, capsys):
    proc = _holder(tmp_path, "hold")
    try:
        with pytest.raises(TimeoutError, match=f"process {proc.pid}.*KBIT_BUILD_LOCK_TIMEOUT"):
            with _build.build_lock(tmp_path, timeout=0.5, poll_s=0.05):
                pass
        assert f"waiting for process {proc.pid}" in capsys.readouterr().err
    finally:
        proc.kill()
        proc.wait()
    with _build.build_lock(tmp_path, timeout=5):  # free once the holder is gone
        pass


def test_lock_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("KBIT_BUILD_LOCK_TIMEOUT", "12.5")
    assert _build.lock_timeout() == 12.5
    monkeypatch.setenv("KBIT_BUILD_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="KBIT_BUILD_LOCK_TIMEOUT"):
        _build.lock_timeout()
    monkeypatch.delenv("KBIT_BUILD_LOCK_TIMEOUT")
    assert _build.lock_timeout() == _build.DEFAULT_LOCK_TIMEOUT_S


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "0", "-1", "-0.5"])
def test_lock_timeout_must_be_finite_and_positive(raw, monkeypatch):
    """A NaN timeout never expires (every comparison with it is false); zero or less gives up at once."""
    monkeypatch.setenv("KBIT_BUILD_LOCK_TIMEOUT", raw)
    with pytest.raises(ValueError, match=f"KBIT_BUILD_LOCK_TIMEOUT must be a finite number of seconds above 0, "
                                         f"got '{raw}'"):
        _build.lock_timeout()


@pytest.mark.parametrize("timeout, shown", [(0.25, "0.25 s"), (1.5, "1.5 s"), (2, "2 s"), (1800, "1800 s")])
def test_build_lock_timeout_message_is_exact(timeout, shown, tmp_path, monkeypatch):
    import fcntl
    import types

    # flock locks belong to an open file: a second open in this process waits like another process would
    with open(tmp_path / _build.LOCK_NAME, "a+") as held:
        held.write("4242")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        clock = iter(range(0, 10**6, 1000))  # each look at the clock is 1000 s later: gives up at the first poll
        monkeypatch.setattr(_build, "time", types.SimpleNamespace(monotonic=lambda: next(clock), sleep=lambda s: None))
        with pytest.raises(TimeoutError, match=f"gave up after {shown} waiting for process 4242"):
            with _build.build_lock(tmp_path, timeout=timeout):
                pass


@pytest.mark.parametrize("before", [None, "8.0"])
def test_arch_list_is_restored_after_the_build(before, monkeypatch):
    if before is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", before)
    with _build.arch_list("9.0a"):
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    assert os.environ.get("TORCH_CUDA_ARCH_LIST") == before
    with pytest.raises(RuntimeError):
        with _build.arch_list("9.0a"):
            raise RuntimeError("nvcc failed")
    assert os.environ.get("TORCH_CUDA_ARCH_LIST") == before
