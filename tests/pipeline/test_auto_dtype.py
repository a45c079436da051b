"""``model.dtype: auto`` runs a checkpoint in the dtype its config.json states, as a user who downloads a bf16
checkpoint expects (vLLM's ``--dtype auto`` does the same): bf16 and fp16 checkpoints in bf16 on the CPU, fp32
checkpoints (the tests' tiny models, the built-in one) in fp32, bf16 on a GPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline.checkpoint_files import stated_dtype
from pipeline.config_sections import ModelConfig
from tests.quantized_checkpoints import quantized_checkpoint  # noqa: F401 (a fixture)

ENGINE = dict(kv_cache={"page_size": 4, "num_blocks": 64}, max_batch_size=4)
PROMPTS = [[5, 17, 99, 4, 250, 31, 8], [7, 7, 120, 64, 3]]


@pytest.mark.parametrize(("config", "expected"), [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),  # older transformers' key
    ({"torch_dtype": "torch.float32"}, "float32"),
    ({"text_config": {"dtype": "bfloat16"}}, "bfloat16"),  # a multimodal wrapper's text model
    ({"model_type": "llama"}, None),
])
def test_the_dtype_a_config_states(config, expected):
    assert stated_dtype(config) == expected


@pytest.mark.parametrize(("checkpoint", "device", "expected"), [
    ("bfloat16", "cpu", "bfloat16"), ("float16", "cpu", "bfloat16"), ("float32", "cpu", "float32"),
    (None, "cpu", "float32"), ("float32", "cuda", "bfloat16"), ("float16", "cuda", "bfloat16"),
])
def test_auto_follows_the_checkpoint_on_the_cpu(checkpoint, device, expected):
    assert ModelConfig(device=device).resolved_dtype(checkpoint) == expected
    assert ModelConfig(device=device, dtype="float32").resolved_dtype(checkpoint) == "float32"  # asked for: kept


def state_dtype(source: str | Path, target: Path, dtype: str) -> Path:
    """A copy of the checkpoint at ``source`` whose config.json states ``dtype`` (weights as they were)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = dtype
    (target / "config.json").write_text(json.dumps(config))
    return target


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("stated", ["bfloat16", "float16"])
def test_a_half_precision_checkpoint_runs_in_bf16_unless_asked_otherwise(tmp_path, tiny_checkpoint, stated):
    path = state_dtype(tiny_checkpoint("llama"), tmp_path / "half", stated)
    auto = LLM(str(path), **ENGINE)
    assert auto.engine.dtype == torch.bfloat16 and auto.engine.kv_cache.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in auto.engine.model.parameters())
    assert greedy(auto) == greedy(LLM(str(path), model_config={"dtype": "bfloat16"}, **ENGINE))
    assert LLM(str(path), model_config={"dtype": "float32"}, **ENGINE).engine.dtype == torch.float32


def test_an_fp32_checkpoint_stays_fp32(tiny_checkpoint):
    config = json.loads((Path(tiny_checkpoint("llama")) / "config.json").read_text())
    assert stated_dtype(config) == "float32"  # the tests' checkpoints, hence their token-exact fp32 checks
    assert LLM(tiny_checkpoint("llama"), **ENGINE).engine.dtype == torch.float32


def test_a_w8a8_checkpoint_stated_bf16_runs_bf16_activations(tmp_path, tiny_checkpoint, quantized_checkpoint):
    """As llm-compressor writes them: int8 weights, config.json's dtype bfloat16 for everything else."""
    quantized, _ = quantized_checkpoint("w8a8_int8_channel", tiny_checkpoint("llama"))
    path = state_dtype(quantized, tmp_path / "w8a8", "bfloat16")
    auto = LLM(str(path), **ENGINE)
    assert auto.engine.dtype == torch.bfloat16
    assert type(auto.engine.model.model.layers[0].mlp.down_proj).__name__ == "Int8Linear"
    assert greedy(auto) == greedy(LLM(str(path), model_config={"dtype": "bfloat16"}, **ENGINE))
