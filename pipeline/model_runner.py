"""ModelRunner: owns every tensor of a worker (weights, the KV cache, the step's input buffers).

It turns the scheduler's plan (a list of chunks) into one flat ``ForwardBatch``, runs the model
and the sampler, and returns the sampled tokens. It makes no scheduling decision.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from kernels import Kernels
from pipeline import prompt_logprobs
from pipeline.cuda_graphs import DecodeGraphs
from pipeline.execution_stream import ExecutionStream
from pipeline.forward_batch import ForwardBatch, with_final_layer_rows
from pipeline.models.mla import is_latent_attention, latent_dim
from pipeline.sampler import Sampler, SamplerOutput
from pipeline.scheduler import ScheduledChunk
from pipeline.sequence import PLACEHOLDER_TOKEN_ID
from pipeline.sequence_buffer import GatheredInputs, SequenceBuffer

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_shape(hf_config, num_blocks: int, page_size: int, tensor_parallel_size: int = 1) -> tuple[int, ...]:
    """[num_layers, 2 (k, v), num_blocks, page_size, num_kv_heads, head_dim]; for latent attention (MLA)
    one latent row per token: [num_layers, 1, num_blocks, page_size, 1, kv_lora_rank + qk_rope_head_dim].
    Under tensor parallelism one rank's: its share of the KV heads, at least one (pipeline/parallel)."""
    if is_latent_attention(hf_config):
        return (hf_config.num_hidden_layers, 1, num_blocks, page_size, 1, latent_dim(hf_config))
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    num_kv_heads = max(1, num_kv_heads // tensor_parallel_size)
    return (hf_config.num_hidden_layers, 2, num_blocks, page_size, num_kv_heads, head_dim)


def bytes_per_block(hf_config, page_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    shape = kv_cache_shape(hf_config, 1, page_size, tensor_parallel_size)
    return int(torch.tensor(shape).prod().item()) * torch.empty((), dtype=dtype).element_size()


def determine_num_blocks(kv_config, hf_config, dtype: torch.dtype, device: str, max_useful_blocks: int,
                         extra_bytes_per_block: int = 0, tensor_parallel_size: int = 1) -> int:
    """Explicit ``num_blocks``, else a share of device memory (GPU) or ``cpu_kv_cache_gib`` (CPU).

    Never more than ``max_useful_blocks`` (every running sequence at full length): memory beyond
    that could only hold prefix cache, and on CPU it would be wasted RAM.
    """
    if kv_config.num_blocks is not None:
        return kv_config.num_blocks
    per_block = bytes_per_block(hf_config, kv_config.page_size, dtype, tensor_parallel_size) + extra_bytes_per_block  # + a draft's KV
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
        max_num_reqs: int = 64,
        max_model_len: int = 4096,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kernels = kernels
        self.sampler = sampler
        self.device = torch.device(device)
        self.page_size = kv_cache.shape[3]
        self.buffer = SequenceBuffer(max_num_reqs, max_model_len, self.page_size, sampler.vocab_size)  # persistent batch
        # Overlap pipeline: the rows of the last launched step's sampled tokens, by request (host), and
        # those tokens on the device (written and read on the execution stream only).
        self._launched_rows: dict[str, int] = {}
        self._last_sampled: torch.Tensor | None = None
        # structured output: grammar masks are filled on this thread while the forward runs (made on first use)
        self._mask_filler: ThreadPoolExecutor | None = None
        self.graphs: DecodeGraphs | None = None  # CUDA: decode batches replay captured graphs (pipeline/cuda_graphs.py)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], block_table: Callable[[str], list[int]]) -> SamplerOutput | None:
        """Run one step over ``chunks``; returns one sample per chunk that reached its last token."""
        batch = self.prepare(chunks, block_table)
        sampling, plan = self._sampling_plan(chunks)  # grammar masks start filling beside the forward
        logits = self._forward(batch, prompt_logprobs.spans(chunks, batch.cu_seqlens_q))
        return None if logits is None else self.sampler.sample(logits, plan)

    def _forward(self, batch: ForwardBatch, prompt_spans: list) -> torch.Tensor | None:
        """The sampled rows' fp32 logits ``[num_sampled, vocab]`` (None if none is sampled), prompt logprobs scored on
        the way; a decode batch replays a captured CUDA graph where there is one."""
        if self.graphs is not None and not prompt_spans and self.graphs.fits(batch):
            return self.graphs.logits(batch)
        hidden = self.model(batch, self.kv_cache, self.kernels)  # [num_tokens (final_layer: its rows), hidden]
        prompt_logprobs.score(self.model, hidden, prompt_spans)
        if batch.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(batch.sampled_rows(hidden))

    def _sampling_plan(self, chunks: list[ScheduledChunk], masks_after: Future | None = None):
        """(the sampling chunks, their SamplingPlan): dense parameters from the persistent batch's rows."""
        sampling = [c for c in chunks if c.is_sampling]

        def arrays():
            return self.buffer.sampling_arrays([self.buffer.row_of(c.seq.request_id) for c in sampling])

        states = [c.seq.sampling_state for c in sampling]
        if self._mask_filler is None and any(s.grammar is not None for s in states):
            self._mask_filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar-masks")
        return sampling, self.sampler.plan(states, self.device, arrays, self._mask_filler, masks_after)

    def launch(self, chunks: list[ScheduledChunk], block_table: Callable[[str], list[int]],
               stream: ExecutionStream, seeds: list[tuple[torch.Generator, int]],
               masks_after: Future | None = None) -> Future:
        """Queue one step on ``stream`` and return at once; the Future gives its ``SamplerOutput`` (or None).

        Everything read from the requests (token ids, block tables, sampling parameters) is read here,
        on the host, before this returns. An input token that is still a placeholder is the token the
        previous launched step sampled for that request: it is copied on the device, on the stream,
        after that step has run, so it never travels through the host. ``seeds``: (generator, seed)
        pairs applied on the stream just before sampling (the host may seed the next step meanwhile).
        ``masks_after``: grammar masks are filled once it is done (the host sets it after reading the
        previous step, whose tokens the grammars must take first); sampling waits for the masks.
        """
        gathered = self.gather(chunks, block_table)
        batch = self.to_batch(gathered, chunks)
        targets = np.flatnonzero(gathered.input_ids == PLACEHOLDER_TOKEN_ID).tolist()
        sources = [self._launched_rows[chunks[i].seq.request_id] for i in gathered.token_chunk[targets].tolist()]
        sampling, plan = self._sampling_plan(chunks, masks_after)
        prompt_spans = prompt_logprobs.spans(chunks, gathered.cu_seqlens)
        self._launched_rows = {c.seq.request_id: row for row, c in enumerate(sampling)}
        if targets:
            targets_t = torch.tensor(targets, dtype=torch.long, device=self.device)
            sources_t = torch.tensor(sources, dtype=torch.long, device=self.device)
            batch.input_ids[targets_t] = 0  # never an out-of-range id, even for a moment

        def run() -> SamplerOutput | None:
            if targets:
                batch.input_ids[targets_t] = self._last_sampled[sources_t]
            logits = self._forward(batch, prompt_spans)
            if logits is None:
                self._last_sampled = None
                return None
            for generator, seed in seeds:
                generator.manual_seed(seed)
            out = self.sampler.sample(logits, plan)
            self._last_sampled = out.token_tensor
            return out

        return stream.submit(run)

    def forget_launched(self) -> None:
        """After a failed step: no launched step's sampled tokens exist to copy into the next step's placeholders."""
        self._launched_rows = {}
        self._last_sampled = None

    def prepare(self, chunks: list[ScheduledChunk], block_table: Callable[[str], list[int]]) -> ForwardBatch:
        """The step's ``ForwardBatch`` from the persistent batch (each request's row brought up to date)."""
        return self.to_batch(self.gather(chunks, block_table), chunks)

    def gather(self, chunks: list[ScheduledChunk], block_table: Callable[[str], list[int]]) -> GatheredInputs:
        buffer = self.buffer
        rows = buffer.sync_all([chunk.seq for chunk in chunks], [block_table(chunk.seq.request_id) for chunk in chunks])
        return buffer.gather(rows, [chunk.start for chunk in chunks], [chunk.num_tokens for chunk in chunks])

    def to_batch(self, gathered: GatheredInputs, chunks: list[ScheduledChunk]) -> ForwardBatch:
        ends = gathered.cu_seqlens.tolist()
        logits_indices = np.array([ends[i + 1] - 1 for i, chunk in enumerate(chunks) if chunk.is_sampling],
                                  dtype=np.int64)
        device = self.device

        def tensor(array: np.ndarray) -> torch.Tensor:
            host = torch.from_numpy(array)  # every gathered array is a fresh, contiguous copy
            return host if device.type == "cpu" else host.to(device)

        batch = ForwardBatch(
            input_ids=tensor(gathered.input_ids),
            positions=tensor(gathered.positions),
            cu_seqlens_q=tensor(gathered.cu_seqlens),
            context_lens=tensor(gathered.context_lens),
            slot_mapping=tensor(gathered.slot_mapping),
            block_tables=tensor(gathered.block_tables),
            logits_indices=tensor(logits_indices),
        )
        if prompt_logprobs.asked(chunks):
            return batch  # prompt logprobs read every prompt row's final hidden state
        # only the sampled rows leave the last decoder layer (pipeline/forward_batch.py)
        return with_final_layer_rows(batch, gathered.cu_seqlens, gathered.context_lens, gathered.block_tables,
                                     logits_indices, tensor)

    def forget(self, request_id: str) -> None:
        """A request left the batch (finished, aborted or preempted): free its row of the persistent batch."""
        row = self.buffer.remove_request(request_id)
        if row is not None:
            self.buffer.condense([row])
