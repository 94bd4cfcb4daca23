"""The README.md (model card) of a saved kbit folder: how to load it, first.

transformers 5.x has no way for a folder or a package to explain an unknown ``quant_method``: no entry point, and
no field of config.json that it reads out. In a process that has not imported kbit it logs "Unknown quantization
type, got kbit ... you can delete the quantization_config attribute in config.json" and then refuses the folder
("size mismatch"); deleting ``quantization_config`` would load packed codes as weights. So the folder says it
itself: ``kbit.save_quantized`` and ``python -m kbit quantize`` put this notice at the top of its README.md (after
the card's metadata block), keeping any card the folder or the source model had. Plain ``save_pretrained`` writes no
README.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

README = "README.md"
_MARK = "<!-- kbit: how to load this folder -->"
NOTICE = f"""{_MARK}
**This folder holds weights quantized by [kbit](https://pypi.org/project/kbit/)** (`quant_method: "kbit"` in
config.json). Load it after `pip install kbit` and `import kbit`:

```python
import kbit  # registers quant_method "kbit" with transformers
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
```

Without `import kbit`, transformers reports an unknown quantization type and a size mismatch on every quantized
weight. Do not delete `quantization_config` from config.json as its message suggests: the quantized tensors would
then load as random weights.

"""


def _split_metadata(text: str) -> tuple:
    """(the card's YAML metadata block with its closing line, the rest): the Hub reads metadata only at the top."""
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end >= 0:
            return text[: end + 5], text[end + 5:]
    return "", text


def write_model_card(folder: Path, previous: Optional[Path] = None) -> Path:
    """Put the loading notice at the top of ``folder``'s README.md. Its text comes from that file if the save wrote
    or copied one, else from ``previous`` (the README of the folder being replaced), else it is the notice alone;
    a card that has the notice already is kept as it is. Returns the README's path."""
    path = Path(folder) / README
    source = path if path.is_file() else previous if previous is not None and Path(previous).is_file() else None
    text = Path(source).read_text(encoding="utf-8") if source is not None else ""
    if _MARK not in text:
        metadata, body = _split_metadata(text)
        text = metadata + NOTICE + body
    path.write_text(text, encoding="utf-8")
    return path
