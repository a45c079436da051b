"""Which slice of each checkpoint tensor a tensor-parallel rank holds, and the rank's own view of the config.

Megatron's layout for the Llama family: q/k/v and gate/up are split by output rows (q heads, kv heads,
intermediate columns), o_proj and down_proj by input columns (their outputs are summed by an
all-reduce), the embedding and the LM head by vocabulary rows (padded to a multiple of the TP size).
When there are fewer KV heads than ranks, each rank keeps the one KV head its q heads read; gpt-oss's
attention sinks go with their q heads. The mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss) split
every expert the same way, by its own intermediate dimension (vLLM's default for TP: each rank holds a
slice of every expert), and replicate the router. Norms are replicated. ``read_shards`` reads only a
rank's slice from the safetensors files.

Quantized checkpoints (int8 W8A8, fp8) are cut the same way, each weight's scale with it: a per-tensor scale (and
a static ``input_scale``) whole on every rank, a per-output-channel scale by the rows of its weight (whole where
the weight is cut by input columns), a per-block scale by the blocks of its weight's cut, which must fall on block
boundaries (``check_supported`` refuses a size whose cuts do not). The quantized layers then load as in a
single-process model (``pipeline/quantization/loading.py``).
compressed-tensors ``pack-quantized`` checkpoints (W4A16, W8A16) are refused at any size > 1 (``check_supported``).
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from pipeline.checkpoint_files import read_config_json
from pipeline.quantization.config import quantization_spec
from pipeline.quantization.loading import SCALE_LEAVES, UNUSED_LEAVES
from pipeline.quantization.mxfp4 import GROUP_SIZE as MXFP4_GROUP_SIZE
from pipeline.weights import open_weight_files

# The architectures tensor parallelism runs: the Llama family (pipeline/models/llama.py) and its MoE kin
# (pipeline/models/llama_moe.py, pipeline/models/gpt_oss.py).
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
LATENT_ARCHITECTURES = ("DeepseekV3ForCausalLM",)  # multi-head latent attention (pipeline/models/deepseek_v3.py)
TENSOR_PARALLEL_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES + LATENT_ARCHITECTURES


# a quantized layer's activation scales and zero point: one value per tensor, whole on every rank
PER_TENSOR_LEAVES = (*UNUSED_LEAVES, "input_zero_point")


class TensorParallelError(RuntimeError):
    """A tensor-parallel setup Tandem cannot run, or a rank that failed, died or stopped answering."""


class UnsupportedTensorParallel(TensorParallelError, ValueError):
    """A setup tensor parallelism cannot run (the checkpoint, the size, the mode): the user's to change, refused
    before any rank starts (a ``ValueError``: the CLI prints its message, not a traceback)."""


def check_supported(hf_config, tensor_parallel_size: int, quantization: str | None, config_json: dict) -> None:
    """Raise ``TensorParallelError`` naming what ``tensor_parallel_size`` > 1 cannot run for this checkpoint."""
    tp = tensor_parallel_size
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not any(name in TENSOR_PARALLEL_ARCHITECTURES for name in architectures):
        raise UnsupportedTensorParallel(
            f"tensor_parallel_size={tp} is not supported for architecture {', '.join(architectures) or '(none)'}; "
            f"tensor parallelism runs {', '.join(TENSOR_PARALLEL_ARCHITECTURES)} (see docs/tensor-parallel.md)")
    quantized = quantization_spec(config_json)
    if quantized is not None and quantized.packed:
        raise UnsupportedTensorParallel(
            f"tensor_parallel_size={tp} is not supported for compressed-tensors pack-quantized checkpoints (W4A16, "
            "W8A16): their int32 words are not cut per rank; run them with tensor_parallel_size=1")
    if quantized is not None and quantized.weight_type == "mxfp4":
        per_rank = hf_config.intermediate_size // tp
        if hf_config.intermediate_size % tp or per_rank % MXFP4_GROUP_SIZE:
            raise UnsupportedTensorParallel(
                f"tensor_parallel_size={tp} splits each MXFP4 expert's intermediate_size={hf_config.intermediate_size} "
                f"into {hf_config.intermediate_size / tp:g} columns a rank, not whole {MXFP4_GROUP_SIZE}-value blocks "
                "(gpt-oss-20b and -120b, intermediate_size 2880: tensor_parallel_size 2)")
    num_heads = hf_config.num_attention_heads
    num_kv_heads = ShardSpec.of(hf_config, 0, tp).num_kv_heads
    if num_heads % tp:
        raise UnsupportedTensorParallel(
            f"tensor_parallel_size={tp} must divide num_attention_heads={num_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise UnsupportedTensorParallel(
            f"tensor_parallel_size={tp} and num_key_value_heads={num_kv_heads}: one must divide the other")
    for field, size in split_mlp_sizes(hf_config).items():
        if size % tp:
            raise UnsupportedTensorParallel(f"tensor_parallel_size={tp} must divide {field}={size}")
    if quantized is not None and quantized.block_size is not None:
        _check_block_cuts(hf_config, tp, quantized.block_size)


def _check_block_cuts(hf_config, tp: int, block: tuple[int, int]) -> None:
    """Every rank's cut of every split weight falls on the checkpoint's scale blocks (else ``TensorParallelError``
    from ``ShardSpec.slice_of``, naming the tensor, the cut and the block)."""
    for rank in range(tp):
        spec = ShardSpec.of(hf_config, rank, tp, scale_block=block)
        attention = ("q_proj", "q_b_proj", "kv_b_proj", "o_proj") if spec.latent else ("q_proj", "k_proj", "v_proj",
                                                                                      "o_proj")
        names = [f"self_attn.{projection}" for projection in attention]
        names += [f"mlp.{projection}" for projection in ("gate_proj", "up_proj", "down_proj")]
        names += [f"mlp.experts.0.{projection}" for projection in spec.expert_projections]
        if spec.shared_expert_intermediate_size:
            names += [f"mlp.shared_experts.{projection}" for projection in ("gate_proj", "up_proj", "down_proj")]
        for name in names:
            spec.slice_of(f"model.layers.0.{name}.weight_scale", scale_shape=None)


def split_mlp_sizes(hf_config) -> dict[str, int]:
    """The config fields of the intermediate dimensions the ranks split (the dense MLP's, the experts'), as used."""
    if hf_config.model_type == "deepseek_v3":  # routed and shared experts by moe_intermediate_size; dense layers
        sizes = {"moe_intermediate_size": hf_config.moe_intermediate_size}
        if hf_config.first_k_dense_replace > 0:
            sizes["intermediate_size"] = hf_config.intermediate_size
        return sizes
    if hf_config.model_type not in ("qwen3_moe", "mixtral"):  # dense, or gpt-oss (its experts' size)
        return {"intermediate_size": hf_config.intermediate_size}
    from pipeline.models.llama_moe import is_sparse_layer

    sizes = {"moe_intermediate_size" if hf_config.model_type == "qwen3_moe" else "intermediate_size":
             _expert_layout(hf_config)[0]}
    if not all(is_sparse_layer(hf_config, index) for index in range(hf_config.num_hidden_layers)):
        sizes["intermediate_size"] = hf_config.intermediate_size  # Qwen3-MoE's dense layers
    return sizes


def _expert_layout(hf_config) -> tuple[int, tuple[str, ...]]:
    """(each expert's intermediate size, the checkpoint's gate/up/down names per expert: () for gpt-oss, whose
    experts are stored stacked only); (0, ()) without experts."""
    if hf_config.model_type == "gpt_oss":
        return hf_config.intermediate_size, ()
    if hf_config.model_type == "deepseek_v3":
        from pipeline.models.deepseek_moe import deepseek_moe_spec

        spec = deepseek_moe_spec(hf_config)
        return spec.intermediate_size, spec.projection_names
    if hf_config.model_type not in ("qwen3_moe", "mixtral"):
        return 0, ()
    from pipeline.models.llama_moe import moe_spec

    spec = moe_spec(hf_config)
    return spec.intermediate_size, spec.projection_names


@dataclass(frozen=True)
class Cut:
    """The part of one checkpoint tensor a rank holds: ``ranges`` ((start, length) blocks along ``dim``,
    concatenated), zero-padded to ``padded`` along ``dim``; ``is_zero``: zeros of the whole shape instead."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    padded: int
    is_zero: bool = False


# A row-parallel bias on ranks other than 0: zeros there, so the all-reduce adds it once.
ZERO = Cut(0, (), 0, is_zero=True)


@dataclass(frozen=True)
class LatentHeads:
    """Multi-head latent attention's rows per head (DeepSeek-V3), by which its projections are split: ``q_b_proj``
    (or ``q_proj``) and ``kv_b_proj`` by their heads' rows, ``o_proj`` by their heads' input columns. The latent
    projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and the latent cache are whole on every rank."""

    q_rows: int  # qk_nope_head_dim + qk_rope_head_dim
    kv_b_rows: int  # qk_nope_head_dim + v_head_dim
    o_columns: int  # v_head_dim

    @classmethod
    def of(cls, hf_config) -> "LatentHeads | None":
        if getattr(hf_config, "kv_lora_rank", None) is None:
            return None
        nope, rope, v = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim, hf_config.v_head_dim
        return cls(nope + rope, nope + v, v)


@dataclass(frozen=True)
class ShardSpec:
    """Rank ``rank`` of ``size``: the row/column ranges it holds of each kind of tensor."""

    rank: int
    size: int
    num_heads: int  # q heads in the whole model
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's
    vocab_size: int  # the checkpoint's (unpadded)
    expert_intermediate_size: int = 0  # each expert's; 0: no experts
    expert_projections: tuple[str, ...] = ()  # the checkpoint's gate, up and down names per expert; () gpt-oss's
    scale_block: tuple[int, int] | None = None  # a block-quantized checkpoint's (rows, columns) per weight scale
    shared_expert_intermediate_size: int = 0  # DeepSeek's always-on shared experts (one MLP); 0: none
    latent: LatentHeads | None = None  # multi-head latent attention's rows per head; None: Llama's attention

    @classmethod
    def of(cls, hf_config, rank: int, size: int, scale_block: tuple[int, int] | None = None) -> "ShardSpec":
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        latent = LatentHeads.of(hf_config)
        # latent attention caches one latent row per token, which every rank holds whole: one KV "head"
        num_kv_heads = 1 if latent is not None else hf_config.num_key_value_heads or num_heads
        shared = getattr(hf_config, "n_shared_experts", None) or 0
        return cls(rank, size, num_heads, num_kv_heads, head_dim, hf_config.intermediate_size, hf_config.vocab_size,
                   *_expert_layout(hf_config), scale_block=scale_block,
                   shared_expert_intermediate_size=shared * (getattr(hf_config, "moe_intermediate_size", 0) or 0),
                   latent=latent)

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """The rank's first KV head: its own block, or (fewer KV heads than ranks) the one its q heads share."""
        if self.num_kv_heads >= self.size:
            return self.rank * self.num_local_kv_heads
        return self.rank * self.num_kv_heads // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    def rank_config(self, hf_config):
        """A copy of ``hf_config`` with this rank's counts, so the unchanged model classes build a shard."""
        local = copy.deepcopy(hf_config)
        local.num_attention_heads = self.num_local_heads
        local.num_key_value_heads = self.num_local_kv_heads
        local.head_dim = self.head_dim
        local.intermediate_size = self.intermediate_size // self.size  # Mixtral: the experts' too
        if hasattr(local, "moe_intermediate_size"):  # Qwen3-MoE's experts
            local.moe_intermediate_size = self.expert_intermediate_size // self.size
        local.vocab_size = self.vocab_per_rank
        return local

    def slice_of(self, name: str, scale_shape: tuple[int, ...] | None = None) -> Cut | None:
        """The part of checkpoint tensor ``name`` this rank holds; None = all of it. ``scale_shape``: the stored
        shape of a quantized weight's scale (``name`` a ``weight_scale``; None: only check its cut)."""
        parts = name.split(".")
        module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
        if leaf in PER_TENSOR_LEAVES:
            return None
        if leaf in SCALE_LEAVES or leaf == "weight_zero_point":
            return self._scale_slice(name, scale_shape)
        if "experts" in parts and self.expert_intermediate_size:
            return self._expert_slice(module, leaf) if self.expert_projections else self._gpt_oss_expert_slice(leaf)
        if self.latent is not None and module in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj"):
            return self._latent_slice(module, leaf)
        q_rows, kv_rows = self.num_local_heads * self.head_dim, self.num_local_kv_heads * self.head_dim
        dense_size = self.shared_expert_intermediate_size if "shared_experts" in parts else self.intermediate_size
        inter = dense_size // self.size
        if module == "q_proj":
            return Cut(0, ((self.rank * q_rows, q_rows),), q_rows)
        if module == "self_attn" and leaf == "sinks":  # gpt-oss: one per q head
            return Cut(0, ((self.rank * self.num_local_heads, self.num_local_heads),), self.num_local_heads)
        if module in ("k_proj", "v_proj"):
            return Cut(0, ((self.first_kv_head * self.head_dim, kv_rows),), kv_rows)
        if module in ("gate_proj", "up_proj"):
            return Cut(0, ((self.rank * inter, inter),), inter)
        if module in ("o_proj", "down_proj"):
            if leaf == "bias":
                return None if self.rank == 0 else ZERO
            columns = q_rows if module == "o_proj" else inter
            return Cut(1, ((self.rank * columns, columns),), columns)
        if module in ("embed_tokens", "lm_head"):
            start = self.rank * self.vocab_per_rank
            return Cut(0, ((start, max(0, min(self.vocab_per_rank, self.vocab_size - start))),), self.vocab_per_rank)
        return None

    def _latent_slice(self, module: str, leaf: str) -> Cut | None:
        """Latent attention's head-split projections: the rank's heads' rows of ``q_b_proj`` / ``q_proj`` and
        ``kv_b_proj``, their input columns of ``o_proj`` (its bias on rank 0 only)."""
        heads, first = self.num_local_heads, self.rank * self.num_local_heads
        if module == "o_proj":
            if leaf == "bias":
                return None if self.rank == 0 else ZERO
            columns = self.latent.o_columns
            return Cut(1, ((first * columns, heads * columns),), heads * columns)
        rows = self.latent.kv_b_rows if module == "kv_b_proj" else self.latent.q_rows
        return Cut(0, ((first * rows, heads * rows),), heads * rows)

    def _scale_slice(self, name: str, shape: tuple[int, ...] | None) -> Cut | None:
        """A quantized weight's scale, cut with its weight ``[..., out, in]``: one value (per tensor) whole; one per
        output channel (``[..., out, 1]`` or ``[out]``) by the weight's rows, whole where the weight is cut by input
        columns; per block (``[ceil(out / b0), ceil(in / b1)]``) by the blocks the weight's cut covers."""
        weight_cut = self.slice_of(name.rpartition(".")[0] + ".weight")
        if weight_cut is None or (shape is not None and math.prod(shape) == 1):
            return None
        if self.scale_block is None:  # per channel: the weight's input dimension is the scale's trailing 1, or past it
            input_dim = None if shape is None else len(shape) - 1 if shape[-1] == 1 else len(shape)
            return None if weight_cut.dim == input_dim else weight_cut
        block = self.scale_block[weight_cut.dim]
        ranges = []
        for start, length in weight_cut.ranges:
            blocks = -(-length // block)
            ends_the_tensor = shape is not None and start // block + blocks == shape[weight_cut.dim]
            if start % block or (length % block and not ends_the_tensor):
                raise UnsupportedTensorParallel(
                    f"{name}: tensor_parallel_size={self.size} cuts its weight at {start}:{start + length} along "
                    f"dimension {weight_cut.dim}, not on the checkpoint's {block}-wide quantization blocks "
                    f"(weight_block_size {list(self.scale_block)}); use a tensor_parallel_size whose slices are "
                    "whole blocks")
            ranges.append((start // block, blocks))
        return Cut(weight_cut.dim, tuple(ranges), -(-weight_cut.padded // block))

    def _expert_slice(self, module: str, leaf: str) -> Cut | None:
        """An expert tensor's slice of the expert's intermediate dimension, in either checkpoint layout: per expert
        (``experts.E.<gate|up>.weight`` ``[inter, hidden]``, ``experts.E.<down>.weight`` ``[hidden, inter]``) or
        stacked (``experts.gate_up_proj`` ``[experts, 2 * inter, hidden]``: gate rows, then up rows;
        ``experts.down_proj`` ``[experts, hidden, inter]``)."""
        full = self.expert_intermediate_size
        inter = full // self.size
        start = self.rank * inter
        gate, up, down = self.expert_projections
        if module == "experts" and leaf == "gate_up_proj":
            return Cut(1, ((start, inter), (full + start, inter)), 2 * inter)
        if module == "experts" and leaf == "down_proj":
            return Cut(2, ((start, inter),), inter)
        if module in (gate, up):
            return Cut(0, ((start, inter),), inter)
        if module == down:
            return Cut(1, ((start, inter),), inter)
        return None

    def _gpt_oss_expert_slice(self, leaf: str) -> Cut | None:
        """gpt-oss's stacked experts, as stored: ``gate_up_proj`` ``[experts, hidden, 2 * inter]`` and its bias
        ``[experts, 2 * inter]`` with gate and up interleaved (columns 2i, 2i + 1: one contiguous run per rank),
        ``down_proj`` ``[experts, inter, hidden]``, and ``down_proj_bias`` (row-parallel: rank 0's only). The hub's
        MXFP4 form stores each transposed, in blocks of 32 inputs (``pipeline/quantization/mxfp4.py``):
        ``gate_up_proj_blocks`` / ``_scales`` ``[experts, 2 * inter, hidden / 32(, 16)]`` by output rows,
        ``down_proj_blocks`` / ``_scales`` ``[experts, hidden, inter / 32(, 16)]`` by whole input blocks."""
        inter = self.expert_intermediate_size // self.size
        start = self.rank * inter
        if leaf in ("gate_up_proj", "gate_up_proj_bias"):
            return Cut(2 if leaf == "gate_up_proj" else 1, ((2 * start, 2 * inter),), 2 * inter)
        if leaf in ("gate_up_proj_blocks", "gate_up_proj_scales"):
            return Cut(1, ((2 * start, 2 * inter),), 2 * inter)
        if leaf in ("down_proj_blocks", "down_proj_scales"):  # check_supported: whole blocks only
            groups = inter // MXFP4_GROUP_SIZE
            return Cut(2, ((start // MXFP4_GROUP_SIZE, groups),), groups)
        if leaf == "down_proj":
            return Cut(1, ((start, inter),), inter)
        if leaf == "down_proj_bias":
            return None if self.rank == 0 else ZERO
        return None


def read_shards(path: str | os.PathLike, spec: ShardSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every checkpoint tensor, cut to ``spec``'s slice as it is read (safetensors
    ``get_slice``: the other ranks' rows are never read into memory)."""
    for handle in open_weight_files(path):
        for name in handle.keys():
            view = handle.get_slice(name)
            shape = list(view.get_shape())
            cut = spec.slice_of(name, tuple(shape))
            if cut is None:
                yield name, handle.get_tensor(name)
                continue
            if cut.is_zero:
                yield name, torch.zeros(shape, dtype=view[0:1].dtype)
                continue
            lead = (slice(None),) * cut.dim
            blocks = [view[lead + (slice(start, start + length),)] for start, length in cut.ranges]
            tensor = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=cut.dim)
            length = tensor.shape[cut.dim]
            if length < cut.padded:  # the vocabulary's padding rows: never looked up, their logits dropped
                shape[cut.dim] = cut.padded - length
                tensor = torch.cat([tensor, torch.zeros(shape, dtype=tensor.dtype)], dim=cut.dim)
            yield name, tensor


def check_checkpoint(path: str | os.PathLike, hf_config, tensor_parallel_size: int, quantization: str | None) -> None:
    """``check_supported`` for the checkpoint directory at ``path``."""
    check_supported(hf_config, tensor_parallel_size, quantization, read_config_json(path))
