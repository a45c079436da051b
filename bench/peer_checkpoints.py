"""Real-model-sized random checkpoints for the peer benchmark, built locally (no model hub), and their int8 W8A8 twin.

- ``build_random_checkpoint``: a Llama of one of ``LARGE_SHAPES`` (TinyLlama-1.1B's, Llama-3.2-3B's or
  Llama-3.1-8B's shape), random bf16 weights written tensor group by tensor group into ~2 GiB safetensors shards
  with their index (the whole model is never in memory, so the 3B shape builds in a few GiB), a byte-level BPE
  tokenizer trained to the model's full vocabulary (every id decodes, so both engines detokenize as they would a
  real model), and the EOS rows of the output projection zeroed (``bench/peer_transformers.make_eos_unreachable``'s reason).
- ``write_w8a8``: the same model as a compressed-tensors ``int-quantized`` checkpoint as llm-compressor's W8A8
  preset writes it (int8 decoder linears, ``weight_scale`` ``[out, 1]`` per output channel in the model dtype,
  activations dynamic per token, ``lm_head`` ignored), which Tandem and vLLM's CPU build both load.
- ``weight_bytes_per_token``: the bytes a batch-1 decode step must read (every weight once, the embedding
  table one row, a mixture of experts' k of its experts): the numerator of the memory-bandwidth bound.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

LARGE_SHAPES: dict[str, dict] = {
    "1.1b": dict(  # TinyLlama-1.1B
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False),
    "3b": dict(  # Llama-3.2-3B (no llama3 rope scaling: positions stay under 2048 here)
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    "8b": dict(  # Llama-3.1-8B (16 GB in bf16: its two engines do not fit a 24 GiB machine at once)
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
}
# Other architectures' shapes, built with transformers' own classes (small enough to build in memory): a Qwen3-MoE
# with 32 experts, top-8 renormalised, on every layer (the "32+ experts, top-8"), and Gemma-3-1B's shape
# (five sliding-window layers of 512 to each global one; a 2,048-token vocabulary instead of 262,144)
BUILT_SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-moe": ("qwen3_moe", dict(
        tokenizer_vocab_size=2048, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384,
        num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_experts=32,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=2048, initializer_range=0.05)),
    "gemma3-1b": ("gemma3", dict(
        tokenizer_vocab_size=2048, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512, sliding_window_pattern=6,
        query_pre_attn_scalar=256, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        max_position_embeddings=4096, initializer_range=0.02)),
    # four of gpt-oss-20b's 24 layers as they are: sliding (128) and full layers alternating, 64 query / 8 KV heads
    # of 64 with sinks, 32 biased experts of 2880 (top 4) with the clamped SwiGLU
    "gpt-oss-20b-4l": ("gpt_oss", dict(
        tokenizer_vocab_size=2048, hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, max_position_embeddings=4096, initializer_range=0.02)),
    # DeepSeek-V2-Lite's size in DeepSeek-V3's architecture, four layers (one dense, three MoE): latent attention
    # (16 heads; kv_lora_rank 512 + rope 64 cached; nope 128, v 128; no q LoRA), 64 routed experts of 1408 (top 6,
    # sigmoid routing) and 2 shared
    "deepseek-v2-lite-4l": ("deepseek_v3", dict(
        tokenizer_vocab_size=2048, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1, n_shared_experts=2,
        routed_scaling_factor=1.0, norm_topk_prob=False, max_position_embeddings=4096, initializer_range=0.02,
        topk_method="noaux_tc", scoring_func="sigmoid")),  # as DeepSeek-V3's config.json states them (vLLM reads them)
}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARD_BYTES = 2 << 30
INIT_STD = 0.02


def _tokenizer(vocab_size: int):
    """A BPE tokenizer trained on random words until it has exactly ``vocab_size`` entries."""
    from pipeline.builtin_model import build_tokenizer

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    num_words = max(100_000, vocab_size * 3)
    corpus = [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(3, 12))) for _ in range(1000))
              for _ in range(num_words // 1000)]
    tokenizer = build_tokenizer(vocab_size, corpus)
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tokenizer reached {len(tokenizer)} entries, not {vocab_size}")
    return tokenizer


def _tensor_groups(shape: dict, generator: torch.Generator):
    """(name, bf16 tensor) of the whole model, embedding first, one layer at a time."""
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim

    def normal(*size):
        return torch.empty(*size).normal_(0.0, INIT_STD, generator=generator).to(torch.bfloat16)

    yield "model.embed_tokens.weight", normal(vocab, hidden)
    for i in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        yield f"{prefix}.input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)
        yield f"{prefix}.post_attention_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)
        for name, size in (("q_proj", (hidden, hidden)), ("k_proj", (kv, hidden)), ("v_proj", (kv, hidden)),
                           ("o_proj", (hidden, hidden))):
            yield f"{prefix}.self_attn.{name}.weight", normal(*size)
        for name, size in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            yield f"{prefix}.mlp.{name}.weight", normal(*size)
    yield "model.norm.weight", torch.ones(hidden, dtype=torch.bfloat16)
    if not shape["tie_word_embeddings"]:
        yield "lm_head.weight", normal(vocab, hidden)


def _write_shards(path: Path, tensors, transform=lambda name, t: {name: t}) -> None:
    """Stream ``(name, tensor)`` into ``model-XXXXX-of-YYYYY.safetensors`` shards plus the index."""
    from safetensors.torch import save_file

    files: list[str] = []

    def flush(shard: dict) -> dict:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        files.append(name)
        return {k: name for k in shard}

    weight_map: dict[str, str] = {}
    shard: dict = {}  # only the shard being filled is held: a written one is let go
    shard_bytes = total_bytes = 0
    for name, tensor in tensors:
        for out_name, out in transform(name, tensor).items():
            if shard_bytes and shard_bytes + out.nbytes > SHARD_BYTES:
                weight_map |= flush(shard)
                shard, shard_bytes = {}, 0
            shard[out_name] = out
            shard_bytes += out.nbytes
            total_bytes += out.nbytes
    weight_map |= flush(shard)
    total = len(files)
    for i, name in enumerate(files):  # the names count the shards, known only at the end
        final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        os.replace(path / name, path / final)
        weight_map = {k: (final if v == name else v) for k, v in weight_map.items()}
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_random_checkpoint(path: Path, size: str, seed: int = 0) -> Path:
    """Write the random bf16 Llama of ``LARGE_SHAPES[size]`` to ``path`` (atomically); returns ``path``."""
    import transformers

    shape = LARGE_SHAPES[size]
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tokenizer = _tokenizer(shape["vocab_size"])
    tokenizer.save_pretrained(staging)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=None, torch_dtype="bfloat16",
                                      architectures=["LlamaForCausalLM"])
    config.save_pretrained(staging)
    head = "model.embed_tokens.weight" if shape["tie_word_embeddings"] else "lm_head.weight"

    def zero_eos(name: str, tensor: torch.Tensor) -> dict:
        if name == head:
            tensor[tokenizer.eos_token_id] = 0  # EOS logit exactly 0: greedy never ends a request early
        return {name: tensor}

    _write_shards(staging, _tensor_groups(shape, torch.Generator().manual_seed(seed)), zero_eos)
    staging.rename(path)
    return path


def _w8a8_config() -> dict:
    def args(strategy: str, dynamic: bool) -> dict:
        return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": None if dynamic else "minmax",
                "observer_kwargs": {}}

    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args("channel", False),
                                          "input_activations": args("token", True), "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {}}


def write_w8a8(source: Path, path: Path) -> Path:
    """``source`` (a sharded float checkpoint) as compressed-tensors W8A8 at ``path`` (atomically)."""
    from safetensors import safe_open

    from pipeline.quantization.int8 import quantize_per_row, quantize_with_scale

    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    files = sorted(source.glob("*.safetensors"))

    def tensors():
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

    def quantize(name: str, tensor: torch.Tensor) -> dict:
        module = name.rpartition(".")[0]
        if not (name.endswith(".weight") and module.endswith(LINEAR_NAMES)):
            return {name: tensor}
        _, scale = quantize_per_row(tensor.float())  # fp32 [out, 1]
        scale = scale.to(tensor.dtype)  # stored in the model dtype: quantize with the scale as stored
        return {name: quantize_with_scale(tensor.float(), scale.float()), f"{module}.weight_scale": scale}

    _write_shards(staging, tensors(), quantize)
    config = json.loads((staging / "config.json").read_text())
    config["quantization_config"] = _w8a8_config()
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(path)
    return path


def weight_bytes_per_token(checkpoint: Path, dtype: torch.dtype) -> int:
    """Bytes of weights one batch-1 decode step reads, run in ``dtype`` (int8 tensors stay one byte each):
    every tensor once, except the input embedding table, of which one row is read (unless it is the tied head),
    and a mixture of experts' expert tensors, of which the token's ``num_experts_per_tok`` are read."""
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    num_experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    expert_share = config.get("num_experts_per_tok", num_experts) / num_experts if num_experts else 1.0
    total = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                info = handle.get_slice(name)
                numel = 1
                for n in info.get_shape():
                    numel *= n
                if name == "model.embed_tokens.weight" and not tied:
                    numel = info.get_shape()[1]
                width = 1 if info.get_dtype() in ("I8", "U8") else dtype.itemsize
                share = expert_share if ".mlp.experts." in name else 1.0
                total += round(numel * width * share)
    return total


def peer_checkpoint(size: str, is_int8: bool = False) -> Path:
    """The benchmark's checkpoint of ``size`` (built once, cached under ``$TANDEM_HOME``): ``small`` / ``medium``
    as ``bench/serve_compare.benchmark_checkpoint`` builds them, ``1.1b`` / ``3b`` / ``8b`` and ``BUILT_SHAPES``
    (``qwen3-moe``, ``gemma3-1b``, ``gpt-oss-20b-4l``, ``deepseek-v2-lite-4l``) here; ``is_int8``: its W8A8 twin."""
    home = Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))
    if size in BUILT_SHAPES:
        float_path = home / f"bench-{size}-no-eos"
        if not (float_path / "config.json").is_file():
            from bench.peer_transformers import make_eos_unreachable
            from pipeline.builtin_model import build_checkpoint

            staging = float_path.with_name(float_path.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            architecture, settings = BUILT_SHAPES[size]
            build_checkpoint(staging, architecture, **settings)
            make_eos_unreachable(staging)
            staging.rename(float_path)
    elif size not in LARGE_SHAPES:
        from bench.serve_compare import benchmark_checkpoint

        float_path = benchmark_checkpoint(size)
    else:
        float_path = home / f"bench-{size}-bf16-no-eos"
        if not (float_path / "config.json").is_file():
            build_random_checkpoint(float_path, size)
    if not is_int8:
        return float_path
    int8_path = float_path.with_name(float_path.name + "-w8a8")
    if not (int8_path / "config.json").is_file():
        write_w8a8(float_path, int8_path)
    return int8_path
