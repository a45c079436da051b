"""Loading a model whose checkpoint is quantized, or which ``--quantization int8`` quantizes at load.

``plan_quantization`` runs between building the model and loading its weights: it reads the checkpoint's
``quantization_config`` and the dtype and shape of every tensor (the safetensors headers, no data), refuses a
weight whose dtype or scale shape is not what the config declares (``checks.py``), and swaps each
eligible ``layers.Linear`` whose checkpoint weights are int8 W8A8 (or, with ``--quantization int8``, every
eligible one) for an ``Int8Linear`` with the same shard sizes and names, so ``load_weights`` fills it like
any other layer; on a GPU with fp8 GEMMs, fp8 layers with per-tensor or per-channel scales become
``Fp8Linear`` the same way. ``QuantizationPlan.tensors`` wraps the checkpoint's tensor stream: it pairs each
quantized weight with its scale, hands the kept (int8 / fp8) layers their tensors in the shapes they hold (a
per-tensor scale repeated over its rows, so a fused projection's parts stay row blocks), and dequantizes every
other quantized weight to fp32 (``dequantize.py``; gpt-oss's MXFP4 experts: ``mxfp4.py``; compressed-tensors
``pack-quantized`` W4A16 / W8A16: a layer's ``weight_packed``, ``weight_scale`` and ``weight_shape`` become its
``weight``, unpacked and scaled, one layer at a time). ``finish`` lays the kept weights out for the GEMM.

Eligible: every linear but the output projection (``lm_head``, whose logits stay in the model dtype), a
mixture-of-experts router (a ``gate`` beside ``experts``) and a linear whose module reads its weight instead of
calling it (``weights_read_directly``: MLA's ``kv_b_proj``, loaded dequantized). Experts are stacked tensors, not
linears: they load dequantized, and where the checkpoint's experts are int8 W8A8 (or ``--quantization int8``)
``finish`` turns each stacked experts module into ``Int8StackedExperts`` (``int8_experts.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from pipeline.checkpoint_errors import CheckpointError
from pipeline.checkpoint_files import read_config_json, weight_files
from pipeline.models.layers import Linear
from pipeline.models.moe import StackedExperts, expert_slot
from pipeline.quantization.checks import (PACKED_LEAF, PACKED_REFUSED_LEAVES, SCALE_LEAVES, SHAPE_LEAF,
                                          check_scale_shape, check_stored_weights, read_tensor_headers)
from pipeline.quantization.config import QuantizationSpec, check_load_time_quantization, quantization_spec
from pipeline.quantization.dequantize import dequantize_packed, dequantize_weight
from pipeline.quantization.fp8 import Fp8Linear, fits_fp8_gemm, fp8_gemm_available
from pipeline.quantization.int8 import Int8Linear
from pipeline.quantization.int8_experts import Int8StackedExperts
from pipeline.quantization.mxfp4 import Mxfp4Pairs

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
ZERO_POINT_LEAVES = ("weight_zero_point", "input_zero_point")
# activation scales of layers that run unquantized (dequantized weights): not needed
UNUSED_LEAVES = ("input_scale", "activation_scale", "output_scale")
# the fp8 method's names of a kept layer's scales, as the layers hold them
KEPT_NAMES = {"weight": "weight", "weight_scale": "weight_scale", "weight_scale_inv": "weight_scale",
              "input_scale": "input_scale", "activation_scale": "input_scale"}
SAFETENSORS_DTYPES = {"I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn}
PACKED_LEAVES = (PACKED_LEAF, "weight_scale", SHAPE_LEAF)  # what a pack-quantized layer stores


@dataclass
class QuantizationPlan:
    """What loading does to a quantized checkpoint's tensors (see the module docstring)."""

    spec: QuantizationSpec | None
    kept: dict[str, torch.dtype] = field(default_factory=dict)  # checkpoint prefix -> its weights' dtype, loaded as is
    int8_experts: bool = False  # stacked MoE experts become Int8StackedExperts once loaded
    # with int8_experts: a W8A8 checkpoint's expert weight name -> its per-row fp32 scales [out], so that the
    # experts run on the checkpoint's own int8 values and scales (their float weights quantized back with them)
    expert_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as the (swapped) model takes them."""
        pending: dict[str, dict[str, torch.Tensor]] = {}  # prefix -> the tensors of one layer seen so far
        kept_scale_names: dict[str, str] = {}  # kept prefix -> its weight scale's checkpoint name (for messages)
        mxfp4 = Mxfp4Pairs() if self.spec is not None and self.spec.weight_type == "mxfp4" else None
        packed = self.spec is not None and self.spec.packed
        packed_pending: dict[str, dict[str, torch.Tensor]] = {}  # pack-quantized prefix -> its tensors seen so far
        for name, tensor in named_tensors:
            prefix, _, leaf = name.rpartition(".")
            if packed and leaf in PACKED_REFUSED_LEAVES:
                raise CheckpointError(f"{name}: {PACKED_REFUSED_LEAVES[leaf]} is not supported in compressed-tensors "
                                      "pack-quantized checkpoints")
            if packed and leaf in PACKED_LEAVES:  # one layer's tensors, held until its last one arrives
                group = packed_pending.setdefault(prefix, {})
                group[leaf] = tensor
                if all(part in group for part in PACKED_LEAVES):
                    del packed_pending[prefix]
                    yield f"{prefix}.weight", dequantize_packed(prefix, group[PACKED_LEAF], group["weight_scale"],
                                                                group[SHAPE_LEAF], self.spec)
                continue
            if leaf in (PACKED_LEAF, SHAPE_LEAF):
                declared = "no quantization_config" if self.spec is None else f"{self.spec.method} weights"
                raise CheckpointError(f"{name} is a pack-quantized weight's tensor, but config.json declares "
                                      f"{declared}")
            if leaf in ZERO_POINT_LEAVES:
                if torch.count_nonzero(tensor):
                    raise CheckpointError(f"{name}: a nonzero zero point (asymmetric quantization) is not supported")
                continue
            if prefix in self.kept:
                if leaf not in KEPT_NAMES:
                    yield name, tensor
                    continue
                group = pending.setdefault(prefix, {})
                group[KEPT_NAMES[leaf]] = tensor
                if leaf in SCALE_LEAVES:
                    kept_scale_names[prefix] = name
                if self._is_complete_kept(group):
                    yield from self._kept_tensors(prefix, pending.pop(prefix), self.kept[prefix],
                                                  kept_scale_names.pop(prefix))
                continue
            if leaf in UNUSED_LEAVES:
                continue
            if mxfp4 is not None and mxfp4.holds(name):
                dequantized = mxfp4.add(name, tensor)
                if dequantized is not None:
                    yield dequantized
                continue
            if leaf in SCALE_LEAVES or (leaf == "weight" and tensor.dtype in QUANTIZED_DTYPES):
                self._check_declared(name, tensor)
                group = pending.setdefault(prefix, {})
                group[leaf] = tensor
                scale_leaf = next((s for s in SCALE_LEAVES if s in group), None)
                if "weight" in group and scale_leaf is not None:
                    pending.pop(prefix)
                    weight, scale = group["weight"], group[scale_leaf]
                    yield f"{prefix}.weight", dequantize_weight(f"{prefix}.weight", weight, f"{prefix}.{scale_leaf}",
                                                                scale, self.spec)
                    if self.int8_experts and weight.dtype == torch.int8 and ".experts." in prefix:
                        self.expert_scales[f"{prefix}.weight"] = scale.float().reshape(-1).expand(weight.shape[0])
                continue
            yield name, tensor
        if mxfp4 is not None:
            mxfp4.check_complete()
        if packed_pending:
            prefix, group = next(iter(packed_pending.items()))
            lacking = next(leaf for leaf in PACKED_LEAVES if leaf not in group)
            raise CheckpointError(f"the checkpoint has {', '.join(f'{prefix}.{leaf}' for leaf in group)} but no "
                                  f"{prefix}.{lacking}" + (f" (and {len(packed_pending) - 1} more such layers)"
                                                           if len(packed_pending) > 1 else ""))
        if pending:
            prefix, group = next(iter(pending.items()))
            lacking = next(leaf for leaf in ("weight", "weight_scale", "input_scale") if leaf not in group)
            raise CheckpointError(f"the checkpoint has {', '.join(f'{prefix}.{leaf}' for leaf in group)} but no "
                                  f"{prefix}.{lacking}" + (f" (and {len(pending) - 1} more such layers)"
                                                           if len(pending) > 1 else ""))

    def _check_declared(self, name: str, tensor: torch.Tensor) -> None:
        """A quantized weight or a scale needs a config that declares int8 or fp8 weights (its layout)."""
        if self.spec is None or self.spec.stored_dtype is None:
            declared = "no quantization_config" if self.spec is None else f"{self.spec.method} weights"
            raise CheckpointError(f"{name} ({tensor.dtype}) is a quantized weight or its scale, but config.json "
                                  f"declares {declared}")

    def _is_complete_kept(self, group: dict) -> bool:
        static = self.spec is not None and self.spec.activations == "static"
        return "weight" in group and "weight_scale" in group and ("input_scale" in group or not static)

    def _kept_tensors(self, prefix: str, group: dict[str, torch.Tensor], dtype: torch.dtype,
                      scale_name: str) -> Iterator[tuple[str, torch.Tensor]]:
        """A kept layer's weight and its scales as ``[rows, 1]`` (per-tensor scales repeated over the rows)."""
        weight = group["weight"]
        if weight.dtype != dtype:
            raise CheckpointError(f"{prefix}.weight is {weight.dtype}; its safetensors header says {dtype}")
        rows = weight.shape[0]
        yield f"{prefix}.weight", weight
        check_scale_shape(scale_name, tuple(group["weight_scale"].shape), tuple(weight.shape), self.spec)
        yield f"{prefix}.weight_scale", group["weight_scale"].float().reshape(-1, 1).expand(rows, 1)
        if "input_scale" in group:
            scale = group["input_scale"].float()
            if scale.numel() != 1:
                raise CheckpointError(f"{prefix}.input_scale has shape {tuple(scale.shape)}: expected one value")
            if not (torch.isfinite(scale).all() and (scale > 0).all()):  # 0 quantized every activation to 0
                raise CheckpointError(f"{prefix}.input_scale is {scale.item()}: a static activation scale must be "
                                      "positive and finite")
            yield f"{prefix}.input_scale", scale.reshape(1, 1).expand(rows, 1)

    def finish(self, model: torch.nn.Module) -> None:
        """Once every tensor is in: int8 layers quantize (``--quantization int8``) and lay out their weights;
        with ``int8_experts``, each stacked MoE experts module is replaced by its int8 form."""
        for name, module in list(model.named_modules()):
            if isinstance(module, (Int8Linear, Fp8Linear)):
                module.finish_loading()
            elif self.int8_experts and isinstance(module, StackedExperts):
                gate_up_scale, down_scale = self._stacked_expert_scales(model, name, module)
                _replace(model, name, Int8StackedExperts(module.gate_up_proj, module.down_proj,
                                                         gate_up_scale, down_scale))

    def _stacked_expert_scales(self, model: torch.nn.Module, name: str, module: StackedExperts):
        """The checkpoint's scales of the experts ``name`` stacks, laid out as its ``gate_up_proj`` / ``down_proj``
        rows (``[experts, rows]`` each); (None, None) where the checkpoint gave none for some (float experts)."""
        spec = getattr(model, "moe_spec", None)  # a mixture-of-experts model's (its checkpoint names)
        stacked = {"gate_up_proj": torch.full(module.gate_up_proj.shape[:2], float("nan")),
                   "down_proj": torch.full(module.down_proj.shape[:2], float("nan"))}
        for checkpoint_name, scale in list(self.expert_scales.items()):
            slot = expert_slot(checkpoint_name, spec) if spec is not None else None
            owner, _, param = slot.param_name.rpartition(".") if slot is not None else ("", "", "")
            if owner != name or param not in stacked or slot.expert is None:
                continue
            rows = scale.shape[0]
            start = 0 if slot.part is None else slot.part * rows
            stacked[param][slot.expert, start:start + rows] = scale
            del self.expert_scales[checkpoint_name]
        if any(torch.isnan(scales).any() for scales in stacked.values()):
            return None, None
        return stacked["gate_up_proj"], stacked["down_proj"]


def plan_quantization(model: torch.nn.Module, path: str | os.PathLike, requested: str | None) -> QuantizationPlan | None:
    """Swap ``model``'s linears for int8 ones where the checkpoint at ``path`` (or ``requested``) says so;
    None when neither the checkpoint nor ``requested`` quantizes anything."""
    config = read_config_json(path)
    spec = quantization_spec(config)
    check_load_time_quantization(requested)
    if spec is None and requested is None:
        return None
    plan = QuantizationPlan(spec)
    headers = read_tensor_headers(weight_files(path))
    check_stored_weights(config, headers)  # each weight's dtype and scale shape as the config declares
    dtypes = {name: header.dtype for name, header in headers.items()}
    # experts run int8 where the checkpoint stores them int8 W8A8 (or --quantization int8 asks for it)
    plan.int8_experts = requested == "int8" or (spec is not None and spec.is_w8a8_int8 and any(
        ".experts." in name and dtype == "I8" for name, dtype in dtypes.items()))
    checkpoint_names = getattr(model, "_checkpoint_names", None)
    for name, module in list(model.named_modules()):
        if type(module) is not Linear or checkpoint_names is None or not _is_eligible(model, name):
            continue
        names = checkpoint_names(f"{name}.weight")  # the parts of a fused projection
        kinds = {dtypes.get(part) for part in names}
        if len(kinds) > 1 and kinds & set(SAFETENSORS_DTYPES):
            raise CheckpointError(f"{', '.join(names)}: these fused weights are stored in different dtypes ({kinds})")
        stored = SAFETENSORS_DTYPES.get(kinds.pop())
        static_input = spec is not None and spec.activations == "static"
        in_features, out_features = module.weight.shape[1], module.weight.shape[0]
        args = (in_features, module.shard_sizes, module.bias is not None, module.weight.dtype, module.weight.device)
        if stored == torch.int8 and spec is not None and spec.is_w8a8_int8:
            replacement = Int8Linear(*args, is_prequantized=True, static_input=static_input)
        elif (stored == torch.float8_e4m3fn and spec is not None and spec.runs_fp8_gemm
              and fits_fp8_gemm(in_features, out_features) and fp8_gemm_available(module.weight.device)):
            replacement = Fp8Linear(*args, static_input=static_input)
        elif requested == "int8":  # float weights, or quantized ones dequantized by the stream first
            replacement = Int8Linear(*args, is_prequantized=False)
            stored = None
        else:
            continue
        _replace(model, name, replacement)
        if stored is not None:
            plan.kept.update({part.rpartition(".")[0]: stored for part in names})
    return plan


def describe_quantized_layers(model: torch.nn.Module) -> str:
    """What runs quantized, for the start-up line: e.g. "int8 W8A8 x154, int8 experts x2", or "none"."""
    counts = {"int8 W8A8": 0, "fp8": 0, "int8 experts": 0}
    for module in model.modules():
        if isinstance(module, Int8Linear):
            counts["int8 W8A8"] += 1
        elif isinstance(module, Fp8Linear):
            counts["fp8"] += 1
        elif isinstance(module, Int8StackedExperts):
            counts["int8 experts"] += 1
    return ", ".join(f"{kind} x{count}" for kind, count in counts.items() if count) or "none"


def _is_eligible(model: torch.nn.Module, name: str) -> bool:
    """Not the output projection, not a mixture-of-experts router, not a linear its module reads as weights
    (listed in the module's ``weights_read_directly``: multi-head latent attention folds ``kv_b_proj`` into its
    queries and outputs instead of calling it)."""
    if name == "lm_head":
        return False
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if leaf in getattr(parent, "weights_read_directly", ()):
        return False
    return not (leaf == "gate" and hasattr(parent, "experts"))


def _replace(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)
