"""LLMEngine: the step loop of one worker (tokenizer, model, KV manager, scheduler, runner, sampler).

``add_request`` validates and queues; ``step`` schedules one batch, runs it and returns what each
request produced in that step; ``abort_request`` ends a request and frees its blocks at once.
The offline ``LLM`` and the decode worker both drive it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kernels import load_kernels
from pipeline.builtin_model import BUILTIN_NOTICE, builtin_model_path
from pipeline.config import PipelineConfig
from pipeline.kv_cache import KVCacheManager
from pipeline.model_runner import TORCH_DTYPES, ModelRunner, determine_num_blocks, kv_cache_shape
from pipeline.output_processor import OutputProcessor
from pipeline.protocol import CompletionOutput, FinishReason, SamplingParams
from pipeline.request_validation import RequestError, resolve_bad_words, validate_request
from pipeline.sampler import Sampler, SequenceSamplingState
from pipeline.scheduler import Scheduler
from pipeline.sequence import Sequence
from pipeline.tokenizer import eos_token_ids, load_tokenizer
from pipeline.weights import load_model

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "StepOutput", "RequestError"]


@dataclass
class StepOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class LLMEngine:
    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.is_builtin_model = config.model.model_path is None
        model_path = str(builtin_model_path()) if self.is_builtin_model else config.model.model_path
        if self.is_builtin_model:
            logger.warning(BUILTIN_NOTICE)
        self.model_path = model_path
        self.device = config.model.resolved_device()
        self.dtype = TORCH_DTYPES[config.model.resolved_dtype()]
        torch.manual_seed(config.model.seed)

        self.model, self.hf_config = load_model(model_path, self.dtype, self.device)
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size = self.hf_config.vocab_size
        self.max_length = min(config.max_length or 10**9, self.hf_config.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.hf_config)

        page_size = config.kv_cache.page_size
        max_useful = config.max_batch_size * -(-self.max_length // page_size) + 1
        num_blocks = determine_num_blocks(config.kv_cache, self.hf_config, self.dtype, self.device, max_useful)
        self.kv_manager = KVCacheManager(num_blocks, page_size, config.kv_cache.enable_prefix_caching)
        self.kv_cache = self.allocate_kv_cache(num_blocks, page_size)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_batch_size=config.max_batch_size,
            max_batch_input_tokens=config.max_batch_input_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            kvcache_ce_watermark=config.kvcache_ce_watermark,
            max_queue_size=config.max_queue_size_tg,
        )
        self.kernels = load_kernels(config.kernel_backend, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kernels, Sampler(self.vocab_size, config.model.seed),
                                  self.device)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self._sequences: dict[str, Sequence] = {}
        logger.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens, kernels=%s",
            model_path, self.device, self.dtype, num_blocks, page_size, self.kernels.name,
        )

    def allocate_kv_cache(self, num_blocks: int, page_size: int) -> torch.Tensor:
        shape = kv_cache_shape(self.hf_config, num_blocks, page_size)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._sequences:
            raise RequestError(f"request_id: {request_id!r} is already running")
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_length)
        max_total = self.max_length
        if params.max_tokens is not None:
            max_total = min(max_total, len(prompt_token_ids) + params.max_tokens)
        seq = Sequence(request_id, list(prompt_token_ids), params, max_total_tokens=max_total)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq.sampling_state = SequenceSamplingState(
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=[],
            eos_token_ids=self.eos_token_ids,
            bad_words_token_ids=resolve_bad_words(self.tokenizer, params.bad_words),
            generator=generator,
        )
        self.scheduler.add(seq)  # may raise QueueFullError before anything is recorded
        self._sequences[request_id] = seq
        self.output_processor.add(seq)

    def abort_request(self, request_id: str) -> bool:
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT.value)
        self.output_processor.drop(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._sequences.get(request_id)

    # ------------------------------------------------------------------ step
    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        sampled = self.runner.execute(plan.chunks, self.kv_manager.block_table)
        token_ids = sampled.token_ids if sampled is not None else []
        advanced = self.scheduler.update(plan, token_ids)
        outputs: list[StepOutput] = []
        for i, seq in enumerate(advanced):
            token_id = token_ids[i]
            out = StepOutput(seq.request_id, [token_id])
            if seq.logprobs is not None and sampled.logprobs is not None:
                seq.logprobs.append(sampled.logprobs[i])
                out.new_logprobs = [sampled.logprobs[i]]
            stop = self.output_processor.check_stop(seq, token_id)
            if stop is not None:
                out.finish_reason, out.stop_reason = stop
                self._finish(seq, *stop)
            outputs.append(out)
        return outputs

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        self.scheduler.finish(seq, reason, stop_reason)
        self.output_processor.finalize_text(seq)
        del self._sequences[seq.request_id]

    @staticmethod
    def completion_output(seq: Sequence) -> CompletionOutput:
        return CompletionOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.text,
            finish_reason=seq.finish_reason,
            logprobs=seq.logprobs,
            stop_reason=seq.stop_reason,
        )
