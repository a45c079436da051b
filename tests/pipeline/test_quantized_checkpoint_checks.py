"""A quantized checkpoint whose tensors do not match its ``quantization_config`` is refused, by name, before the
model runs: a weight scale whose shape is not the declared strategy's (never a layout guessed from the scale's
shape), a weight stored in another dtype than the declared one, or stored float where the config quantizes it.
Through the real path (``LLM(path)``) and the launchers' torch-free check (``pipeline/quantization/checks.py``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import LLM, SamplingParams
from pipeline.checkpoint_errors import CheckpointError
from pipeline.models.layers import Linear
from pipeline.quantization.checks import TensorHeader, check_stored_weights
from pipeline.quantization.int8 import Int8Linear
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)
from tests.quantized_checkpoints import SCHEMES, quantized_checkpoint, set_quantization_config  # noqa: F401

ENGINE = dict(kv_cache={"page_size": 4, "num_blocks": 96})
Q_PROJ = "model.layers.0.self_attn.q_proj"  # [64, 64] in the tiny llama
ROOT = Path(__file__).resolve().parents[2]


def rewritten(source: str, path: Path, change=None, quant_config: dict | None = None) -> str:
    """A copy of the checkpoint at ``source`` with its tensors passed through ``change`` (edits the dict in place)
    and, if given, ``quant_config`` as its quantization_config."""
    shutil.copytree(source, path)
    if change is not None:
        tensors = load_file(path / "model.safetensors")
        change(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if quant_config is not None:
        set_quantization_config(path, quant_config)
    return str(path)


def replace_scale(leaf: str, make):
    """A ``change`` that replaces q_proj's scale (layer 0) by ``make(scale)``."""
    def change(tensors: dict) -> None:
        tensors[f"{Q_PROJ}.{leaf}"] = make(tensors[f"{Q_PROJ}.{leaf}"])
    return change


def quant_config(scheme: str) -> dict:
    return json.loads(json.dumps(SCHEMES[scheme][0]))


def torch_free_check(path: str) -> list[str]:
    """The launchers' check in a fresh interpreter: [its error message, whether torch was imported]."""
    code = ("import sys; from pipeline.quantization.checks import check_quantized_checkpoint\n"
            "try:\n    check_quantized_checkpoint(sys.argv[1])\nexcept ValueError as exc:\n    print(exc)\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, path], cwd=ROOT, capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


# scheme, the scale's leaf, the bad scale from the good one, what the error must say
BAD_SCALES = {
    # the audit's case: a per-channel fp8 scale transposed to [1, in], which was applied per input column
    "fp8_channel_transposed": ("fp8_channel_dynamic", "weight_scale", lambda s: s.reshape(1, -1),
                               r"scale of shape \(1, 64\) .*strategy 'channel'.*expected \(64, 1\) or \(64,\)"),
    "fp8_channel_wrong_rows": ("fp8_channel_dynamic", "weight_scale", lambda s: torch.ones(100, 1, dtype=s.dtype),
                               r"scale of shape \(100, 1\) .*strategy 'channel'.*expected \(64, 1\)"),
    # int8 read [1, in] as per channel whenever in == out: decided from the declared strategy now
    "int8_channel_transposed": ("w8a8_int8_channel", "weight_scale", lambda s: s.reshape(1, -1),
                                r"scale of shape \(1, 64\) .*strategy 'channel'.*expected \(64, 1\)"),
    "int8_tensor_given_channels": ("w8a8_int8_tensor_static", "weight_scale", lambda s: s.expand(64, 1).clone(),
                                   r"scale of shape \(64, 1\) .*strategy 'tensor'.*expected one element"),
    "fp8_method_blocks_given_channels": ("fp8_block", "weight_scale_inv", lambda s: s.amax(1).repeat(32)[:64, None],
                                         r"scale of shape \(64, 1\) .*strategy 'block' \[48, 40\].*expected \(2, 2\)"),
    "fp8_method_tensor_given_channels": ("fp8_method_tensor_static", "weight_scale_inv",
                                         lambda s: s.expand(64, 1).clone(),
                                         r"scale of shape \(64, 1\) .*strategy 'tensor'.*expected one element"),
}


@pytest.mark.parametrize("case", list(BAD_SCALES))
def test_a_scale_not_of_the_declared_strategy_is_refused(case, tiny_checkpoint, quantized_checkpoint, tmp_path):
    scheme, leaf, make, message = BAD_SCALES[case]
    path = rewritten(quantized_checkpoint(scheme, tiny_checkpoint("llama"))[0], tmp_path / case,
                     replace_scale(leaf, make))
    with pytest.raises(CheckpointError, match=rf"{Q_PROJ}\.{leaf}: {message}"):
        LLM(path, **ENGINE)
    error, imported_torch = torch_free_check(path)  # the launchers refuse it before starting anything
    assert error.startswith(f"{Q_PROJ}.{leaf}: scale of shape") and imported_torch == "False"


def test_a_one_dimensional_per_channel_int8_scale_loads(tiny_checkpoint, quantized_checkpoint, tmp_path):
    """llm-compressor may write a per-channel scale as ``[out]``: the same model as ``[out, 1]``."""
    source = quantized_checkpoint("w8a8_int8_channel", tiny_checkpoint("llama"))[0]

    def flatten(tensors: dict) -> None:
        for name in [name for name in tensors if name.endswith(".weight_scale")]:
            tensors[name] = tensors[name].reshape(-1)

    path = rewritten(source, tmp_path / "flat", flatten)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = LLM(path, **ENGINE).generate([[5, 17, 42, 9]], params)[0].token_ids
    assert got == LLM(source, **ENGINE).generate([[5, 17, 42, 9]], params)[0].token_ids


# the checkpoint written, the config.json it is given, what the error must say of layer 0's first weight
WRONG_DTYPES = {
    "int8_weights_as_fp8": ("w8a8_int8_channel", "fp8_channel_dynamic",
                            r"stored as int8, but .*compressed-tensors float-quantized\) declares float8_e4m3fn"),
    "fp8_weights_as_int8": ("fp8_channel_dynamic", "w8a8_int8_channel",
                            r"stored as float8_e4m3fn, but .*compressed-tensors int-quantized\) declares int8"),
    "float_weights_as_int8": (None, "w8a8_int8_channel",
                              r"stored as float32, but .*compressed-tensors int-quantized\) declares int8 weights for "
                              r"it \(quantize it, or name it in the config's ignore list\)"),
    "int8_weights_as_fp8_method": ("w8a8_int8_channel", "fp8_block",
                                   r"stored as int8, but .*\(fp8\) declares float8_e4m3fn"),
}


@pytest.mark.parametrize("case", list(WRONG_DTYPES))
def test_weights_not_stored_as_declared_are_refused(case, tiny_checkpoint, quantized_checkpoint, tmp_path):
    written, declared, message = WRONG_DTYPES[case]
    source = tiny_checkpoint("llama") if written is None else quantized_checkpoint(written, tiny_checkpoint("llama"))[0]
    path = rewritten(source, tmp_path / case, quant_config=quant_config(declared))
    first = r"model\.layers\.0\.mlp\.down_proj\.weight"  # the first such weight by name
    with pytest.raises(CheckpointError, match=rf"{first} is {message}.*\(and \d+ more such tensors\)"):
        LLM(path, **ENGINE)
    error, imported_torch = torch_free_check(path)
    assert error.startswith("model.layers.0.mlp.down_proj.weight is stored as ") and imported_torch == "False"
    from deploy.checkpoint_check import check_checkpoint  # what tandem up / tandem ray up run before starting

    with pytest.raises(CheckpointError, match=rf"{first} is {message}"):
        check_checkpoint(path)


def dequantize_o_proj(tensors: dict) -> None:
    """Every o_proj of a W8A8 checkpoint stored float (bf16) instead, without its scale."""
    for name in [name for name in tensors if name.endswith("o_proj.weight")]:
        scale = tensors.pop(name.replace(".weight", ".weight_scale"))
        tensors[name] = (tensors[name].float() * scale.float()).to(torch.bfloat16)


def test_a_float_layer_the_config_ignores_loads(tiny_checkpoint, quantized_checkpoint, tmp_path):
    """The ``ignore`` list, ``re:`` patterns included: a float o_proj loads where the config names it, and is
    refused where the config says it is int8."""
    source = quantized_checkpoint("w8a8_int8_channel", tiny_checkpoint("llama"))[0]
    config = quant_config("w8a8_int8_channel")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight is stored as bfloat16"):
        LLM(rewritten(source, tmp_path / "refused", dequantize_o_proj, config), **ENGINE)
    config["ignore"] = ["lm_head", r"re:.*self_attn\.o_proj$"]
    llm = LLM(rewritten(source, tmp_path / "ignored", dequantize_o_proj, config), **ENGINE)
    attention = llm.engine.model.model.layers[0].self_attn
    assert type(attention.o_proj) is Linear and isinstance(attention.qkv_proj, Int8Linear)


def test_the_head_and_the_routers_may_stay_float(moe_checkpoint, quantized_checkpoint, tmp_path):  # noqa: F811
    """A W8A8 Qwen3-MoE whose ignore list names neither its lm_head nor its routers (mlp.gate), both float:
    loads (llm-compressor leaves them float), its attention and experts int8."""
    source = quantized_checkpoint("w8a8_int8_channel", moe_checkpoint("qwen3_moe"))[0]
    config = quant_config("w8a8_int8_channel")
    config["ignore"] = []
    llm = LLM(rewritten(source, tmp_path / "no-ignore", quant_config=config), **ENGINE)
    layer = llm.engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int8Linear) and type(layer.mlp.gate) is Linear


def header(dtype: str, *shape: int) -> TensorHeader:
    return TensorHeader(dtype, shape)


def test_the_fp8_method_checks_blocks_and_skips_what_it_does_not_convert():
    """DeepSeek-V3's layout (torch-free, headers only): block scales by ``weight_block_size``, a float router, a
    float multi-token-prediction layer past ``num_hidden_layers``, ``modules_to_not_convert`` honoured."""
    config = {"num_hidden_layers": 1, "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["kv_a_proj_with_mqa"]}}
    headers = {
        "model.layers.0.self_attn.q_proj.weight": header("F8_E4M3", 300, 200),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": header("F32", 3, 2),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": header("BF16", 48, 200),
        "model.layers.0.mlp.gate.weight": header("BF16", 8, 200),
        "model.layers.1.eh_proj.weight": header("BF16", 200, 400),
        "lm_head.weight": header("BF16", 1000, 200),
    }
    check_stored_weights(config, headers)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight_scale_inv: scale of shape \(2, 3\) .*expected \(3, 2\)"):
        check_stored_weights(config, {**headers, "model.layers.0.self_attn.q_proj.weight_scale_inv":
                                      header("F32", 2, 3)})
    del config["quantization_config"]["modules_to_not_convert"]
    with pytest.raises(CheckpointError, match=r"kv_a_proj_with_mqa\.weight is stored as bfloat16, but .*\(fp8\) "
                                              r"declares float8_e4m3fn .*modules_to_not_convert"):
        check_stored_weights(config, headers)
