"""ModelRunner: owns every tensor of a worker (weights, the KV cache, the step's input buffers).

It turns the scheduler's plan (a list of chunks) into one flat ``ForwardBatch``, runs the model
and the sampler, and returns the sampled tokens. It makes no scheduling decision.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels import Kernels
from pipeline.forward_batch import ForwardBatch
from pipeline.sampler import Sampler, SamplerOutput
from pipeline.scheduler import ScheduledChunk

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_shape(hf_config, num_blocks: int, page_size: int) -> tuple[int, ...]:
    """[num_layers, 2 (k, v), num_blocks, page_size, num_kv_heads, head_dim]."""
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    return (hf_config.num_hidden_layers, 2, num_blocks, page_size, num_kv_heads, head_dim)


def bytes_per_block(hf_config, page_size: int, dtype: torch.dtype) -> int:
    shape = kv_cache_shape(hf_config, 1, page_size)
    return int(torch.tensor(shape).prod().item()) * torch.empty((), dtype=dtype).element_size()


def determine_num_blocks(kv_config, hf_config, dtype: torch.dtype, device: str, max_useful_blocks: int) -> int:
    """Explicit ``num_blocks``, else a share of device memory (GPU) or ``cpu_kv_cache_gib`` (CPU).

    Never more than ``max_useful_blocks`` (every running sequence at full length): memory beyond
    that could only hold prefix cache, and on CPU it would be wasted RAM.
    """
    if kv_config.num_blocks is not None:
        return kv_config.num_blocks
    per_block = bytes_per_block(hf_config, kv_config.page_size, dtype)
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        budget = free * kv_config.device_memory_utilization
    else:
        budget = kv_config.cpu_kv_cache_gib * 2**30
    return max(2, min(int(budget // per_block), max_useful_blocks))


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]
        kernels: Kernels,
        sampler: Sampler,
        device: str,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kernels = kernels
        self.sampler = sampler
        self.device = torch.device(device)
        self.page_size = kv_cache.shape[3]

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], block_table: Callable[[str], list[int]]) -> SamplerOutput | None:
        """Run one step over ``chunks``; returns one sample per chunk that reached its last token."""
        batch = self.prepare(chunks, block_table)
        hidden = self.model(batch, self.kv_cache, self.kernels)  # [num_tokens, hidden]
        if batch.logits_indices.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [num_sampled, vocab] fp32
        states = [c.seq.sampling_state for c in chunks if c.is_sampling]
        return self.sampler(logits, states)

    def prepare(self, chunks: list[ScheduledChunk], block_table: Callable[[str], list[int]]) -> ForwardBatch:
        page_size = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu_seqlens = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        for chunk in chunks:
            start, end = chunk.start, chunk.start + chunk.num_tokens
            table = block_table(chunk.seq.request_id)
            input_ids.extend(chunk.seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // page_size] * page_size + p % page_size for p in range(start, end))
            cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
            context_lens.append(end)
            tables.append(table)
            if chunk.is_sampling:
                logits_indices.append(cu_seqlens[-1] - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        device = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        )
