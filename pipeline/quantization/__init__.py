"""Quantized checkpoints: ``config.py`` reads a checkpoint's ``quantization_config`` (torch-free, what runs or a
clear refusal), ``int8.py`` is the W8A8 int8 linear, ``dequantize.py`` turns other quantized weights back into
floats at load, ``loading.py`` swaps the model's linears and wraps the checkpoint's tensor stream. See
docs/models.md, "Quantized checkpoints"."""
