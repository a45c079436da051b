"""Which slice of each checkpoint tensor a tensor-parallel rank holds, and the rank's own view of the config.

Megatron's layout for the dense Llama family: q/k/v and gate/up are split by output rows (q heads,
kv heads, intermediate columns), o_proj and down_proj by input columns (their outputs are summed by
an all-reduce), the embedding and the LM head by vocabulary rows (padded to a multiple of the TP
size). When there are fewer KV heads than ranks, each rank keeps the one KV head its q heads read.
Norms are replicated. ``read_shards`` reads only a rank's slice from the safetensors files.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from pipeline.checkpoint_files import read_config_json
from pipeline.weights import open_weight_files

# The architectures tensor parallelism runs: the dense Llama family (pipeline/models/llama.py).
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class TensorParallelError(RuntimeError):
    """A tensor-parallel setup Tandem cannot run, or a rank that failed, died or stopped answering."""


def check_supported(hf_config, tensor_parallel_size: int, quantization: str | None, config_json: dict) -> None:
    """Raise ``TensorParallelError`` naming what ``tensor_parallel_size`` > 1 cannot run for this checkpoint."""
    tp = tensor_parallel_size
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not any(name in TENSOR_PARALLEL_ARCHITECTURES for name in architectures):
        raise TensorParallelError(
            f"tensor_parallel_size={tp} is not supported for architecture {', '.join(architectures) or '(none)'}; "
            f"tensor parallelism runs {', '.join(TENSOR_PARALLEL_ARCHITECTURES)} (see docs/tensor-parallel.md)")
    if quantization is not None or config_json.get("quantization_config") is not None:
        raise TensorParallelError(f"tensor_parallel_size={tp} is not supported for quantized checkpoints yet")
    num_heads = hf_config.num_attention_heads
    num_kv_heads = hf_config.num_key_value_heads or num_heads
    if num_heads % tp:
        raise TensorParallelError(
            f"tensor_parallel_size={tp} must divide num_attention_heads={num_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise TensorParallelError(
            f"tensor_parallel_size={tp} and num_key_value_heads={num_kv_heads}: one must divide the other")
    if hf_config.intermediate_size % tp:
        raise TensorParallelError(
            f"tensor_parallel_size={tp} must divide intermediate_size={hf_config.intermediate_size}")


@dataclass(frozen=True)
class ShardSpec:
    """Rank ``rank`` of ``size``: the row/column ranges it holds of each kind of tensor."""

    rank: int
    size: int
    num_heads: int  # q heads in the whole model
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the checkpoint's (unpadded)

    @classmethod
    def of(cls, hf_config, rank: int, size: int) -> "ShardSpec":
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(rank, size, num_heads, hf_config.num_key_value_heads or num_heads, head_dim,
                   hf_config.intermediate_size, hf_config.vocab_size)

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
        local.intermediate_size = self.intermediate_size // self.size
        local.vocab_size = self.vocab_per_rank
        return local

    def slice_of(self, name: str) -> tuple[int, int, int, int] | None:
        """(dim, start, length, padded length) of checkpoint tensor ``name`` this rank holds; None = all of it;
        a bias of a row-parallel layer: (0, 0, 0, 0), meaning zeros on every rank but 0 (added once)."""
        parts = name.split(".")
        module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
        q_rows, kv_rows = self.num_local_heads * self.head_dim, self.num_local_kv_heads * self.head_dim
        inter = self.intermediate_size // self.size
        if module == "q_proj":
            return 0, self.rank * q_rows, q_rows, q_rows
        if module in ("k_proj", "v_proj"):
            return 0, self.first_kv_head * self.head_dim, kv_rows, kv_rows
        if module in ("gate_proj", "up_proj"):
            return 0, self.rank * inter, inter, inter
        if module in ("o_proj", "down_proj"):
            if leaf == "bias":
                return None if self.rank == 0 else (0, 0, 0, 0)
            columns = q_rows if module == "o_proj" else inter
            return 1, self.rank * columns, columns, columns
        if module in ("embed_tokens", "lm_head"):
            start = self.rank * self.vocab_per_rank
            return 0, start, max(0, min(self.vocab_per_rank, self.vocab_size - start)), self.vocab_per_rank
        return None


def read_shards(path: str | os.PathLike, spec: ShardSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every checkpoint tensor, cut to ``spec``'s slice as it is read (safetensors
    ``get_slice``: the other ranks' rows are never read into memory)."""
    for handle in open_weight_files(path):
        for name in handle.keys():
            cut = spec.slice_of(name)
            if cut is None:
                yield name, handle.get_tensor(name)
                continue
            dim, start, length, padded = cut
            view = handle.get_slice(name)
            shape = list(view.get_shape())
            if padded == 0:  # a row-parallel bias on a rank other than 0
                dtype = handle.get_slice(name)[0:1].dtype
                yield name, torch.zeros(shape, dtype=dtype)
                continue
            tensor = view[start:start + length] if dim == 0 else view[:, start:start + length]
            if length < padded:  # the vocabulary's padding rows: never looked up, their logits dropped
                shape[dim] = padded - length
                tensor = torch.cat([tensor, torch.zeros(shape, dtype=tensor.dtype)], dim=dim)
            yield name, tensor


def check_checkpoint(path: str | os.PathLike, hf_config, tensor_parallel_size: int, quantization: str | None) -> None:
    """``check_supported`` for the checkpoint directory at ``path``."""
    check_supported(hf_config, tensor_parallel_size, quantization, read_config_json(path))
