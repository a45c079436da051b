"""The engine's one door for KV that crosses workers: ``LLMEngine.kv``.

The connector halves (``kv_transfer/connector``: ``SourceEngine`` / ``SinkEngine``), live migration's
handoff and the router link's KV index see the engine through this object and nothing else:
- where a request's KV lies (the cache tensor, its layers' attention windows, a request's blocks);
- a prefill-only request's blocks held until shipped, then released;
- a remote prefill's reservation and its activation on the first token, a migrated stream's arrival;
- the prefix cache as the router's KV index follows it (block hashes stored and removed).

Pausing streams for a drain reads the step in flight, so it stays with the step loop
(``LLMEngine.pause_decoding``); a paused stream nobody took resumes here.
"""

from __future__ import annotations

from pipeline.kv_cache import KVCacheManager
from pipeline.protocol import PromptLogprobs
from pipeline.request_table import RequestTable
from pipeline.scheduler import Scheduler
from pipeline.sequence import Sequence, SequenceStatus
from pipeline.step_output import StepOutput
from pipeline.token_emission import TokenEmitter


class KVPort:
    def __init__(self, kv_manager: KVCacheManager, kv_cache, scheduler: Scheduler, requests: RequestTable,
                 emitter: TokenEmitter, model, hf_config, rank_driver=None) -> None:
        """``rank_driver``: tensor parallelism's ranks 1..N-1 (their caches travel too); None with one rank."""
        self._kv_manager = kv_manager
        self._kv_cache = kv_cache
        self._scheduler = scheduler
        self._requests = requests
        self._emitter = emitter
        self._model = model
        self._hf_config = hf_config
        self._rank_driver = rank_driver
        self._sharded_kv_cache = None  # tensor parallelism: every rank's KV, once a transfer asks for it

    # ------------------------------------------------------------ where KV lies
    @property
    def page_size(self) -> int:
        return self._kv_manager.page_size

    @property
    def num_total_blocks(self) -> int:
        return self._kv_manager.num_total_blocks

    def cache_for_transfer(self):
        """The tensor the transfer service reads and writes ``[num_layers, 2, num_blocks, page_size, kv_heads,
        head_dim]`` (a draft model's layers after the target's, so its KV travels in the same transfer); with
        tensor parallelism every rank's cache as one ``ShardedKVCache`` (shared by the ranks on the first call,
        which must come before the first step)."""
        if self._rank_driver is None:
            return self._kv_cache
        if self._sharded_kv_cache is None:
            from pipeline.parallel.kv_shards import sharded_kv_cache

            self._sharded_kv_cache = sharded_kv_cache(self._rank_driver, self._hf_config, self._kv_cache)
        return self._sharded_kv_cache

    def layer_windows(self) -> list[int | None]:
        """Each layer of ``cache_for_transfer`` with its attention window (None: full attention), so a
        transfer skips a sliding layer's blocks outside it; a draft's layers count as full (sent whole)."""
        layers = getattr(getattr(self._model, "model", None), "layers", [])
        windows = [getattr(getattr(layer, "self_attn", None), "sliding_window", None) for layer in layers]
        num_layers = self._kv_cache.shape[0]
        return windows[:num_layers] + [None] * (num_layers - len(windows))

    def block_table(self, request_id: str) -> list[int]:
        """The blocks ``request_id`` holds, in token order (reserved, running, paused or held)."""
        return list(self._kv_manager.block_table(request_id))

    # ------------------------------------------------------------ KV leaving this worker
    def release_blocks(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request (or one aborted with ``keep_blocks``) kept for shipping."""
        self._requests.release_blocks(request_id)

    def abort_request(self, request_id: str, keep_blocks: bool = False) -> bool:
        """End a request wherever it is and free its blocks (``keep_blocks``: hold them until
        ``release_blocks``, e.g. while a transfer still reads them); ``LLMEngine.abort_request``'s own."""
        return self._requests.abort_request(request_id, keep_blocks)

    # ------------------------------------------------------------ KV arriving here
    def reserve_remote(self) -> list[Sequence]:
        """Reserve blocks for queued remote-prefill requests that fit (watermark, batch size); the newly
        reserved ones (``request_id``, ``token_ids``, ``num_cached_tokens``: the prefix this worker holds)."""
        return self._scheduler.reserve_remote()

    def withhold_from_prefix_cache(self, request_id: str) -> None:
        """A reserved request whose KV will not all arrive (a sliding layer's blocks outside its window): its
        blocks never enter the prefix cache (nor the router's KV index)."""
        self._kv_manager.withhold(request_id)

    def activate_remote(self, request_id: str, first_token_id: int, first_logprobs: dict[int, float] | None,
                        prompt_logprobs: PromptLogprobs | None = None,
                        num_prefill_computed_tokens: int | None = None) -> StepOutput:
        """The prompt's KV arrived: record the first token (sampled by the prefill worker, with the
        prompt's logprobs when asked for), run stop checks on it, and let the sequence decode from the next step.
        ``num_prefill_computed_tokens``: the prompt tokens the prefill worker ran; what the request reports as
        cached is what neither worker computed (a prompt-logprobs request is computed whole there, for one)."""
        seq = self._requests[request_id]
        if num_prefill_computed_tokens is not None:
            not_computed = seq.num_prompt_tokens - num_prefill_computed_tokens
            seq.num_cached_tokens = max(0, min(seq.num_cached_tokens, not_computed))
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs = prompt_logprobs or PromptLogprobs()
        self._scheduler.activate_remote(seq, first_token_id)
        return self._emitter.emit(seq, first_token_id, first_logprobs)

    def activate_migrated(self, request_id: str, num_draft_computed_tokens: int | None = None) -> None:
        """A migrated stream's KV arrived from the worker that decoded it so far (every token but the last,
        which the client has already): decode on from the next step, emitting nothing now."""
        seq = self._requests[request_id]
        seq.prompt_logprobs_sent = True  # sent with the first token, before the move
        self._scheduler.activate_migrated(seq, num_draft_computed_tokens)

    def resume_paused(self, request_id: str) -> None:
        """A stream paused for a drain's handoff that nobody took (the router declined it): it decodes on here."""
        seq = self._requests.get(request_id)
        if seq is not None and seq.status is SequenceStatus.PAUSED:
            self._scheduler.unpause(seq)

    # ------------------------------------------------------------ the prefix cache as the router's KV index sees it
    def record_prefix_cache_events(self) -> None:
        """From now on, keep the block hashes the prefix cache publishes and forgets."""
        self._kv_manager.record_events()

    def drain_prefix_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes stored, hashes removed) since the last drain."""
        return self._kv_manager.drain_events()

    def prefix_cache_snapshot(self) -> list[bytes]:
        """Every hash cached now (pending events dropped: the snapshot covers them)."""
        self._kv_manager.drain_events()
        return self._kv_manager.cached_hashes()
