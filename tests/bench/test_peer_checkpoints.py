"""The peer benchmark's locally built checkpoints (a tiny stand-in for the 1.1B / 3B shapes, several shards), their
W8A8 twin, the bytes a decode step reads, the bandwidth bound's arithmetic and the --configs parsing."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench import memory_bandwidth, peer_checkpoints, peer_decode
from bench.peer_offline import parse_configs

TINY = dict(vocab_size=700, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer-ckpt")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(peer_checkpoints.LARGE_SHAPES, "tiny", TINY)
        patch.setattr(peer_checkpoints, "SHARD_BYTES", 40_000)  # several shards
        bf16 = peer_checkpoints.build_random_checkpoint(root / "bf16", "tiny")
        int8 = peer_checkpoints.write_w8a8(bf16, root / "w8a8")
    return bf16, int8


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            out |= {name: handle.get_tensor(name) for name in handle.keys()}
    return out


def test_random_checkpoint_is_sharded_full_vocabulary_and_never_ends(checkpoints):
    bf16, _ = checkpoints
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in bf16.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    assert len(AutoTokenizer.from_pretrained(bf16)) == TINY["vocab_size"]
    model = AutoModelForCausalLM.from_pretrained(bf16, torch_dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    assert model.config.num_hidden_layers == 2 and torch.count_nonzero(model.lm_head.weight[eos]) == 0
    with torch.no_grad():
        logits = model(torch.tensor([[1, 40, 300, 699]])).logits
    assert (logits[..., eos] == 0).all() and (logits.max(-1).values > 0).all()


def test_w8a8_twin_is_compressed_tensors_per_channel_and_close_to_the_weights(checkpoints):
    bf16, int8 = checkpoints
    config = json.loads((int8 / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    assert config["format"] == "int-quantized" and config["ignore"] == ["lm_head"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"
    floats, quantized = _tensors(bf16), _tensors(int8)
    weight = floats["model.layers.1.mlp.down_proj.weight"].float()
    values, scale = quantized["model.layers.1.mlp.down_proj.weight"], quantized["model.layers.1.mlp.down_proj.weight_scale"]
    assert values.dtype == torch.int8 and scale.shape == (weight.shape[0], 1)
    assert (values.float() * scale.float() - weight).abs().max() <= scale.float().max() * 0.51
    assert quantized["lm_head.weight"].dtype == torch.bfloat16


def test_tandem_runs_the_w8a8_twin_close_to_the_bf16_model(checkpoints):
    from pipeline import LLM, SamplingParams

    bf16, int8 = checkpoints
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt = [[1, 40, 300, 699, 12, 7]]
    outs = [LLM(model=str(path), model_config={"dtype": "bfloat16"}).generate(prompt, params)[0] for path in (bf16, int8)]
    assert all(len(o.token_ids) == 1 for o in outs)


def test_weight_bytes_per_token_reads_one_embedding_row_and_int8_at_one_byte(checkpoints):
    bf16, int8 = checkpoints
    h, i, v, kv = 64, 96, 700, 32
    per_layer = (h * h * 2 + kv * h * 2) + 3 * h * i
    expected_float = 2 * (2 * per_layer + 2 * 2 * h + h + h + v * h)  # layers, norms, final norm, one row, head
    assert peer_checkpoints.weight_bytes_per_token(bf16, torch.bfloat16) == expected_float
    scales = 2 * 2 * (h + kv + kv + h + i + i + h)  # bf16 [out, 1] per linear
    expected_int8 = 2 * per_layer + scales + 2 * (2 * 2 * h + h + h + v * h)
    assert peer_checkpoints.weight_bytes_per_token(int8, torch.bfloat16) == expected_int8


@pytest.mark.parametrize("architecture, experts_key", [("gpt_oss", "num_local_experts"), ("qwen3_moe", "num_experts"),
                                                       ("deepseek_v3", "n_routed_experts")])
def test_weight_bytes_per_token_reads_a_mixture_of_experts_k_of_its_experts(tmp_path, architecture, experts_key):
    """A batch-1 token reads its top-k experts, not all of them: gpt-oss's stacked expert tensors and Qwen3-MoE's and
    DeepSeek's per-expert ones count k / E of their bytes; the router, DeepSeek's shared experts and everything else
    count whole."""
    from pipeline.builtin_model import build_checkpoint

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, tie_word_embeddings=False)
    shape[experts_key] = 8
    if architecture in ("qwen3_moe", "deepseek_v3"):
        shape["moe_intermediate_size"] = 32
    if architecture == "deepseek_v3":
        shape.update(first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, n_shared_experts=1)
    path = build_checkpoint(tmp_path / architecture, architecture, **shape)
    expert_bytes = other_bytes = 0
    for name, tensor in _tensors(path).items():
        numel = tensor.shape[1] if name == "model.embed_tokens.weight" else tensor.numel()
        if ".mlp.experts." in name:
            expert_bytes += 2 * numel
        else:
            other_bytes += 2 * numel
    assert expert_bytes > 0 and other_bytes > 0
    assert peer_checkpoints.weight_bytes_per_token(path, torch.bfloat16) == pytest.approx(
        other_bytes + expert_bytes * 2 / 8, abs=8)


def test_bound_is_bytes_over_bandwidth():
    decode = {"median_step_ms": {"tandem": 50.0, "vllm": 100.0}}
    bandwidth = {"copy": {"median_gb_s": 20.0}, "read": {"median_gb_s": 40.0}}
    out = peer_decode.against_bound(decode, 2 * 10**9, bandwidth)
    assert out["bound_ms_at_copy"] == pytest.approx(100.0) and out["bound_ms_at_read"] == pytest.approx(50.0)
    assert out["fraction_of_copy_bound"] == pytest.approx({"tandem": 2.0, "vllm": 1.0})
    assert out["fraction_of_read_bound"] == pytest.approx({"tandem": 1.0, "vllm": 0.5})


def test_bandwidth_reports_every_kernel_and_repeat():
    report = memory_bandwidth.measure(threads=1, size_mib=8, repeats=3)
    for kind in ("copy", "triad", "read"):
        assert len(report[kind]["gb_s"]) == 3 and report[kind]["median_gb_s"] > 0


def test_configs_from_the_command_line():
    args = argparse.Namespace(configs="1.1b:int8:2,small:float32:1", model_size="small", dtypes="x", threads="1")
    assert parse_configs(args) == [("1.1b", "int8", 2), ("small", "float32", 1)]
    args = argparse.Namespace(configs=None, model_size="small,1.1b", dtypes="bfloat16,int8", threads="1,2")
    assert len(parse_configs(args)) == 8 and parse_configs(args)[0] == ("small", "bfloat16", 1)


def test_decode_step_is_the_difference_of_two_runs_over_the_tokens(monkeypatch, tmp_path):
    class FakeRunner:
        def __init__(self, step_s):
            self.step_s = step_s

        def run(self, workload):
            max_tokens = json.loads(workload.read_text())["max_tokens"][0]
            return {"wall_s": 0.5 + (max_tokens - 1) * self.step_s}

    monkeypatch.setattr(memory_bandwidth, "measure", lambda threads, repeats: {
        "copy": {"median_gb_s": 10.0}, "read": {"median_gb_s": 12.0}})
    paths = peer_decode.write_workloads(tmp_path, 100, {0, 1, 2}, prompt_len=8, num_tokens=4, seed=0)
    out = peer_decode.measure({"tandem": FakeRunner(0.02), "vllm": FakeRunner(0.04)}, paths, 4, repeats=3, threads=1)
    assert out["median_step_ms"] == pytest.approx({"tandem": 20.0, "vllm": 40.0})
    assert out["bandwidth_during"]["copy"]["per_repeat_gb_s"] == [10.0] * 3


def test_cpu_seconds_counts_a_busy_child_process():
    import subprocess
    import sys
    import time

    from bench.peer_offline import _cpu_seconds

    # busy until killed, and read until it has run 0.1 CPU-s: on a loaded machine (the suite's other workers) a
    # fixed wall-clock wait gave it less than that
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 60
        while _cpu_seconds(child.pid) <= 0.1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _cpu_seconds(os.getpid()) - _cpu_seconds(child.pid) >= 0 and _cpu_seconds(child.pid) > 0.1
    finally:
        child.kill()
        child.wait()


def test_peak_rss_counts_a_child_process_memory():
    import subprocess
    import sys
    import time

    from bench.peer_offline import _peak_rss_gib

    # a child that touches 200 MiB and waits: its peak is counted under this process, and not ours under its
    child = subprocess.Popen([sys.executable, "-c", "import time\nb = bytearray(200 << 20)\nprint(flush=True)\n"
                              "time.sleep(5)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        time.sleep(0.1)
        assert _peak_rss_gib(child.pid) >= 200 / 1024
        assert _peak_rss_gib(os.getpid()) - _peak_rss_gib(child.pid) > 0
    finally:
        child.kill()
        child.wait()
