"""A checkpoint's ``quantization_config`` (config.json) read as plain JSON: what Tandem runs, or a clear refusal.

Torch-free: the launchers' checkpoint check (``deploy/checkpoint_check.py``) calls ``quantization_spec`` before
anything starts, and the loader calls it again. Two methods are understood:

- ``compressed-tensors`` (llm-compressor's checkpoints) in the ``int-quantized``, ``float-quantized`` or
  ``naive-quantized`` format: symmetric 8-bit weights (int8 or float8_e4m3fn) with ``weight_scale`` per tensor or
  per output channel (fp8 also per block), activations none, dynamic per token or static per tensor; and in the
  ``pack-quantized`` format weight-only (llm-compressor's W4A16 and W8A16 presets): symmetric 4- or 8-bit integers
  packed into int32 words (``weight_packed``, ``weight_shape``) with ``weight_scale`` per group of ``group_size``
  input columns or per output channel, dequantized at load (``dequantize.dequantize_packed``);
- ``fp8`` (transformers' FineGrainedFP8 / DeepSeek-V3 style, and vLLM's per-tensor fp8): float8 weights with
  ``weight_scale_inv`` per block (``weight_block_size``) or per tensor, or ``weight_scale``;
- ``mxfp4`` on gpt-oss (the hub's released checkpoints): the experts in OCP MXFP4 (``*_blocks`` and ``*_scales``),
  dequantized at load (``mxfp4.py``).

Everything else (``pack-quantized`` with quantized activations (W4A8), other bit widths, asymmetric weights
(``weight_zero_point``) or activation reordering (``actorder: group``, ``weight_g_idx``); ``nvfp4``, mxfp4 on
another architecture, awq, gptq, bitsandbytes, a quantized KV cache, sparsity, asymmetric schemes) is a
``CheckpointError`` that names it. Whether the stored tensors match the config: ``checks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.checkpoint_errors import CheckpointError

SUPPORTED_METHODS = ("compressed-tensors (int-quantized, float-quantized, naive-quantized 8-bit; pack-quantized "
                     "4/8-bit weight-only), fp8, mxfp4 (gpt-oss)")
PACK_QUANTIZED = "pack-quantized"
COMPRESSED_TENSORS_FORMATS = ("int-quantized", "float-quantized", "naive-quantized", PACK_QUANTIZED)
PACKED_BITS = (4, 8)  # pack-quantized integer widths Tandem unpacks
PACKED_STRATEGIES = ("group", "channel")
# what ``--quantization`` (``model.quantization``) can do to a checkpoint at load
LOAD_TIME_METHODS = ("int8",)


@dataclass(frozen=True)
class QuantizationSpec:
    """How a checkpoint's quantized linear weights are stored and meant to run.

    ``weight_type``: int8, int4 (pack-quantized only), fp8 (float8) or mxfp4 (e2m1 in 32-value blocks with a
    power-of-two scale) values; ``packed``: the integers are packed into int32 words (compressed-tensors
    ``pack-quantized``: ``weight_packed`` and ``weight_shape`` instead of ``weight``); ``weight_strategy``: one scale
    per tensor, per output channel, per ``block_size`` block or per ``group_size`` input columns of a row;
    ``activations``: none (weight-only), dynamic per-token scales, or a static per-tensor ``input_scale`` from the
    checkpoint.
    """

    method: str  # for messages: "compressed-tensors int-quantized", "fp8"
    weight_type: Literal["int8", "int4", "fp8", "mxfp4"]
    weight_strategy: Literal["tensor", "channel", "block", "group"]
    activations: Literal["none", "dynamic", "static"]
    block_size: tuple[int, int] | None = None
    fp8_format: Literal["e4m3", "e5m2"] = "e4m3"  # the fp8 method's ``fmt``; compressed-tensors' fp8 is e4m3
    packed: bool = False  # compressed-tensors pack-quantized: integers packed into int32 ``weight_packed``
    group_size: int | None = None  # strategy "group": input columns per scale

    @property
    def num_bits(self) -> int:
        """Bits per integer weight (4 or 8; 8 for fp8)."""
        return 4 if self.weight_type == "int4" else 8

    @property
    def stored_dtype(self) -> str | None:
        """The safetensors dtype the quantized weights must be stored in ("I8", "F8_E4M3", "F8_E5M2", "I32" for
        pack-quantized's ``weight_packed``); None for MXFP4 (uint8 blocks, checked by ``mxfp4.py``)."""
        if self.packed:
            return "I32"
        if self.weight_type == "int8":
            return "I8"
        return {"e4m3": "F8_E4M3", "e5m2": "F8_E5M2"}[self.fp8_format] if self.weight_type == "fp8" else None

    @property
    def is_w8a8_int8(self) -> bool:
        """Whether the layers run as int8 x int8 GEMMs (else their weights are dequantized at load)."""
        return self.weight_type == "int8" and self.activations != "none" and not self.packed

    @property
    def runs_fp8_gemm(self) -> bool:
        """Whether the layers can run as fp8 GEMMs where the device has them (per-tensor / per-channel
        float8_e4m3fn weights with quantized activations; block-scaled weights are dequantized)."""
        return self.weight_type == "fp8" and self.activations != "none" and self.weight_strategy != "block"


def quantization_spec(config: dict) -> QuantizationSpec | None:
    """The spec of a config.json dict's ``quantization_config``; None when it has none. ``CheckpointError``
    naming the method, format or scheme when Tandem cannot run it."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise CheckpointError("config.json: quantization_config must be an object")
    method = str(quant.get("quant_method", "")).lower()
    try:
        if method == "compressed-tensors":
            return _compressed_tensors_spec(quant)
        if method == "fp8":
            return _fp8_spec(quant)
    except CheckpointError:
        raise
    except (AttributeError, TypeError, ValueError) as exc:  # a field of another shape than the format's
        raise CheckpointError(f"config.json: quantization_config ({method}) is malformed: {exc}") from None
    if method == "mxfp4":
        return _mxfp4_spec(config)
    refused = method or "(no quant_method)"
    if quant.get("load_in_4bit") or quant.get("load_in_8bit"):
        refused = f"bitsandbytes ({'4' if quant.get('load_in_4bit') else '8'}-bit)"
    raise CheckpointError(f"quantization method {refused!r} is not supported; supported: {SUPPORTED_METHODS}")


def check_load_time_quantization(requested: str | None) -> None:
    """``--quantization``: a method Tandem can apply at load (to any checkpoint it can load: a float one, an fp8
    one dequantized first, or an int8 W8A8 one, whose int8 layers stay as they are)."""
    if requested is not None and requested not in LOAD_TIME_METHODS:
        raise CheckpointError(f"quantization {requested!r} cannot be applied at load; supported: "
                              f"{', '.join(LOAD_TIME_METHODS)}")


def _compressed_tensors_spec(quant: dict) -> QuantizationSpec:
    fmt = quant.get("format") or "dense"
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise CheckpointError(f"compressed-tensors config_groups must map group names to schemes (got a "
                              f"{type(groups).__name__})")
    formats = {fmt} | {group.get("format") for group in groups.values() if isinstance(group, dict) and group.get("format")}
    unsupported = sorted(str(f) for f in formats if f not in COMPRESSED_TENSORS_FORMATS)
    if unsupported:
        raise CheckpointError(f"compressed-tensors format {', '.join(unsupported)!s} is not supported; supported: "
                              f"{', '.join(COMPRESSED_TENSORS_FORMATS[:-1])} (8-bit weights), {PACK_QUANTIZED} (4- or "
                              "8-bit weight-only)")
    if quant.get("kv_cache_scheme"):
        raise CheckpointError("compressed-tensors kv_cache_scheme (a quantized KV cache) is not supported")
    if quant.get("sparsity_config") and (quant["sparsity_config"].get("format") or "dense") != "dense":
        raise CheckpointError(f"compressed-tensors sparsity ({quant['sparsity_config'].get('format')}) is not supported")
    if quant.get("transform_config"):
        raise CheckpointError("compressed-tensors transform_config (rotations such as SpinQuant) is not supported")
    schemes = [group for group in groups.values() if isinstance(group, dict)]
    if not schemes:
        raise CheckpointError("compressed-tensors quantization_config has no config_groups")
    specs = {_scheme_spec(scheme, scheme.get("format") or fmt) for scheme in schemes}
    if len(specs) > 1:
        raise CheckpointError("compressed-tensors config_groups with different schemes are not supported "
                              f"({len(specs)} schemes)")
    return specs.pop()


def _scheme_spec(scheme: dict, fmt: str) -> QuantizationSpec:
    weights, inputs = scheme.get("weights"), scheme.get("input_activations")
    if not weights:
        raise CheckpointError("compressed-tensors config group without weights (activation-only) is not supported")
    for name, args in (("weights", weights), ("input_activations", inputs)):
        if args is not None and not isinstance(args, dict):
            raise CheckpointError(f"compressed-tensors config group {name} must be an object (got {args!r})")
    if scheme.get("output_activations"):
        raise CheckpointError("compressed-tensors output_activations quantization is not supported")
    if fmt == PACK_QUANTIZED:
        return _packed_spec(weights, inputs)
    weight_type = _eight_bit_type(weights, "weights")
    strategy = weights.get("strategy") or "tensor"
    allowed = ("tensor", "channel") + (("block",) if weight_type == "fp8" else ())
    if strategy not in allowed:
        raise CheckpointError(f"compressed-tensors {weight_type} weights with strategy {strategy!r} are not "
                              f"supported; supported: {', '.join(allowed)}")
    if not weights.get("symmetric", True):
        raise CheckpointError("compressed-tensors asymmetric weights (a weight_zero_point) are not supported")
    if weights.get("dynamic"):
        raise CheckpointError("compressed-tensors dynamic weight quantization is not supported")
    block_size = None
    if strategy == "block":
        block_size = _block_shape(weights.get("block_structure"), "compressed-tensors block weights' block_structure")
    activations = "none"
    if inputs:
        if _eight_bit_type(inputs, "input_activations") != weight_type:
            raise CheckpointError("compressed-tensors activations of another type than the weights are not supported")
        if not inputs.get("symmetric", True):
            raise CheckpointError("compressed-tensors asymmetric input_activations are not supported")
        activations = "dynamic" if inputs.get("dynamic") else "static"
        input_strategy = inputs.get("strategy") or "tensor"
        ok = ("token", "tensor", "group") if weight_type == "fp8" else ("token", "tensor")
        if input_strategy not in ok or (activations == "static" and input_strategy != "tensor"):
            raise CheckpointError(f"compressed-tensors {activations} input_activations with strategy "
                                  f"{input_strategy!r} are not supported")
    return QuantizationSpec(f"compressed-tensors {fmt}", weight_type, strategy, activations, block_size)


def _packed_spec(weights: dict, inputs: dict | None) -> QuantizationSpec:
    """compressed-tensors ``pack-quantized``, weight-only (W4A16, W8A16): symmetric 4- or 8-bit integers per group
    of input columns or per output channel; everything else refused by name."""
    if inputs:
        bits = inputs.get("num_bits", 8)
        raise CheckpointError(f"compressed-tensors {PACK_QUANTIZED} with input_activations ({bits}-bit "
                              f"{inputs.get('type', 'int')} activations, e.g. W4A8) is not supported; "
                              f"{PACK_QUANTIZED} runs weight-only (W4A16, W8A16), dequantized at load")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if kind != "int":
        raise CheckpointError(f"compressed-tensors {PACK_QUANTIZED} {kind} weights are not supported (only int)")
    if bits not in PACKED_BITS:
        raise CheckpointError(f"compressed-tensors {PACK_QUANTIZED} weights of {bits}-bit int are not supported "
                              f"(num_bits {' or '.join(map(str, PACKED_BITS))})")
    if not weights.get("symmetric", True):
        raise CheckpointError(f"compressed-tensors {PACK_QUANTIZED} asymmetric weights (a weight_zero_point) are not "
                              "supported")
    if weights.get("dynamic"):
        raise CheckpointError("compressed-tensors dynamic weight quantization is not supported")
    actorder = weights.get("actorder")
    if actorder in ("group", "dynamic"):
        raise CheckpointError(f"compressed-tensors {PACK_QUANTIZED} with actorder {actorder!r} (activation "
                              "reordering: a weight_g_idx per layer) is not supported; actorder 'weight' / 'static' "
                              "or none is")
    strategy = weights.get("strategy") or "tensor"
    if strategy not in PACKED_STRATEGIES:
        raise CheckpointError(f"compressed-tensors {PACK_QUANTIZED} weights with strategy {strategy!r} are not "
                              f"supported; supported: {', '.join(PACKED_STRATEGIES)}")
    group_size = None
    if strategy == "group":
        group_size = weights.get("group_size")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise CheckpointError(f"compressed-tensors {PACK_QUANTIZED} group weights need a positive integer "
                                  f"group_size (got {group_size!r})")
    return QuantizationSpec(f"compressed-tensors {PACK_QUANTIZED}", "int4" if bits == 4 else "int8", strategy, "none",
                            packed=True, group_size=group_size)


def _eight_bit_type(args: dict, what: str) -> str:
    kind, bits = args.get("type", "int"), args.get("num_bits", 8)
    if bits != 8 or kind not in ("int", "float"):
        raise CheckpointError(f"compressed-tensors {what} of {bits}-bit {kind} are not supported (only 8-bit int or "
                              "float)")
    return "int8" if kind == "int" else "fp8"


def _block_shape(value, what: str) -> tuple[int, int]:
    """A scale block's ``[rows, cols]``: two positive integers (a zero divided the scale check, a float was cut)."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise CheckpointError(f"{what} must be two positive integers [rows, cols] (got {value!r})")
    return value[0], value[1]


def _mxfp4_spec(config: dict) -> QuantizationSpec:
    """gpt-oss's MXFP4 experts, dequantized at load; no other architecture ships MXFP4 in this layout."""
    if config.get("model_type") != "gpt_oss":
        raise CheckpointError(f"quantization method 'mxfp4' is supported for gpt-oss's experts only (this checkpoint's "
                              f"model_type is {config.get('model_type')!r})")
    return QuantizationSpec(method="mxfp4", weight_type="mxfp4", weight_strategy="block", activations="none")


def _fp8_spec(quant: dict) -> QuantizationSpec:
    activation_scheme = str(quant.get("activation_scheme", "dynamic")).lower()
    if activation_scheme not in ("dynamic", "static"):
        raise CheckpointError(f"fp8 activation_scheme {activation_scheme!r} is not supported (dynamic or static)")
    if quant.get("expert_dtype", "fp8") != "fp8":
        raise CheckpointError(f"fp8 expert_dtype {quant['expert_dtype']!r} (packed fp4 experts) is not supported")
    fmt = quant.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise CheckpointError(f"fp8 fmt {fmt!r} is not supported (e4m3 or e5m2)")
    block = quant.get("weight_block_size")
    block_size = None if block is None else _block_shape(block, "fp8 weight_block_size")
    return QuantizationSpec("fp8", "fp8", "tensor" if block_size is None else "block", activation_scheme, block_size,
                            fmt)
