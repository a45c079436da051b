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
  the same rule to the tensors themselves (``check_scale_shape``), each rank's slices included;
- **pack-quantized** (compressed-tensors W4A16 / W8A16): each quantized linear stores ``weight_packed`` (int32,
  ``[out, ceil(in * num_bits / 32)]``), ``weight_scale`` (``[out, ceil(in / group_size)]`` for strategy
  ``group``, ``[out, 1]`` or ``[out]`` for ``channel``) and ``weight_shape`` (``[out, in]``: its two values are
  read from the file, a few bytes, still without torch); a ``weight_zero_point`` (asymmetric) or ``weight_g_idx``
  (activation reordering) is refused by name. ``dequantize.dequantize_packed`` checks the same on the tensors.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoint_errors import CheckpointError
from pipeline.checkpoint_files import read_config_json, weight_files
from pipeline.quantization.config import QuantizationSpec, quantization_spec

SCALE_LEAVES = ("weight_scale", "weight_scale_inv")
QUANTIZED_STORAGE = ("I8", "F8_E4M3", "F8_E5M2")  # safetensors dtypes of quantized weights
# compressed-tensors pack-quantized: a linear's packed integers, its [out, in], and what Tandem refuses beside them
PACKED_LEAF, SHAPE_LEAF = "weight_packed", "weight_shape"
PACKED_REFUSED_LEAVES = {"weight_zero_point": "asymmetric quantization",
                         "weight_g_idx": "activation reordering (actorder 'group')"}
SHAPE_FORMATS = {"I64": "<q", "I32": "<i", "I16": "<h"}  # how a weight_shape's values are stored
READABLE_DTYPES = {"I8": "int8", "U8": "uint8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                   "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I32": "int32"}
ROUTER_LEAVES = ("gate", "router")  # a mixture-of-experts router: float unless stored quantized
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as a safetensors header describes it."""

    dtype: str  # "I8", "F8_E4M3", "BF16", ...
    shape: tuple[int, ...]
    values: tuple[int, ...] | None = None  # a pack-quantized ``weight_shape``'s values, read from the file


def read_tensor_headers(files: list[Path]) -> dict[str, TensorHeader]:
    """``{tensor name: TensorHeader}`` from the files' JSON headers (no tensor data is read)."""
    headers: dict[str, TensorHeader] = {}
    for file in files:
        try:
            with open(file, "rb") as handle:
                header_size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(header_size))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read weight file {file}: {exc}") from exc
        for name, info in header.items():
            if name == "__metadata__":
                continue
            values = None
            if name.endswith(f".{SHAPE_LEAF}") and info["dtype"] in SHAPE_FORMATS and math.prod(info["shape"]) <= 8:
                values = _read_ints(file, 8 + header_size, info)
            headers[name] = TensorHeader(info["dtype"], tuple(info["shape"]), values)
    return headers


def _read_ints(file: Path, data_start: int, info: dict) -> tuple[int, ...]:
    """A small integer tensor's values (a pack-quantized ``weight_shape``), from its bytes in the file."""
    fmt = SHAPE_FORMATS[info["dtype"]]
    begin, end = info["data_offsets"]
    try:
        with open(file, "rb") as handle:
            handle.seek(data_start + begin)
            data = handle.read(end - begin)
    except OSError as exc:
        raise CheckpointError(f"cannot read weight file {file}: {exc}") from exc
    size = struct.calcsize(fmt)
    if len(data) != size * math.prod(info["shape"]):
        raise CheckpointError(f"weight file {file}: a tensor's data is cut short")
    return tuple(struct.unpack(fmt, data[i:i + size])[0] for i in range(0, len(data), size))


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
    if spec.packed:
        problems += [problem for name in sorted(headers) for problem in [_packed_problem(name, headers, spec)]
                     if problem]
    else:
        problems += [f"{name}: a pack-quantized weight, but config.json's quantization_config declares {spec.method} "
                     "weights" for name in sorted(headers) if name.endswith(f".{PACKED_LEAF}")]
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


def packed_shape(shape: tuple[int, int], num_bits: int) -> tuple[int, int]:
    """The ``weight_packed`` shape of an ``[out, in]`` weight: ``num_bits`` per value, densely in int32 words."""
    rows, cols = shape
    return rows, math.ceil(cols * num_bits / 32)


def packed_scale_shapes(shape: tuple[int, int], spec: QuantizationSpec) -> tuple[tuple[int, ...], ...]:
    """The ``weight_scale`` shapes a pack-quantized ``[out, in]`` weight may have under ``spec``'s strategy (group:
    one per ``group_size`` input columns, the last group possibly partial, as compressed-tensors allows)."""
    rows, cols = shape
    if spec.weight_strategy == "group":
        return ((rows, math.ceil(cols / spec.group_size)),)
    return ((rows, 1), (rows,))


def packed_layout_problem(prefix: str, packed: tuple[int, ...], scale: tuple[int, ...] | None,
                          shape: tuple[int, ...] | None, spec: QuantizationSpec) -> str | None:
    """What is wrong with a pack-quantized layer's stored shapes (``shape``: its ``weight_shape``'s values), if
    anything; None also where ``shape`` is unknown (a header without the values: only the dimensions are checked)."""
    if len(packed) != 2:
        return f"{prefix}.{PACKED_LEAF} has shape {tuple(packed)}: expected 2 dimensions [out, packed columns]"
    if shape is None:
        return None
    if len(shape) != 2 or min(shape) <= 0:
        return f"{prefix}.{SHAPE_LEAF} is {list(shape)}: expected [out, in] of a linear weight"
    want = packed_shape((shape[0], shape[1]), spec.num_bits)
    if tuple(packed) != want:
        return (f"{prefix}.{PACKED_LEAF} has shape {tuple(packed)}, but {prefix}.{SHAPE_LEAF} {list(shape)} in the "
                f"{spec.num_bits}-bit integers config.json declares ({spec.method}) packs into {want}")
    if scale is not None and tuple(scale) not in packed_scale_shapes((shape[0], shape[1]), spec):
        expected = " or ".join(map(str, packed_scale_shapes((shape[0], shape[1]), spec)))
        per = (f"one per {spec.group_size} input columns" if spec.weight_strategy == "group"
               else "one per output channel")
        return (f"{prefix}.weight_scale: scale of shape {tuple(scale)} does not fit the weight strategy "
                f"{_strategy(spec)} that config.json declares ({spec.method}) for a weight of shape {tuple(shape)}: "
                f"expected {expected}, {per}")
    return None


def _packed_problem(name: str, headers: dict[str, TensorHeader], spec: QuantizationSpec) -> str | None:
    """A pack-quantized checkpoint's tensor (``weight_packed``, or one Tandem refuses beside it) against the config."""
    prefix, _, leaf = name.rpartition(".")
    header = headers[name]
    if leaf in PACKED_REFUSED_LEAVES:
        return (f"{name}: {PACKED_REFUSED_LEAVES[leaf]} is not supported in compressed-tensors pack-quantized "
                f"checkpoints (Tandem runs symmetric W4A16 / W8A16 without activation reordering)")
    if leaf != PACKED_LEAF:
        return None
    if header.dtype != "I32":
        return (f"{name} is stored as {readable_dtype(header.dtype)}, but config.json's quantization_config "
                f"({spec.method}) declares {spec.num_bits}-bit integers packed into int32")
    shape_header = headers.get(f"{prefix}.{SHAPE_LEAF}")
    if shape_header is None:  # its values are the layout
        return f"the checkpoint has {name} but no {prefix}.{SHAPE_LEAF}"
    if shape_header.shape != (2,):
        return f"{prefix}.{SHAPE_LEAF} has shape {shape_header.shape}: expected 2 values [out, in]"
    scale = headers.get(f"{prefix}.weight_scale")
    return packed_layout_problem(prefix, header.shape, None if scale is None else scale.shape, shape_header.values,
                                 spec)


def _dtype_problem(name: str, header: TensorHeader, config: dict, spec: QuantizationSpec) -> str | None:
    if spec.packed:
        declared = f"{spec.num_bits}-bit integers packed into int32 ({PACKED_LEAF})"
        if header.dtype in QUANTIZED_STORAGE:
            return (f"{name} is stored as {readable_dtype(header.dtype)}, but config.json's quantization_config "
                    f"({spec.method}) declares {declared}")
        if _is_declared_quantized(name, header, config):
            return (f"{name} is stored as {readable_dtype(header.dtype)}, but config.json's quantization_config "
                    f"({spec.method}) declares {declared} for it (quantize it, or name it in the config's "
                    f"{_ignore_key(config['quantization_config'])} list)")
        return None
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
    if spec.weight_strategy == "group":
        return f"'group' (group_size {spec.group_size})"
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
