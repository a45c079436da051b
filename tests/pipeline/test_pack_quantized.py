"""compressed-tensors ``pack-quantized`` weight-only checkpoints (llm-compressor's W4A16 and W8A16 presets),
written here the way the library lays them out: ``weight_packed`` (int32 words, value j of a row at bits
``j * num_bits`` onward, little-endian, stored plus ``1 << (num_bits - 1)``), ``weight_scale`` per group of input
columns or per output channel, ``weight_shape``. The test's own packing is checked against a slow bit-by-bit
reference (and, where the library is unpacked at /tmp/ct, against its ``pack_to_int32``).

Tandem dequantizes them at load, so the loaded model is the float model of the dequantized weights: the same
weights bit for bit, the same greedy tokens and logprobs (1e-5, fp32). Against the float model they were
quantized from, the error is quantization's own (bounds below, measured figures in docs/quantization.md).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, safe_open, save_file

from deploy.checkpoint_check import check_checkpoint as launcher_check
from pipeline import LLM, SamplingParams
from pipeline.checkpoint_errors import CheckpointError
from pipeline.parallel import UnsupportedTensorParallel
from pipeline.parallel.shard_spec import check_checkpoint as tensor_parallel_check
from pipeline.quantization.checks import TensorHeader, check_quantized_checkpoint, check_stored_weights
from pipeline.quantization.config import quantization_spec
from pipeline.quantization.dequantize import dequantize_packed, unpack_int32
from pipeline.quantization.loading import QuantizationPlan
from pipeline.weights import load_hf_config
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_quantization import ENGINE, linear_kinds, sequences, teacher_forced_errors
from tests.quantized_checkpoints import LINEAR_NAMES, compressed_tensors_config, set_quantization_config

# scheme -> (num_bits, strategy, group_size): llm-compressor's W4A16 (group 128 on real models; the tiny llama's
# layers are 64 and 128 wide) and W8A16 (per channel)
PACKED_SCHEMES = {
    "w4a16_group32": (4, "group", 32),
    "w4a16_group16": (4, "group", 16),
    "w8a16_channel": (8, "channel", None),
}
# against the float model the weights were quantized from (teacher-forced max |logprob error|, min top-1 agreement);
# measured on the tiny llama (random weights, nearly flat next-token distributions): W4A16 group 32 0.408 / 71.2%,
# group 16 0.316 / 73.1%, W8A16 per channel 0.028 / 98.1% (docs/quantization.md)
FLOAT_BOUNDS = {
    "w4a16_group32": (0.7, 0.6),
    "w4a16_group16": (0.6, 0.6),
    "w8a16_channel": (0.06, 0.95),
}
CT_HELPERS = Path("/tmp/ct/compressed_tensors/compressors/pack_quantized/helpers.py")


def weight_args(num_bits: int, strategy: str, group_size: int | None, **extra) -> dict:
    """``config_groups.group_0.weights`` as llm-compressor writes them for W4A16 / W8A16."""
    return {"num_bits": num_bits, "type": "int", "symmetric": True, "strategy": strategy, "group_size": group_size,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
            **extra}


def packed_config(scheme: str, **extra) -> dict:
    return compressed_tensors_config("pack-quantized", weight_args(*PACKED_SCHEMES[scheme], **extra), None)


# --- the layout, written by the test -------------------------------------------------------------------------------

def pack(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Signed integers ``[rows, cols]`` -> int32 ``[rows, ceil(cols * num_bits / 32)]`` (compressed-tensors'
    dense packing, for num_bits dividing 32)."""
    rows, cols = values.shape
    per_word = 32 // num_bits
    words = math.ceil(cols * num_bits / 32)
    unsigned = values.long() + (1 << (num_bits - 1))
    unsigned = torch.nn.functional.pad(unsigned, (0, words * per_word - cols)).reshape(rows, words, per_word)
    packed = (unsigned << (torch.arange(per_word) * num_bits)).sum(-1)  # < 2**32
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def pack_bit_by_bit(values: list[list[int]], num_bits: int) -> list[list[int]]:
    """The slow reference: each row's values as one little-endian bit stream, value j at bits j * num_bits
    onward (least significant first), cut into 32-bit words read as signed int32."""
    rows = []
    for row in values:
        bits = [((value + (1 << (num_bits - 1))) >> bit) & 1 for value in row for bit in range(num_bits)]
        bits += [0] * (-len(bits) % 32)
        words = [sum(bits[32 * word + k] << k for k in range(32)) for word in range(len(bits) // 32)]
        rows.append([word - 2 ** 32 if word >= 2 ** 31 else word for word in words])
    return rows


def unpack_bit_by_bit(words: list[list[int]], num_bits: int, cols: int) -> list[list[int]]:
    rows = []
    for row in words:
        bits = [((word % 2 ** 32) >> k) & 1 for word in row for k in range(32)]
        rows.append([sum(bits[j * num_bits + bit] << bit for bit in range(num_bits)) - (1 << (num_bits - 1))
                     for j in range(cols)])
    return rows


def quantize(weight: torch.Tensor, num_bits: int, strategy: str, group_size: int | None):
    """fp32 ``[out, in]`` -> (signed integers, scale as stored (bf16), dequantized fp32), as llm-compressor's
    minmax observer does it symmetrically: scale = absmax / ((2**bits - 1) / 2), round, clamp."""
    rows, cols = weight.shape
    low, high = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    if strategy == "group":
        groups = math.ceil(cols / group_size)
        padded = torch.nn.functional.pad(weight, (0, groups * group_size - cols))
        absmax = padded.reshape(rows, groups, group_size).abs().amax(-1)  # [out, groups]
    else:
        absmax = weight.abs().amax(1, keepdim=True)  # [out, 1]
    scale = (absmax / ((high - low) / 2)).to(torch.bfloat16)
    expanded = scale.float().repeat_interleave(group_size, 1)[:, :cols] if strategy == "group" else scale.float()
    values = torch.round(weight / expanded).clamp(low, high).to(torch.int8)
    return values, scale, values.float() * expanded


def write_packed(source: Path, quantized: Path, reference: Path, scheme: str) -> None:
    """``quantized``: ``source`` with every decoder linear packed as ``scheme``; ``reference``: the same model with
    the dequantized weights in fp32 and no quantization_config."""
    num_bits, strategy, group_size = PACKED_SCHEMES[scheme]
    for directory in (quantized, reference):
        shutil.copytree(source, directory, dirs_exist_ok=True)
    stored, dequantized = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module.endswith(LINEAR_NAMES):
            values, scale, float_values = quantize(tensor.float(), num_bits, strategy, group_size)
            stored[f"{module}.weight_packed"] = pack(values, num_bits)
            stored[f"{module}.weight_scale"] = scale
            stored[f"{module}.weight_shape"] = torch.tensor(tensor.shape)  # int64, as the library stores it
            dequantized[name] = float_values
        else:
            stored[name] = dequantized[name] = tensor
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    save_file(stored, quantized / "model.safetensors", metadata={"format": "pt"})
    set_quantization_config(quantized, packed_config(scheme))


@pytest.fixture(scope="session")
def packed_checkpoint(tiny_checkpoint, tmp_path_factory):
    """``packed_checkpoint(scheme, source=None)`` -> (pack-quantized path, dequantized fp32 reference path) of the
    float checkpoint at ``source`` (the tiny llama by default)."""
    cache: dict[tuple[str, str], tuple[str, str]] = {}

    def make(scheme: str, source: str | None = None) -> tuple[str, str]:
        source = source or tiny_checkpoint("llama")
        if (scheme, source) not in cache:
            root = tmp_path_factory.mktemp(f"packed-{scheme}")
            write_packed(Path(source), root / "quantized", root / "reference", scheme)
            cache[scheme, source] = (str(root / "quantized"), str(root / "reference"))
        return cache[scheme, source]

    return make


# --- the packing itself --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("cols", [64, 40, 37])  # whole words, and a last word part-filled
def test_packing_is_the_bit_by_bit_layout_and_tandem_unpacks_it(num_bits, cols):
    generator = torch.Generator().manual_seed(num_bits * 100 + cols)
    low, high = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    values = torch.randint(low, high + 1, (5, cols), generator=generator)
    values[0, :2] = torch.tensor([low, high])  # the extremes: the top word bit set for 8-bit values
    packed = pack(values, num_bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, math.ceil(cols * num_bits / 32))
    assert packed.tolist() == pack_bit_by_bit(values.tolist(), num_bits)
    assert unpack_bit_by_bit(packed.tolist(), num_bits, cols) == values.tolist()
    assert torch.equal(unpack_int32(packed, num_bits, cols), values.to(torch.int32))


def test_dequantize_packed_scales_each_group_and_a_partial_last_group():
    """Group 16 over 40 columns: three scales a row, the last one for 8 columns (compressed-tensors sizes the
    scale with ceil(in / group_size))."""
    spec = quantization_spec({"quantization_config": compressed_tensors_config(
        "pack-quantized", weight_args(4, "group", 16), None)})
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(-8, 8, (6, 40), generator=generator)
    scale = torch.rand(6, 3, generator=generator).to(torch.bfloat16)
    got = dequantize_packed("x", pack(values, 4), scale, torch.tensor([6, 40]), spec)
    want = torch.empty(6, 40)
    for column in range(40):
        want[:, column] = values[:, column].float() * scale[:, column // 16].float()
    assert torch.equal(got, want)
    with pytest.raises(CheckpointError, match=r"x\.weight_scale: scale of shape \(6, 2\) .*expected \(6, 3\)"):
        dequantize_packed("x", pack(values, 4), scale[:, :2], torch.tensor([6, 40]), spec)
    with pytest.raises(CheckpointError, match=r"x\.weight_packed has shape \(6, 5\), but x\.weight_shape \[6, 48\]"):
        dequantize_packed("x", pack(values, 4), scale, torch.tensor([6, 48]), spec)


@pytest.mark.skipif(not CT_HELPERS.exists(), reason="compressed-tensors is not unpacked at /tmp/ct")
@pytest.mark.parametrize("num_bits", [4, 8])
def test_the_librarys_own_packing_unpacks_to_the_same_values(num_bits):
    """compressed-tensors' ``pack_to_int32`` / ``unpack_from_int32`` (its helpers module alone, loaded from the
    file) against the test's packing and Tandem's unpacking."""
    module_spec = importlib.util.spec_from_file_location("ct_pack_helpers", CT_HELPERS)
    helpers = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(helpers)
    generator = torch.Generator().manual_seed(num_bits)
    low, high = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    for cols in (64, 40, 37):
        values = torch.randint(low, high + 1, (7, cols), generator=generator).to(torch.int8)
        theirs = helpers.pack_to_int32(values, num_bits)
        assert torch.equal(theirs, pack(values, num_bits))
        assert torch.equal(unpack_int32(theirs, num_bits, cols), values.to(torch.int32))
        assert torch.equal(helpers.unpack_from_int32(pack(values, num_bits), num_bits, torch.Size([7, cols])), values)


# --- loading -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", list(PACKED_SCHEMES))
def test_the_load_stream_gives_the_dequantized_weights_exactly(scheme, packed_checkpoint):
    quantized, reference = packed_checkpoint(scheme)
    spec = quantization_spec(json.loads((Path(quantized) / "config.json").read_text()))
    with safe_open(Path(quantized) / "model.safetensors", "pt") as handle:
        streamed = dict(QuantizationPlan(spec).tensors((name, handle.get_tensor(name)) for name in handle.keys()))
    want = load_file(Path(reference) / "model.safetensors")
    assert streamed.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(streamed[name].to(tensor.dtype), tensor), name


@pytest.mark.parametrize("scheme, family", [*((scheme, None) for scheme in PACKED_SCHEMES),
                                             ("w4a16_group32", "qwen3_moe"), ("w4a16_group32", "qwen3_moe_unnormed")])
def test_a_packed_checkpoint_runs_as_its_dequantized_model(scheme, family, packed_checkpoint,
                                                           moe_checkpoint):  # noqa: F811
    """``LLM(path)`` on the pack-quantized checkpoint against ``LLM`` on the float checkpoint of its exact
    dequantized weights (fp32): the same greedy tokens, logprobs within 1e-5, teacher-forced the same. Qwen3-MoE:
    per-expert packed weights, stacked once dequantized; ``qwen3_moe_unnormed``'s 80- and 24-wide inputs end in a
    partial group of 32."""
    quantized, reference = packed_checkpoint(scheme, None if family is None else moe_checkpoint(family))
    llm, oracle = LLM(quantized, **ENGINE), LLM(reference, **ENGINE)
    if family is None:
        assert linear_kinds(llm) == {"Linear"}  # dequantized at load
    prompts = sequences(3, 12, seed=1)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    for out, want in zip(llm.generate(prompts, params), oracle.generate(prompts, params)):
        assert out.token_ids == want.token_ids
        for entries, wanted in [*zip(out.logprobs, want.logprobs), *zip(out.prompt_logprobs[1:],
                                                                         want.prompt_logprobs[1:])]:
            assert entries.keys() == wanted.keys()
            assert max(abs(entries[token] - wanted[token]) for token in wanted) < 1e-5


def test_a_packed_checkpoint_in_bf16_and_quantized_to_int8_at_load(packed_checkpoint):
    """The dequantized weights take the model dtype (bf16: the reference's own bf16 rounding) and feed
    ``--quantization int8`` like any float weight."""
    quantized, reference = packed_checkpoint("w4a16_group32")
    prompt = sequences(1, 12, seed=2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    bf16 = {"model_config": {"dtype": "bfloat16"}}
    assert (LLM(quantized, **bf16, **ENGINE).generate(prompt, params)[0].token_ids
            == LLM(reference, **bf16, **ENGINE).generate(prompt, params)[0].token_ids)
    assert linear_kinds(LLM(quantized, model_config={"quantization": "int8"}, **ENGINE)) == {"Int8Linear"}


@pytest.mark.parametrize("scheme", list(PACKED_SCHEMES))
def test_against_the_float_model(scheme, packed_checkpoint, tiny_checkpoint, hf_reference):
    """Quantization's own error: teacher-forced against transformers running the float weights the checkpoint was
    quantized from (4 random 40-token sequences; measured: FLOAT_BOUNDS' comment)."""
    quantized, _ = packed_checkpoint(scheme)
    hf_model, _ = hf_reference(tiny_checkpoint("llama"))
    max_error, agreement = teacher_forced_errors(LLM(quantized, **ENGINE), hf_model, sequences())
    print(f"{scheme}: max logprob error {max_error:.4f}, top-1 agreement {agreement:.1%}")
    bound, min_agreement = FLOAT_BOUNDS[scheme]
    assert max_error < bound and agreement >= min_agreement, (max_error, agreement)


# --- what stays refused --------------------------------------------------------------------------------------------

def with_tensor(tensors: dict, name: str, tensor: torch.Tensor) -> dict:
    return {**tensors, name: tensor}


# case -> (config changes to group_0's weights / the group, a tensor to add beside o_proj's, the message)
O_PROJ = "model.layers.0.self_attn.o_proj"
REFUSALS = {
    "asymmetric": ({"symmetric": False}, None, None, r"pack-quantized asymmetric weights \(a weight_zero_point\)"),
    "weight_zero_point": ({}, None, ("weight_zero_point", torch.zeros(8, 2, dtype=torch.int32)),
                          rf"{O_PROJ}\.weight_zero_point: asymmetric quantization is not supported"),
    "actorder": ({"actorder": "group"}, None, None, r"actorder 'group' \(activation reordering: a weight_g_idx"),
    "weight_g_idx": ({}, None, ("weight_g_idx", torch.arange(64, dtype=torch.int32) // 32),
                     rf"{O_PROJ}\.weight_g_idx: activation reordering"),
    "num_bits": ({"num_bits": 2}, None, None, r"pack-quantized weights of 2-bit int are not supported"),
    "w4a8": ({}, {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
             None, r"pack-quantized with input_activations \(8-bit int activations, e\.g\. W4A8\)"),
    "strategy": ({"strategy": "tensor", "group_size": None}, None, None,
                 r"pack-quantized weights with strategy 'tensor' are not supported"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_stays_refused_is_named(case, packed_checkpoint, tmp_path):
    """By the launchers' torch-free check and by ``LLM(path)``, each with the name of what is unsupported."""
    weights, inputs, extra, message = REFUSALS[case]
    path = tmp_path / case
    shutil.copytree(packed_checkpoint("w4a16_group32")[0], path)
    config = packed_config("w4a16_group32")
    config["config_groups"]["group_0"]["weights"].update(weights)
    config["config_groups"]["group_0"]["input_activations"] = inputs
    set_quantization_config(path, config)
    if extra is not None:
        tensors = load_file(path / "model.safetensors")
        save_file(with_tensor(tensors, f"{O_PROJ}.{extra[0]}", extra[1]), path / "model.safetensors",
                  metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        launcher_check(str(path))
    with pytest.raises(CheckpointError, match=message):
        LLM(str(path), **ENGINE)


def test_tensor_parallelism_is_refused_before_any_rank_starts(packed_checkpoint):
    path = packed_checkpoint("w4a16_group32")[0]
    with pytest.raises(UnsupportedTensorParallel, match="tensor_parallel_size=2 is not supported for "
                                                        "compressed-tensors pack-quantized"):
        tensor_parallel_check(path, load_hf_config(path), 2, None)
    with pytest.raises(UnsupportedTensorParallel, match="pack-quantized"):
        LLM(path, tensor_parallel_size=2, **ENGINE)


# --- the torch-free check of the stored layout ---------------------------------------------------------------------

def test_the_stored_layout_is_checked_against_the_config():
    """Headers only (``weight_shape``'s two values read from the file): ``weight_packed`` int32 of
    ``[out, ceil(in * bits / 32)]``, ``weight_scale`` ``[out, ceil(in / group_size)]`` or ``[out, 1]``."""
    config = {"num_hidden_layers": 1, "quantization_config": packed_config("w4a16_group32")}
    q = "model.layers.0.self_attn.q_proj"
    good = {f"{q}.weight_packed": TensorHeader("I32", (64, 8)), f"{q}.weight_scale": TensorHeader("BF16", (64, 2)),
            f"{q}.weight_shape": TensorHeader("I64", (2,), (64, 64)), "lm_head.weight": TensorHeader("F32", (300, 64))}
    check_stored_weights(config, good)
    for change, message in [
        ({f"{q}.weight_packed": TensorHeader("I32", (64, 16))},
         rf"{q}\.weight_packed has shape \(64, 16\), but {q}\.weight_shape \[64, 64\] in the 4-bit .* \(64, 8\)"),
        ({f"{q}.weight_packed": TensorHeader("I8", (64, 8))}, rf"{q}\.weight_packed is stored as int8, but .*4-bit"),
        ({f"{q}.weight_scale": TensorHeader("BF16", (64, 1))},
         rf"{q}\.weight_scale: scale of shape \(64, 1\) .*'group' \(group_size 32\).*expected \(64, 2\)"),
        ({f"{q}.weight_shape": TensorHeader("I64", (2,), (64, 72))}, rf"{q}\.weight_packed has shape \(64, 8\)"),
        ({f"{q}.weight_shape": TensorHeader("I64", (3,), (1, 64, 64))}, rf"{q}\.weight_shape has shape \(3,\)"),
        ({f"{q}.weight_shape": None}, rf"has {q}\.weight_packed but no {q}\.weight_shape"),
        ({"model.layers.0.mlp.down_proj.weight": TensorHeader("F32", (64, 128))},
         r"down_proj\.weight is stored as float32, but .*pack-quantized\) declares 4-bit integers packed into int32"),
    ]:
        headers = {name: header for name, header in {**good, **change}.items() if header is not None}
        with pytest.raises(CheckpointError, match=message):
            check_stored_weights(config, headers)
    channel = {"num_hidden_layers": 1, "quantization_config": packed_config("w8a16_channel")}
    check_stored_weights(channel, {**good, f"{q}.weight_packed": TensorHeader("I32", (64, 16)),
                                   f"{q}.weight_scale": TensorHeader("BF16", (64, 1))})
    int8_config = {"num_hidden_layers": 1, "quantization_config": compressed_tensors_config(
        "naive-quantized", weight_args(8, "channel", None), None)}
    with pytest.raises(CheckpointError, match=rf"{q}\.weight_packed: a pack-quantized weight, but .*naive-quantized"):
        check_stored_weights(int8_config, good)


def test_a_weight_shape_the_packed_words_do_not_hold_is_refused_from_the_file(packed_checkpoint, tmp_path):
    """``weight_shape``'s values, read from the safetensors file without torch, against ``weight_packed``."""
    path = tmp_path / "bad-shape"
    shutil.copytree(packed_checkpoint("w4a16_group32")[0], path)
    check_quantized_checkpoint(path)
    tensors = load_file(path / "model.safetensors")
    tensors[f"{O_PROJ}.weight_shape"] = torch.tensor([64, 72])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{O_PROJ}\.weight_packed has shape \(64, 8\), but "
                                              rf"{O_PROJ}\.weight_shape \[64, 72\]"):
        check_quantized_checkpoint(path)


def test_a_missing_scale_is_named(packed_checkpoint, tmp_path):
    path = tmp_path / "no-scale"
    shutil.copytree(packed_checkpoint("w8a16_channel")[0], path)
    tensors = load_file(path / "model.safetensors")
    del tensors[f"{O_PROJ}.weight_scale"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"has {O_PROJ}\.weight_packed, {O_PROJ}\.weight_shape but no "
                                              rf"{O_PROJ}\.weight_scale"):
        LLM(str(path), **ENGINE)
