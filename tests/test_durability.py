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


def _dot_entries(directory: Path) -> list:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def _write_folder(target: Path, **files) -> None:
    with _atomic.atomic_directory(target) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text)


# ----------------------------------------------------------------------------- write-protected targets
def _unprivileged(fn):
    """``fn()`` as a user without CAP_DAC_OVERRIDE: root (as here and in CI) ignores write protection, so a forked
    child drops to ``nobody`` first. Returns what ``fn`` returned; an exception in the child fails the test."""
    if os.geteuid() != 0:
        return fn()
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root and there is no user 'nobody' to drop the privileges to")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain file operations only, then _exit (no pytest or torch teardown)
        os.close(read_end)
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            result = {"ok": fn()}
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = {"error": f"{type(e).__name__}: {e}"}
        with os.fdopen(write_end, "w") as f:
            json.dump(result, f)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    os.waitpid(pid, 0)
    result = json.loads(text)
    assert "error" not in result, result["error"]
    return result["ok"]


@pytest.fixture
def shared_tmp():
    """A folder the unprivileged child owns (pytest's own tmp_path is private to root)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="kbit-durability-"))
    if os.geteuid() == 0:
        import pwd

        try:
            nobody = pwd.getpwnam("nobody")
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        except KeyError:
            pass  # _unprivileged skips
    yield path
    for p in [path, *path.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)
    shutil.rmtree(path)


@pytest.mark.parametrize("protected", ["folder", "subfolder"])
def test_write_protected_checkpoint_is_refused_and_left_alone(protected, shared_tmp):
    target = shared_tmp / "ckpt"

    def attempt():
        _write_folder(target, **{"model.safetensors": "old", "README.md": "notes"})
        (target / "tokenizer").mkdir()
        (target / "tokenizer" / "vocab.txt").write_text("a b")
        (target if protected == "folder" else target / "tokenizer").chmod(0o555)
        try:
            _write_folder(target, **{"model.safetensors": "new"})
            raised = None
        except PermissionError as e:
            raised = str(e)
        return {"raised": raised, "weights": (target / "model.safetensors").read_text(),
                "vocab": (target / "tokenizer" / "vocab.txt").read_text(), "left": _dot_entries(shared_tmp)}

    seen = _unprivileged(attempt)
    assert seen["raised"] is not None and "write-protected" in seen["raised"], seen
    assert str(target) in seen["raised"]
    assert seen["weights"] == "old" and seen["vocab"] == "a b"
    assert seen["left"] == []


# ----------------------------------------------------------------------------- symlinked targets
def test_save_through_a_symlink_replaces_the_linked_folder(tmp_path):
    """``latest -> ckpt-1``: the save goes to ckpt-1 (as save_pretrained's would); the link stays as it is."""
    _write_folder(tmp_path / "ckpt-1", **{"model.safetensors": "one", "tokenizer.json": "tok"})
    (tmp_path / "latest").symlink_to("ckpt-1")
    _write_folder(tmp_path / "latest", **{"model.safetensors": "two"})
    assert (tmp_path / "latest").is_symlink() and os.readlink(tmp_path / "latest") == "ckpt-1"
    assert (tmp_path / "ckpt-1" / "model.safetensors").read_text() == "two"
    assert (tmp_path / "ckpt-1" / "tokenizer.json").read_text() == "tok"
    assert _dot_entries(tmp_path) == []

    (tmp_path / "next").symlink_to("ckpt-2")  # a link to a folder not written yet: the save creates ckpt-2
    _write_folder(tmp_path / "next", **{"model.safetensors": "three"})
    assert (tmp_path / "next").is_symlink() and (tmp_path / "ckpt-2" / "model.safetensors").read_text() == "three"
    assert _dot_entries(tmp_path) == []


# ----------------------------------------------------------------------------- stale temporaries
def test_cleanup_spares_a_live_save_whose_pid_is_not_ours(tmp_path, monkeypatch):
    """Two containers sharing a volume: a live save's process id means nothing in the other PID namespace."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    monkeypatch.setattr(os, "getpid", lambda: int(gone.stdout))  # the saving process as the other namespace sees it
    target = tmp_path / "ckpt"
    with _atomic.atomic_directory(target) as tmp:
        (tmp / "model.safetensors").write_text("live")
        monkeypatch.undo()
        assert _atomic.remove_stale_temporaries(target) == []  # the other container's next save into the same parent
        _write_folder(tmp_path / "ckpt", **{"model.safetensors": "other"})
        assert tmp.is_dir() and (tmp / "model.safetensors").read_text() == "live"
    assert (target / "model.safetensors").read_text() == "live"
    assert _dot_entries(tmp_path) == []


def test_cleanup_removes_what_a_killed_save_left(tmp_path):
    target = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from kbit import _atomic
        with _atomic.atomic_directory(Path({str(target)!r})) as tmp:
            (tmp / "model.safetensors").write_text("half")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _dot_entries(tmp_path)
    assert _atomic.remove_stale_temporaries(target)
    assert _dot_entries(tmp_path) == []


# ----------------------------------------------------------------------------- directory fsync
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "fallback"])
@pytest.mark.parametrize("existing", [True, False], ids=["replace", "first"])
def test_new_folder_and_parent_are_fsynced(exchange, existing, tmp_path, monkeypatch):
    """The files, the new folder's own entries and the parent's entry for it reach the disk before the save returns."""
    target = tmp_path / "ckpt"
    if existing:
        _write_folder(target, **{"old.txt": "old"})
    if not exchange:
        monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), (target / "new.txt").exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with _atomic.atomic_directory(target) as tmp:
        (tmp / "new.txt").write_text("new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "f.txt").write_text("f")
    before = {path for path, swapped in synced if not swapped}
    assert {str(tmp), str(tmp / "sub"), str(tmp / "new.txt"), str(tmp / "sub" / "f.txt")} <= before
    assert synced[-1] == (str(tmp_path), True)  # the parent, after the swap


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
