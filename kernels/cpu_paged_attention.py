"""Paged attention on the CPU: the native kernel (``kernels/native``) where it applies, else the torch reference.

The native kernel reads K/V in place from the pages through the block table, with an online softmax
per query row, instead of gathering each sequence's pages into a padded copy first; its contract is
``paged_attention_ref``'s, which stays the oracle in tests and the path for what the kernel does not
take (a CPU build without the module, fp16, a layout that is not contiguous per token). Attention sinks (gpt-oss:
one learned logit per query head that joins its softmax's denominator) run native too, added to each row's sum at
the end, against the larger of the sink and the row's max.

On a CPU with AMX, a bf16 sequence with many query rows (a prompt's chunk) goes instead to torch's flash-attention
kernel over its gathered K/V (``paged_attention_ref.sequence_attention``): its two products are library bf16 GEMMs
(oneDNN's brgemm, or MKL's bf16 GEMM), which run on AMX tiles there, where the native kernel's are AVX-512 FMAs.
Decodes and short queries stay native (they read K/V in place and are bound by memory, not arithmetic), and so do
layers with sinks, which torch's kernel does not take. From how
many rows the route pays is measured on the machine when a bf16 model is prepared (``kernels/cpu_prompt_route.py``);
until then it starts at 64. On a CPU without AMX the native kernel is the faster of the two (1.9 against 4.3 ns per
query-key pair for a 512-row bf16 chunk over 1536 keys on a Zen 5 core), so nothing is routed there.
"""

from __future__ import annotations

import os

import torch

from kernels import cpu_native
from kernels.paged_attention_ref import paged_attention_ref, sequence_attention

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _flash_min_query_rows() -> tuple[int | None, str]:
    """(row count, where it comes from): 64 on a CPU with AMX until ``kernels/cpu_prompt_route.py`` measures the
    machine ("default"), else None ("no AMX"); ``TANDEM_CPU_FLASH_MIN_QUERY_ROWS`` (a row count, or ``off``) sets it
    instead ("set"), e.g. with what ``python -m bench.cpu_prompt_attention`` reports."""
    raw = os.environ.get("TANDEM_CPU_FLASH_MIN_QUERY_ROWS")
    if raw is None:
        return (64, "default") if "amx_bf16" in cpu_native.cpu_flags() else (None, "no AMX")
    if raw.strip().lower() in ("off", "none", "no", "0", ""):
        return None, "set"
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if rows < 1:
        raise ValueError(f"TANDEM_CPU_FLASH_MIN_QUERY_ROWS={raw!r}: a positive row count, or off")
    return rows, "set"


# A sequence with at least this many query rows, in one of these dtypes, goes to torch's flash attention (None:
# none does). AMX multiplies bf16 tiles only, so fp32 stays native everywhere.
FLASH_MIN_QUERY_ROWS, FLASH_ROUTE_SOURCE = _flash_min_query_rows()
FLASH_DTYPES = (torch.bfloat16,)


def set_flash_route(rows: int | None, source: str) -> None:
    """Route bf16 sequences of ``rows`` or more query rows to torch's flash attention (None: none); ``source`` says
    why, for ``describe_prompt_route`` ("calibrated": measured on this machine)."""
    global FLASH_MIN_QUERY_ROWS, FLASH_ROUTE_SOURCE
    FLASH_MIN_QUERY_ROWS, FLASH_ROUTE_SOURCE = rows, source


def describe_prompt_route() -> str:
    """Where bf16 prompt chunks' attention runs, for the kernel set's name (logs, benchmark reports)."""
    route = ("prompt attention native" if FLASH_MIN_QUERY_ROWS is None
             else f"bf16 prompt attention torch flash from {FLASH_MIN_QUERY_ROWS} rows")
    return route if FLASH_ROUTE_SOURCE in ("no AMX", "set") else f"{route} ({FLASH_ROUTE_SOURCE})"


NATIVE_MAX_GROUP = 64  # query heads per KV head the native kernel takes (MAX_ROWS in kernels/native/cpu_ops.c)
NATIVE_MAX_HEAD_DIM = 576  # MAX_HEAD_DIM there


def native_applies(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors (else the reference runs: a larger GQA group or head dim
    made the kernel refuse every step, and a worker serving such a model failed each request)."""
    num_q_heads, head_dim, num_kv_heads = query.shape[-2], query.shape[-1], k_cache.shape[-2]
    return (
        cpu_native.ops is not None
        and num_kv_heads > 0 and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= NATIVE_MAX_GROUP and head_dim <= NATIVE_MAX_HEAD_DIM
        and query.device.type == "cpu"
        and query.dtype in _DTYPE_CODES
        and k_cache.dtype == query.dtype
        and v_cache.dtype == query.dtype
        and query.stride(-1) == 1
        and query.stride(-2) == query.shape[-1]
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
        and k_cache.stride(-2) == k_cache.shape[-1]
        and v_cache.stride(-2) == v_cache.shape[-1]
    )


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] attention-sink logits (gpt-oss)
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    if not native_applies(query, k_cache, v_cache):
        return paged_attention_ref(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                   sliding_window, sinks)
    starts, flash_seqs = _flash_sequences(query, cu_seqlens_q) if sinks is None else ([], [])
    if not flash_seqs:
        return paged_attention_native(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                      sliding_window, sinks)
    kv_lens = context_lens.tolist()
    out = torch.empty_like(query)
    for i in flash_seqs:
        out[starts[i]:starts[i + 1]] = sequence_attention(query[starts[i]:starts[i + 1]], k_cache, v_cache,
                                                          block_tables[i], kv_lens[i], scale, sliding_window)
    native_seqs = sorted(set(range(len(kv_lens))) - set(flash_seqs))
    if native_seqs:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in native_seqs])
        q_lens = torch.tensor([starts[i + 1] - starts[i] for i in native_seqs])
        cu_native = torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)])
        seqs = torch.tensor(native_seqs)
        out[rows] = paged_attention_native(query[rows], k_cache, v_cache, cu_native, context_lens[seqs],
                                           block_tables[seqs], scale, sliding_window)
    return out


def may_route_to_flash(num_rows: int, dtype: torch.dtype) -> bool:
    """Whether a batch of ``num_rows`` query rows in ``dtype`` may send a sequence to torch's flash attention (else
    every sequence runs the native kernel)."""
    return FLASH_MIN_QUERY_ROWS is not None and dtype in FLASH_DTYPES and num_rows >= FLASH_MIN_QUERY_ROWS


def _flash_sequences(query: torch.Tensor, cu_seqlens_q: torch.Tensor) -> tuple[list[int], list[int]]:
    """(the batch's query offsets, the sequences that go to torch's flash attention: ``FLASH_MIN_QUERY_ROWS``);
    without a route, or with too few rows in all, ([], []) and the offsets are not read."""
    if not may_route_to_flash(query.shape[0], query.dtype):
        return [], []
    starts = cu_seqlens_q.tolist()
    return starts, [i for i, (start, end) in enumerate(zip(starts, starts[1:])) if end - start >= FLASH_MIN_QUERY_ROWS]


def paged_attention_native(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                           sliding_window=None, sinks=None):
    """``paged_attention_ref``'s contract on the native kernel alone (no route to torch's flash attention), for
    tensors ``native_applies`` takes."""
    cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    block_tables = block_tables.to(torch.int32)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype)
    if num_tokens == 0:
        return out
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        if sinks.shape != (num_q_heads,):
            raise ValueError(f"attention sinks of shape {tuple(sinks.shape)}: one per query head ({num_q_heads})")
    cpu_native.ops.paged_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        cu_seqlens_q.data_ptr(), context_lens.data_ptr(), block_tables.data_ptr(),
        context_lens.numel(), num_q_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        _DTYPE_CODES[query.dtype], sliding_window or 0,
        query.stride(0), out.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0) if block_tables.dim() == 2 else 0,
        float(scale), torch.get_num_threads(), 0 if sinks is None else sinks.data_ptr(),
    )
    return out
