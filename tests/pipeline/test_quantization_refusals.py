"""Quantized checkpoints Tandem refuses, each by name: a missing or impossible scale, the formats and schemes it
cannot run (at load and in the launchers' torch-free check), and malformed quantization configs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import LLM
from pipeline.checkpoint_errors import CheckpointError
from pipeline.quantization.config import quantization_spec
from tests.quantized_checkpoints import REFUSED, SCHEMES, quantized_checkpoint, set_quantization_config  # noqa: F401

ENGINE = dict(kv_cache={"page_size": 4, "num_blocks": 96})


@pytest.mark.parametrize("scheme", ["w8a8_int8_channel", "fp8_block"])
def test_a_missing_scale_is_named(scheme, tiny_checkpoint, quantized_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / scheme
    shutil.copytree(quantized_checkpoint(scheme, tiny_checkpoint("llama"))[0], path)
    tensors = load_file(path / "model.safetensors")
    victim = next(name for name in tensors if name.endswith(("o_proj.weight_scale", "o_proj.weight_scale_inv")))
    del tensors[victim]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.\d\.self_attn\.o_proj\.weight_scale"):
        LLM(str(path), **ENGINE)


def test_a_static_activation_scale_of_zero_is_refused_by_name(tiny_checkpoint, quantized_checkpoint, tmp_path):
    """It loaded and quantized every activation of the layer to 0: unrelated output, no error (an audit)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "zero"
    shutil.copytree(quantized_checkpoint("w8a8_int8_tensor_static", tiny_checkpoint("llama"))[0], path)
    tensors = load_file(path / "model.safetensors")
    victim = next(name for name in tensors if name.endswith("o_proj.input_scale"))
    tensors[victim] = torch.zeros_like(tensors[victim])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"o_proj\.input_scale is 0\.0: a static activation scale must be "
                                              r"positive and finite"):
        LLM(str(path), **ENGINE)


def refused_checkpoint(tiny_checkpoint, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    shutil.copytree(tiny_checkpoint("llama"), path)
    set_quantization_config(path, REFUSED[name][0])
    return path


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_quantization_is_refused_with_its_name(name, tiny_checkpoint, tmp_path):
    path = refused_checkpoint(tiny_checkpoint, tmp_path, name)
    with pytest.raises(CheckpointError, match=REFUSED[name][1]):
        LLM(str(path), **ENGINE)


def test_launcher_check_refuses_without_torch(tiny_checkpoint, tmp_path):
    path = refused_checkpoint(tiny_checkpoint, tmp_path, "w4a8_pack_quantized")
    code = ("import sys; from deploy.checkpoint_check import check_checkpoint\n"
            "try:\n    check_checkpoint(sys.argv[1])\nexcept ValueError as exc:\n    print(exc)\n"
            "print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code, str(path)], cwd=root, capture_output=True, text=True,
                            check=True)
    assert result.stdout.splitlines() == [
        "compressed-tensors pack-quantized with input_activations (8-bit int activations, e.g. W4A8) is not "
        "supported; pack-quantized runs weight-only (W4A16, W8A16), dequantized at load", "False"]


def test_quantization_config_parsing():
    """What the launcher accepts: each scheme the tests write, and the refusals of a scheme's details."""
    for quant_config, (kind, strategy, block), is_static in SCHEMES.values():
        spec = quantization_spec({"quantization_config": quant_config})
        assert (spec.weight_type, spec.weight_strategy, spec.block_size) == (kind, strategy, block)
        assert spec.activations == ("static" if is_static else "dynamic" if quant_config.get(
            "activation_scheme") or quant_config["config_groups"]["group_0"]["input_activations"] else "none")
    assert quantization_spec({}) is None
    base = json.loads(json.dumps(SCHEMES["w8a8_int8_channel"][0]))
    for change, message in [
        (lambda c: c["config_groups"]["group_0"]["weights"].update(symmetric=False), "asymmetric weights"),
        (lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128), "'group'"),
        (lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
        (lambda c: c["config_groups"]["group_0"]["input_activations"].update(symmetric=False), "asymmetric input"),
    ]:
        config = json.loads(json.dumps(base))
        change(config)
        with pytest.raises(CheckpointError, match=message):
            quantization_spec({"quantization_config": config})


@pytest.mark.parametrize("quant_config, message", [
    ({"quant_method": "fp8", "weight_block_size": [0, 32]}, r"weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": 128}, r"weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": ["a", "b"]}, r"weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [16.5, 32]}, r"weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [-16, 32]}, r"weight_block_size must be two positive integers"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"],
      "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [0, 32]}}}},
     r"block_structure must be two positive integers"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": [{"weights": {}}]},
     r"config_groups must map group names to schemes \(got a list\)"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {"weights": "int8"}}},
     r"config group weights must be an object"),
    ({"quant_method": "fp8", "fmt": ["e4m3"]}, r"malformed|fp8 fmt"),
])
def test_a_malformed_quantization_config_is_a_checkpoint_error(quant_config, message):
    """Each used to be a traceback from the launcher's check (ZeroDivisionError, TypeError, AttributeError), or was
    accepted cut to an integer ([16.5, 32])."""
    with pytest.raises(CheckpointError, match=message):
        quantization_spec({"quantization_config": quant_config})
