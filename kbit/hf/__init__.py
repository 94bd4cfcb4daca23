"""kbit inside transformers: ``quantization_config=kbit.KbitConfig(...)``, kbit folders, saving.

    save.py             save_quantized (an atomic save_pretrained), check_loads, from_config
    quantizer.py        KbitConfig and the transformers quantizer (registered by hook.py)
    hook.py             registering quant_method "kbit" when transformers' quantizers load
    folder.py           a kbit folder: saved names, finding kbit layers in a checkpoint, checking them
    quantize_op.py      quantizing a layer while transformers loads it
    dequantize.py       model.dequantize(): kbit layers back to the model's own full-precision modules
    tensor_parallel.py  from_pretrained(kbit folder, tp_plan="auto"): each rank reads its shards

transformers is optional: importing this package does not import it (quantizer.py, quantize_op.py and
tensor_parallel.py do).
"""

from .save import check_loads, check_ties, dtype_kwarg, from_config, save_quantized

__all__ = ["save_quantized", "check_ties", "check_loads", "from_config", "dtype_kwarg"]
