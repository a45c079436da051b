"""CUDA graphs for decode steps: the model's forward and logits captured once per padded batch size, replayed.

A decode step launches hundreds of small kernels whose launch cost, not their work, bounds a small batch on a GPU.
Like vLLM, Tandem captures the forward of a decode-only batch (one token per sequence, every one sampled) for a
ladder of batch sizes (``capture_sizes``) into static input buffers and replays the graph of the smallest size that
holds the batch. The sampler stays outside the graph (its work depends on each request's parameters); so do prompt
chunks, speculative verify steps and prompt logprobs, which run eagerly as before.

Padding: a padded row reads one KV row (block 0, context length 1) and writes none (slot -1, which every KV store
kernel skips), so it can neither see nor disturb a real request's KV; its logits are never read.

Every kernel on the path is launched from shapes alone, never from values read back to the host (the MoE's
alignment, the split-KV choice), which is what capture needs. That is checked, not assumed: after capturing,
every graph is replayed on random inputs other than the ones it was captured with and compared with the eager
forward of the same inputs; a capture that fails (a kernel that synchronizes) or a replay that differs (a value
baked in at capture time) turns graphs off for the worker, with a warning naming why, and every step runs eagerly.
``enforce_eager`` turns them off by configuration (vLLM's flag).

On the CPU there is nothing to capture; ``emulate=True`` runs the same padded static buffers eagerly, which is how
the padding is checked token for token on this machine (tests/pipeline/test_cuda_graphs.py).
"""

from __future__ import annotations

import bisect
import logging

import torch

from pipeline.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """The padded batch sizes with a graph: 1, 2, 4, 8, then every 16 up to ``max_batch_size`` (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return sorted(set(sizes) | {max_batch_size})


class DecodeGraphs:
    """The decode forward of ``model`` over ``kv_cache`` for ``capture_sizes(max_batch_size)``; ``logits(batch)``
    runs a batch that ``fits`` and returns its fp32 logits ``[num_seqs, vocab]`` (a view of a static buffer, valid
    until the next call)."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, kernels, device: torch.device | str,
                 max_batch_size: int, max_blocks_per_seq: int, *, emulate: bool = False) -> None:
        self.model, self.kv_cache, self.kernels = model, kv_cache, kernels
        self.device = torch.device(device)
        self.sizes = capture_sizes(max_batch_size)
        self.emulate = emulate
        largest = self.sizes[-1]
        with torch.device(self.device):
            self.inputs = ForwardBatch(
                input_ids=torch.zeros(largest, dtype=torch.int64),
                positions=torch.zeros(largest, dtype=torch.int64),
                cu_seqlens_q=torch.arange(largest + 1, dtype=torch.int32),  # one token per sequence, always
                context_lens=torch.ones(largest, dtype=torch.int32),
                slot_mapping=torch.full((largest,), -1, dtype=torch.int64),
                block_tables=torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32),
                logits_indices=torch.arange(largest, dtype=torch.int64),
            )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    # ---- use ----------------------------------------------------------------------------------

    def fits(self, batch: ForwardBatch) -> bool:
        """A decode-only batch (one token per sequence, each sampled) no larger than the largest graph."""
        num_seqs = batch.num_seqs
        return (0 < num_seqs <= self.sizes[-1] and batch.num_tokens == num_seqs
                and batch.logits_indices.numel() == num_seqs
                and batch.block_tables.shape[1] <= self.inputs.block_tables.shape[1])

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        num_seqs = batch.num_seqs
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        self._load(batch, size)
        if self.emulate:
            return self._forward(size)[:num_seqs]
        self._graphs[size].replay()
        return self._logits[size][:num_seqs]

    def _load(self, batch: ForwardBatch, size: int) -> None:
        """Copy ``batch`` into the static inputs; rows up to ``size`` past it become padding."""
        n, width, inputs = batch.num_seqs, batch.block_tables.shape[1], self.inputs
        inputs.input_ids[:n].copy_(batch.input_ids)
        inputs.positions[:n].copy_(batch.positions)
        inputs.context_lens[:n].copy_(batch.context_lens)
        inputs.slot_mapping[:n].copy_(batch.slot_mapping)
        inputs.block_tables[:n, :width].copy_(batch.block_tables)
        self._pad(n, size)

    def _pad(self, start: int, stop: int) -> None:
        inputs = self.inputs
        inputs.input_ids[start:stop].zero_()
        inputs.positions[start:stop].zero_()
        inputs.context_lens[start:stop].fill_(1)
        inputs.slot_mapping[start:stop].fill_(-1)
        inputs.block_tables[start:stop].zero_()

    def _view(self, size: int) -> ForwardBatch:
        inputs = self.inputs
        return ForwardBatch(
            input_ids=inputs.input_ids[:size], positions=inputs.positions[:size],
            cu_seqlens_q=inputs.cu_seqlens_q[: size + 1], context_lens=inputs.context_lens[:size],
            slot_mapping=inputs.slot_mapping[:size], block_tables=inputs.block_tables[:size],
            logits_indices=inputs.logits_indices[:size])

    def _forward(self, size: int) -> torch.Tensor:
        view = self._view(size)
        hidden = self.model(view, self.kv_cache, self.kernels)
        return self.model.compute_logits(hidden[view.logits_indices])

    # ---- capture ------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (largest first, one memory pool), then check each against the eager forward.
        Raises ``RuntimeError`` naming the size and the cause when a graph cannot be used."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for size in reversed(self.sizes):
                self._pad(0, size)
                for _ in range(2):  # compiles and autotunes outside the capture
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool, stream=side):
                        self._logits[size] = self._forward(size)
                except Exception as exc:
                    raise RuntimeError(f"capturing batch size {size} failed: {exc}") from exc
                self._graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        for size in self.sizes:
            self._check_replay(size)
        self._pad(0, self.sizes[-1])

    def _check_replay(self, size: int) -> None:
        """Replay ``size`` on inputs it was not captured with and compare with the eager forward of the same."""
        gen = torch.Generator(device=self.device).manual_seed(size)
        inputs = self.inputs
        vocab = self._logits[size].shape[-1]
        num_blocks, page_size = self.kv_cache.shape[2], self.kv_cache.shape[3]
        contexts = torch.randint(1, min(4 * page_size, inputs.block_tables.shape[1] * page_size) + 1, (size,),
                                 generator=gen, device=self.device, dtype=torch.int32)
        inputs.input_ids[:size] = torch.randint(0, vocab, (size,), generator=gen, device=self.device)
        inputs.positions[:size] = contexts.to(torch.int64) - 1
        inputs.context_lens[:size] = contexts
        inputs.slot_mapping[:size] = -1  # read KV, write none
        inputs.block_tables[:size] = torch.randint(0, num_blocks, inputs.block_tables[:size].shape, generator=gen,
                                                   device=self.device, dtype=torch.int32)
        self._graphs[size].replay()
        replayed = self._logits[size].clone()
        eager = self._forward(size)
        if not torch.allclose(replayed, eager, rtol=1e-3, atol=1e-3, equal_nan=True):
            diff = (replayed - eager).abs().nan_to_num(0.0).max().item()
            raise RuntimeError(f"batch size {size}: the replayed graph's logits differ from the eager forward's "
                               f"(max |difference| {diff:.3g}): a value is baked into the capture")


def capture_decode_graphs(model: torch.nn.Module, kv_cache: torch.Tensor, kernels, device: torch.device | str,
                          max_batch_size: int, max_blocks_per_seq: int) -> DecodeGraphs | None:
    """Captured and checked decode graphs, or None (a warning says why) where the model cannot use them."""
    graphs = DecodeGraphs(model, kv_cache, kernels, device, max_batch_size, max_blocks_per_seq)
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - whatever keeps a graph from being trusted, the eager path serves
        logger.warning("CUDA graphs off, every step runs eagerly: %s", exc)
        torch.cuda.empty_cache()  # what the failed captures held
        return None
    logger.info("CUDA graphs captured for decode batch sizes %s", graphs.sizes)
    return graphs
