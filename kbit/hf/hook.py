"""kbit's hooks into transformers, set up without importing it.

Importing transformers' quantizers takes seconds, so ``import kbit`` does not. kbit's quantizer
(``kbit.hf.quantizer``) is registered the moment ``transformers.quantizers.auto`` is imported -- which
``from_pretrained`` does before it reads a ``quantization_config`` -- or right away if it already was. So
``import kbit`` followed by ``from_pretrained(kbit_folder)`` loads kbit layers, in either import order.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

from ..nn import QUANTIZED_HOOKS

_WATCHED = "transformers.quantizers.auto"


def _register() -> None:
    importing = sys.modules.get(f"{__package__}.quantizer")
    if importing is not None and not hasattr(importing, "register"):
        return  # kbit.hf.quantizer itself is importing transformers' quantizers: it registers at its end
    try:
        from . import quantizer

        quantizer.register()
    except Exception as e:  # a broken registration must not break importing transformers
        warnings.warn(f"kbit could not register its transformers quantizer ({type(e).__name__}: {e}); "
                      "from_pretrained will not know quant_method='kbit'", RuntimeWarning, stacklevel=2)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the watched module's own loader, then registers kbit."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _register()

    def __getattr__(self, name):  # get_source, get_filename, ...: the original loader's
        return getattr(self.loader, name)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._searching = False

    def find_spec(self, fullname, path, target=None):
        if fullname != _WATCHED or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)  # found by the finders that come after this one
        finally:
            self._searching = False
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install() -> None:
    """Register kbit's quantizer now if transformers' quantizers are loaded, else as soon as they are; and record
    ``quantize_model``'s settings on the transformers models it quantizes."""
    if record_in_transformers_config not in QUANTIZED_HOOKS:
        QUANTIZED_HOOKS.append(record_in_transformers_config)
    if _WATCHED in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def record_in_transformers_config(model, **settings) -> None:
    """On a transformers model, record ``quantize_model``'s settings as its ``quantization_config``."""
    modeling = sys.modules.get("transformers.modeling_utils")  # a transformers model means it is imported
    if modeling is None or not isinstance(model, modeling.PreTrainedModel):
        return
    from .quantizer import record_quantization

    record_quantization(model, **settings)
