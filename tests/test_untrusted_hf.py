"""Untrusted kbit folders through transformers' loader: what kbit checks must be what the folder stores on disk,
whatever transformers casts; rotations come whole; block scales fit the weight's dtype; a damaged shard is named.
Also: the folder tells a reader without kbit how to load it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import kbit  # noqa: E402

from test_moe import tiny_moe  # noqa: E402
from test_transformers import build  # noqa: E402

LAYER = "model.layers.0.mlp.up_proj"
EXPERTS = "model.layers.0.mlp.experts"


def _save(model, folder: Path) -> Path:
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A kbit folder of a tiny fp16 Llama, its up_proj of layer 0 rotated (every kind of kbit entry)."""
    torch.manual_seed(17)
    model = build("llama").to(torch.float16)
    return _save(kbit.quantize_model(model, bits=4, progress=False, rotate=True), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    torch.manual_seed(19)
    return _save(kbit.quantize_model(tiny_moe("qwen3_moe", torch.float16), bits=4, progress=False),
                 tmp_path_factory.mktemp("moe"))


def _damaged(folder: Path, tmp_path: Path, change) -> str:
    """A copy of ``folder`` whose weights ``change`` rewrote (a dict of tensors, changed in place)."""
    out = tmp_path / "damaged"
    shutil.copytree(folder, out)
    path = out / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    change(tensors)
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    return str(out)


def _load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder))


def _cast(key: str, dtype: torch.dtype):
    return lambda t: t.__setitem__(key, t[key].to(dtype))


# ----------------------------------------------------------------------------- dtypes as stored (item 1)
@pytest.mark.parametrize("entry, dtype", [
    ("weight", torch.float32),  # packed codes as floats: transformers would cast them back to int32
    ("weight", torch.int64),
    ("absmax", torch.float32),
    ("absmax", torch.int32),
    ("scale", torch.int64),  # an integer scale: loading widens floats to float32, never integers
    ("codebook", torch.int32),
    ("rotation_signs", torch.float32),
    ("rotation_block", torch.float32),
])
def test_a_dense_entry_stored_in_another_dtype_is_refused(llama_folder, tmp_path, entry, dtype):
    folder = _damaged(llama_folder, tmp_path, _cast(f"{LAYER}.{entry}", dtype))
    stored = {torch.float32: "F32", torch.int64: "I64", torch.int32: "I32"}[dtype]
    with pytest.raises(ValueError, match=rf"{LAYER}\.{entry} is stored as {stored}"):
        _load(folder)


@pytest.mark.parametrize("entry, dtype", [
    ("gate_up_packed", torch.int64),
    ("gate_up_absmax", torch.int8),
    ("down_packed", torch.float32),
    ("down_scale", torch.int32),
])
def test_an_experts_entry_stored_in_another_dtype_is_refused(moe_folder, tmp_path, entry, dtype):
    folder = _damaged(moe_folder, tmp_path, _cast(f"{EXPERTS}.{entry}", dtype))
    with pytest.raises(ValueError, match=rf"{EXPERTS}\.{entry} is stored as"):
        _load(folder)


def test_float_codebook_and_scale_of_another_width_still_load(llama_folder, tmp_path):
    """What load_state_dict accepts (a codebook or scale cast to 16 bits) loads through transformers too."""
    def widen(t):
        t[f"{LAYER}.codebook"] = t[f"{LAYER}.codebook"].to(torch.float64)
        t[f"{LAYER}.scale"] = t[f"{LAYER}.scale"].to(torch.float16)

    model = _load(_damaged(llama_folder, tmp_path, widen))
    assert model.get_submodule(LAYER).codebook.dtype == torch.float32


# ----------------------------------------------------------------------------- rotations come whole (item 2)
@pytest.mark.parametrize("entry", ["rotation_signs", "rotation_block"])
def test_a_rotated_layer_lacking_half_its_rotation_is_refused(llama_folder, tmp_path, entry):
    folder = _damaged(llama_folder, tmp_path, lambda t: t.pop(f"{LAYER}.{entry}"))
    with pytest.raises(ValueError, match=rf"layer {LAYER} lacks {LAYER}\.{entry}$"):
        _load(folder)


# ----------------------------------------------------------------------------- scales within the dtype (item 3)
def _set(key: str, index, value):
    return lambda t: t[key].__setitem__(index, value)


def test_a_dense_scale_past_the_dtype_range_is_refused(llama_folder, tmp_path):
    """(An absmax code past the range: tests/test_untrusted.py, on a weight whose scale allows one.)"""
    folder = _damaged(llama_folder, tmp_path, _set(f"{LAYER}.scale", (), 2.0**20))
    with pytest.raises(ValueError, match=rf"(?s)layer {LAYER}:.*absmax with scale: .* past float16's largest value"):
        _load(folder)


@pytest.mark.parametrize("key, value", [("gate_up_scale", 2.0**100), ("down_scale", 2.0**20)])
def test_experts_scales_past_the_dtype_range_are_refused(moe_folder, tmp_path, key, value):
    folder = _damaged(moe_folder, tmp_path, _set(f"{EXPERTS}.{key}", 1, value))
    proj = key.rpartition("_")[0]
    with pytest.raises(ValueError, match=rf"(?s)layer {EXPERTS}:.*{proj}_absmax with .*, expert 1: .*past float16"):
        _load(folder)


def test_loaded_folders_dequantize_to_finite_values(llama_folder, moe_folder):
    """The checks refuse nothing that kbit writes."""
    for folder in (llama_folder, moe_folder):
        model = _load(folder)
        for m in model.modules():
            if isinstance(m, kbit.KbitLinear):
                assert bool(torch.isfinite(m.dequantize()).all())
            elif isinstance(m, kbit.KbitExperts):
                assert all(bool(torch.isfinite(m.dequantize(p)).all()) for p in ("gate_up", "down"))


# ----------------------------------------------------------------------------- damaged files (unclear messages)
def test_a_truncated_shard_is_named(llama_folder, tmp_path):
    out = tmp_path / "truncated"
    shutil.copytree(llama_folder, out)
    path = out / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        _load(out)


# ----------------------------------------------------------------------------- without kbit: the folder says how
ROOT = Path(__file__).resolve().parents[1]


def test_saved_folders_say_how_to_load_them(tmp_path):
    """transformers offers no hook for an unknown quant_method's message (kbit.model_card): save_quantized's folder
    starts its README with `import kbit`; a card the folder had keeps its metadata block first, and a second save
    does not repeat the notice."""
    torch.manual_seed(3)
    model = kbit.quantize_model(build("llama"), bits=4, progress=False)
    out = tmp_path / "k4"
    kbit.save_quantized(model, out)
    card = (out / "README.md").read_text()
    assert card.startswith(kbit.model_card.NOTICE) and "import kbit" in card and "quantization_config" in card
    (out / "README.md").write_text("---\nlicense: mit\n---\n# My model\n")
    kbit.save_quantized(model, out)
    kbit.save_quantized(model, out)
    card = (out / "README.md").read_text()
    assert card == "---\nlicense: mit\n---\n" + kbit.model_card.NOTICE + "# My model\n"


def test_cli_folder_says_how_to_load_it(tmp_path):
    from kbit.convert import cli_quantize

    torch.manual_seed(5)
    src, out = tmp_path / "src", tmp_path / "out"
    build("llama").save_pretrained(str(src))
    (src / "README.md").write_text("# Source model\n")
    assert cli_quantize([str(src), "--out", str(out), "--no-progress"]) == 0
    assert (out / "README.md").read_text() == kbit.model_card.NOTICE + "# Source model\n"
    assert (src / "README.md").read_text() == "# Source model\n"


def test_readme_says_first_that_loading_needs_import_kbit():
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:25])  # right after the two commands
    assert "import kbit" in first and "quantization_config" in first
