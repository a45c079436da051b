"""A quantized checkpoint's stored tensors against what its ``quantization_config`` declares, read without torch.

The safetensors headers give every tensor's dtype and shape (no data is loaded), so the launchers' checkpoint
check and the loader (``loading.plan_quantization``) refuse, before a model runs, a checkpoint whose tensors do
not match its config:

- **dtype**: a weight stored in a quantized dtype must be the declared one (int8 for compressed-tensors
  ``type: int``, float8_e4m3fn for ``type: float`` and the ``fp8`` method, float8_e5m2 for its ``fmt: e5m2``),
  and every linear weight of a decoder layer that the config quantizes must be stored quantized: its
  ``targets``, less its ``ignore`` list (``modules_to_not_convert`` / ``ignored_layers`` for the fp8 method;
  names, and ``re:`` patterns matched from the start as compressed-tensors matches them). The output projection
  and a mixture-of-experts router (``gate``, ``router``) may stay float whatever the config says (llm-compressor
  leaves them so), as may layers past ``num_hidden_layers`` (DeepSeek-V3's multi-token-prediction layer);
- **scale shape**: a quantized weight's ``weight_scale`` / ``weight_scale_inv`` must have the shape of the
  declared strategy: one element (tensor), ``[out, 1]`` or ``[out]`` (channel), ``[ceil(out / bh), ceil(in /
  bw)]`` (block, ``block_structure`` / ``weight_block_size``). The dequantizer and the int8 / fp8 layers apply
  the same rule to the tensors themselves (``check_scale_shape``), each rank's slices included.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoint_errors import CheckpointError
from pipeline.checkpoint_files import read_config_json, weight_files
from pipeline.quantization.config import QuantizationSpec, quantization_spec

SCALE_LEAVES = ("weight_scale", "weight_scale_inv")
QUANTIZED_STORAGE = ("I8", "F8_E4M3", "F8_E5M2")  # safetensors dtypes of quantized weights
READABLE_DTYPES = {"I8": "int8", "U8": "uint8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                   "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I32": "int32"}
ROUTER_LEAVES = ("gate", "router")  # a mixture-of-experts router: float unless stored quantized
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as a safetensors header describes it."""

    dtype: str  # "I8", "F8_E4M3", "BF16", ...
    shape: tuple[int, ...]


def read_tensor_headers(files: list[Path]) -> dict[str, TensorHeader]:
    """``{tensor name: TensorHeader}`` from the files' JSON headers (no tensor data is read)."""
    headers: dict[str, TensorHeader] = {}
    for file in files:
        try:
            with open(file, "rb") as handle:
                header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read weight file {file}: {exc}") from exc
        headers.update({name: TensorHeader(info["dtype"], tuple(info["shape"]))
                        for name, info in header.items() if name != "__metadata__"})
    return headers


def check_quantized_checkpoint(path: str | os.PathLike) -> None:
    """``check_stored_weights`` for the checkpoint directory at ``path`` (torch-free: for the launchers)."""
    config = read_config_json(path)
    if quantization_spec(config) is not None:
        check_stored_weights(config, read_tensor_headers(weight_files(path)))


def check_stored_weights(config: dict, headers: dict[str, TensorHeader]) -> None:
    """``CheckpointError`` naming the first tensor (and how many more) whose stored dtype or scale shape does not
    match the config.json dict's ``quantization_config``; nothing without one, or for MXFP4."""
    spec = quantization_spec(config)
    if spec is None or spec.stored_dtype is None:
        return
    problems = [problem for name in sorted(headers) if name.endswith(".weight")
                for problem in (_dtype_problem(name, headers[name], config, spec),
                                _scale_problem(name, headers, spec)) if problem]
    if problems:
        more = f" (and {len(problems) - 1} more such tensors)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)


def check_scale_shape(scale_name: str, scale_shape: tuple[int, ...], weight_shape: tuple[int, ...],
                      spec: QuantizationSpec) -> None:
    """``CheckpointError`` unless the scale's shape is the one ``spec``'s strategy gives a weight of this shape."""
    problem = _scale_shape_problem(scale_name, tuple(scale_shape), tuple(weight_shape), spec)
    if problem:
        raise CheckpointError(problem)


def readable_dtype(stored: str) -> str:
    return READABLE_DTYPES.get(stored, stored)


def _dtype_problem(name: str, header: TensorHeader, config: dict, spec: QuantizationSpec) -> str | None:
    declared = readable_dtype(spec.stored_dtype)
    if header.dtype in QUANTIZED_STORAGE and header.dtype != spec.stored_dtype:
        return (f"{name} is stored as {readable_dtype(header.dtype)}, but config.json's quantization_config "
                f"({spec.method}) declares {declared} weights")
    if header.dtype not in QUANTIZED_STORAGE and _is_declared_quantized(name, header, config):
        return (f"{name} is stored as {readable_dtype(header.dtype)}, but config.json's quantization_config "
                f"({spec.method}) declares {declared} weights for it (quantize it, or name it in the config's "
                f"{_ignore_key(config['quantization_config'])} list)")
    return None


def _scale_problem(name: str, headers: dict[str, TensorHeader], spec: QuantizationSpec) -> str | None:
    weight = headers[name]
    if weight.dtype not in QUANTIZED_STORAGE or len(weight.shape) != 2:
        return None
    prefix = name[:-len(".weight")]
    scale_name = next((f"{prefix}.{leaf}" for leaf in SCALE_LEAVES if f"{prefix}.{leaf}" in headers), None)
    if scale_name is None:  # the loader names a missing scale
        return None
    return _scale_shape_problem(scale_name, headers[scale_name].shape, weight.shape, spec)


def _scale_shape_problem(scale_name: str, scale_shape: tuple[int, ...], weight_shape: tuple[int, ...],
                         spec: QuantizationSpec) -> str | None:
    rows, cols = weight_shape
    if spec.weight_strategy == "tensor":
        fits, expected = math.prod(scale_shape) == 1, "one element"
    elif spec.weight_strategy == "channel":
        fits, expected = scale_shape in ((rows, 1), (rows,)), f"{(rows, 1)} or {(rows,)}, one per output channel"
    else:
        block_rows, block_cols = spec.block_size
        blocks = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
        fits, expected = scale_shape == blocks, f"{blocks}, one per {block_rows}x{block_cols} block"
    if fits:
        return None
    return (f"{scale_name}: scale of shape {scale_shape} does not fit the weight strategy {_strategy(spec)} that "
            f"config.json declares ({spec.method}) for a weight of shape {weight_shape}: expected {expected}")


def _strategy(spec: QuantizationSpec) -> str:
    if spec.weight_strategy != "block":
        return repr(spec.weight_strategy)
    return f"'block' {list(spec.block_size)}"


def _is_declared_quantized(name: str, header: TensorHeader, config: dict) -> bool:
    """Whether ``name`` is a linear weight of a decoder layer that the config quantizes (see the module docstring)."""
    module = name[:-len(".weight")]
    layer = LAYER_INDEX.search(module)
    if len(header.shape) != 2 or layer is None or module.rpartition(".")[2] in ROUTER_LEAVES:
        return False
    if int(layer.group(1)) >= config.get("num_hidden_layers", math.inf):
        return False
    quant = config["quantization_config"]
    if any(_names_module(entry, module) for entry in quant.get(_ignore_key(quant)) or ()):
        return False
    return quant.get("quant_method") != "compressed-tensors" or any(
        _targets_module(target, module) for group in (quant.get("config_groups") or {}).values()
        if isinstance(group, dict) for target in group.get("targets") or ())


def _ignore_key(quant: dict) -> str:
    if quant.get("quant_method") == "compressed-tensors":
        return "ignore"
    return "ignored_layers" if "ignored_layers" in quant else "modules_to_not_convert"


def _targets_module(target: str, module: str) -> bool:
    """A compressed-tensors target: the class ``Linear`` (every 2-D weight here), a ``re:`` pattern or a name;
    another class name is not checked (whether the module is one is unknown without the model)."""
    return target == "Linear" or _names_module(target, module)


def _names_module(entry: str, module: str) -> bool:
    """A ``re:`` pattern matched from the start of the module's name, or the module's name (or its last parts)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return module == entry or module.endswith(f".{entry}") or module.startswith(f"{entry}.")
