"""Quantized checkpoints for the tests, written the way a user downloads them.

``write_quantized(source, quantized, reference, scheme)`` reads a float checkpoint (a tiny random model),
quantizes the linear weights of its decoder layers with torch into the exact tensor names and config.json form
of the scheme (compressed-tensors: ``weight`` int8 / float8_e4m3fn, ``weight_scale`` ``[out, 1]`` per channel or
``[1]`` per tensor, ``input_scale`` ``[1]`` for static activations, ``quantization_config`` with
``config_groups`` targeting Linear and ``ignore: [lm_head]`` plus each decoder linear left float; the fp8 method:
``weight_scale_inv`` per ``weight_block_size`` block), and writes beside it the same model with the dequantized
weights in fp32: the oracle transformers runs.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _args(kind: str, strategy: str, dynamic: bool, **extra) -> dict:
    return {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": None, "block_structure": None, "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}, **extra}


def compressed_tensors_config(fmt: str, weights: dict, inputs: dict | None) -> dict:
    """``quantization_config`` as llm-compressor writes it."""
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                      "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
    }


# scheme -> (quantization_config, how weights are quantized: (type, strategy, block), static input scales)
SCHEMES: dict[str, tuple[dict, tuple, bool]] = {
    "w8a8_int8_channel": (compressed_tensors_config(
        "int-quantized", _args("int", "channel", False), _args("int", "token", True)), ("int8", "channel", None), False),
    "w8a8_int8_tensor_static": (compressed_tensors_config(
        "int-quantized", _args("int", "tensor", False), _args("int", "tensor", False)), ("int8", "tensor", None), True),
    # weight-only int8 (no input_activations): dequantized at load
    "int8_weight_only": (compressed_tensors_config(
        "naive-quantized", _args("int", "channel", False), None), ("int8", "channel", None), False),
    "fp8_channel_dynamic": (compressed_tensors_config(
        "float-quantized", _args("float", "channel", False), _args("float", "token", True)),
        ("fp8", "channel", None), False),
    "fp8_tensor_static": (compressed_tensors_config(
        "float-quantized", _args("float", "tensor", False), _args("float", "tensor", False)),
        ("fp8", "tensor", None), True),
    # the fp8 method per tensor, static activations: weight_scale_inv and activation_scale, transformers' names
    "fp8_method_tensor_static": ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None},
                                 ("fp8", "tensor", None), True),
    # transformers' FineGrainedFP8 / DeepSeek-V3 layout, with blocks that do not divide the tiny model's sizes
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [48, 40]}, ("fp8", "block", (48, 40)), False),
    # blocks that divide every size of the tiny llama and of its tensor-parallel halves
    "fp8_block_whole": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                         "weight_block_size": [16, 32]}, ("fp8", "block", (16, 32)), False),
}

# config.json quantization_config of formats Tandem refuses, and the name the refusal must carry
REFUSED: dict[str, tuple[dict, str]] = {
    # pack-quantized runs weight-only (W4A16, W8A16: tests/pipeline/test_pack_quantized.py); W4A8 is refused
    "w4a8_pack_quantized": (compressed_tensors_config(
        "pack-quantized", {**_args("int", "group", False), "num_bits": 4, "group_size": 128},
        _args("int", "token", True)), "pack-quantized with input_activations"),
    "nvfp4": (compressed_tensors_config("nvfp4-pack-quantized", {**_args("float", "tensor_group", False),
                                                                 "num_bits": 4, "group_size": 16}, None),
              "nvfp4-pack-quantized"),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "awq"),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}, "gptq"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
                     "bitsandbytes"),
    "mxfp4": ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, "mxfp4"),
}


def quantize_weight(weight: torch.Tensor, kind: str, strategy: str, block: tuple[int, int] | None):
    """``[out, in]`` fp32 -> (quantized values, scale as stored, dequantized fp32)."""
    qmax = 127.0 if kind == "int8" else FP8_MAX
    rows, cols = weight.shape
    if strategy == "tensor":
        scale = (weight.abs().max() / qmax).reshape(1)
        expanded = scale.reshape(1, 1)
    elif strategy == "channel":
        scale = weight.abs().amax(dim=1, keepdim=True) / qmax  # [out, 1]
        expanded = scale
    else:
        block_rows, block_cols = block
        scale = torch.zeros(math.ceil(rows / block_rows), math.ceil(cols / block_cols))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = weight[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols]
                scale[i, j] = tile.abs().max() / qmax
        expanded = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    if kind == "int8":
        scale = scale.to(torch.bfloat16)  # compressed-tensors keeps scales in the model's dtype
        expanded = expanded.to(torch.bfloat16).float()
        values = torch.round(weight / expanded).clamp(-128, 127).to(torch.int8)
    else:
        values = (weight / expanded).to(torch.float8_e4m3fn)
    return values, scale, values.float() * expanded


def _input_absmax(reference_dir: Path) -> dict[str, float]:
    """A calibration pass: each linear's largest input value over a random prompt (static activation scales)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference_dir, torch_dtype=torch.float32).eval()
    absmax: dict[str, float] = {}
    hooks = [module.register_forward_pre_hook(
        lambda module, args, name=name: absmax.__setitem__(name, max(absmax.get(name, 0.0), args[0].abs().max().item())))
        for name, module in model.named_modules() if name.endswith(LINEAR_NAMES)]
    with torch.no_grad():
        model(torch.randint(3, 250, (1, 48), generator=torch.Generator().manual_seed(7)))
    for hook in hooks:
        hook.remove()
    return absmax


def write_quantized(source: str | Path, quantized: Path, reference: Path, scheme: str) -> None:
    """``quantized``: ``source`` with its decoder linears quantized as ``SCHEMES[scheme]``; ``reference``: the
    same model with the dequantized weights (fp32) and no quantization_config."""
    quant_config, (kind, strategy, block), is_static = SCHEMES[scheme]
    source = Path(source)
    for directory in (quantized, reference):
        shutil.copytree(source, directory, dirs_exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    stored, dequantized, left_float = {}, {}, []
    for name, tensor in tensors.items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module.endswith(LINEAR_NAMES):
            values, scale, float_values = quantize_weight(tensor.float(), kind, strategy, block)
            stored[name] = values
            stored[f"{module}.{'weight_scale_inv' if quant_config['quant_method'] == 'fp8' else 'weight_scale'}"] = scale
            dequantized[name] = float_values
        else:
            stored[name] = dequantized[name] = tensor
            if name.endswith(".weight") and tensor.dim() == 2 and ".layers." in name:
                left_float.append(module)  # a linear left float (a router, MLA's kv_a_proj, Mixtral's experts)
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    if is_static:
        qmax = 127.0 if kind == "int8" else FP8_MAX
        for module, value in _input_absmax(reference).items():
            leaf = "activation_scale" if quant_config["quant_method"] == "fp8" else "input_scale"
            stored[f"{module}.{leaf}"] = torch.tensor([value / qmax], dtype=torch.bfloat16)
    save_file(stored, quantized / "model.safetensors", metadata={"format": "pt"})
    set_quantization_config(quantized, with_ignored(quant_config, left_float))


def with_ignored(quant_config: dict, modules: list[str]) -> dict:
    """``quant_config`` naming ``modules`` (left float) where the method lists them, as llm-compressor writes
    each Linear it did not quantize into ``ignore`` (transformers' fp8: ``modules_to_not_convert``)."""
    if not modules:
        return quant_config
    key = "ignore" if quant_config["quant_method"] == "compressed-tensors" else "modules_to_not_convert"
    return {**quant_config, key: [*(quant_config.get(key) or []), *modules]}


def set_quantization_config(directory: Path, quant_config: dict | None) -> None:
    config_path = Path(directory) / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    config_path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="session")
def quantized_checkpoint(tmp_path_factory):
    """``quantized_checkpoint(scheme, source)`` -> (quantized path, dequantized fp32 reference path) of the float
    checkpoint at ``source``, written once per session."""
    cache: dict[tuple[str, str], tuple[str, str]] = {}

    def make(scheme: str, source: str) -> tuple[str, str]:
        if (scheme, source) not in cache:
            root = tmp_path_factory.mktemp(f"quantized-{scheme}")
            write_quantized(source, root / "quantized", root / "reference", scheme)
            cache[scheme, source] = (str(root / "quantized"), str(root / "reference"))
        return cache[scheme, source]

    return make


