"""LLMEngine: the step loop of one worker (tokenizer, model, KV manager, scheduler, runner, sampler).

``add_request`` validates and queues; ``step`` schedules one batch, runs it and returns what each
request produced in that step; ``abort_request`` ends a request and frees its blocks at once (the requests
it knows, and how one ends, live in ``pipeline/request_table.py``; what each sampled token becomes, in
``pipeline/token_emission.py``).
The offline ``LLM`` and the workers drive it. KV that arrives from another worker or leaves for one
(P/D, live migration, prefix warm-ups) passes ``engine.kv`` (``pipeline/kv_port.py``), the narrow door the
connector halves in ``kv_transfer/connector`` see and nothing else.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Container

import msgspec
import torch

from kernels import load_kernels
from pipeline.builtin_model import BUILTIN_NOTICE, builtin_model_path
from pipeline.checkpoint_files import read_config_json, stated_dtype
from pipeline.config import ConfigError, PipelineConfig
from pipeline.execution_stream import ExecutionStream
from pipeline.generation_config import generation_eos_ids, read_generation_config
from pipeline.host_memory import keep_freed_memory
from pipeline.kv_pool import build_kv_pool, servable_length
from pipeline.kv_port import KVPort
from pipeline.model_runner import TORCH_DTYPES, ModelRunner
from pipeline.output_processor import OutputProcessor
from pipeline.overlap import InFlightStep
from pipeline.protocol import SamplingParams
from pipeline.protocol.requests import sibling_params
from pipeline.protocol.cluster import WorkerLoad
from pipeline.request_table import RequestTable
from pipeline.request_validation import RequestError, validate_request
from pipeline.sampler import Sampler
from pipeline.scheduler import Scheduler
from pipeline.sequence import Sequence
from pipeline.sequence_builder import SequenceBuilder
from pipeline.step_execution import StepExecutor
from pipeline.step_output import StepOutput
from pipeline.token_emission import TokenEmitter
from pipeline.tokenizer import eos_token_ids, load_tokenizer
from pipeline.weights import load_model

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "StepOutput", "RequestError"]


class LLMEngine:
    def __init__(self, config: PipelineConfig, kv_cache_allocator=None) -> None:
        """``kv_cache_allocator(shape, dtype, device)`` places the KV cache (e.g. in shared memory
        for the same-host transfer transport); default: a plain zeroed tensor."""
        self.config = config
        self.is_builtin_model = config.model.model_path is None
        model_path = str(builtin_model_path()) if self.is_builtin_model else config.model.model_path
        if self.is_builtin_model:
            logger.warning(BUILTIN_NOTICE)
        self.model_path = model_path
        self.device = config.model.resolved_device()
        self.dtype = TORCH_DTYPES[config.model.resolved_dtype(stated_dtype(read_config_json(model_path)))]
        self.kernels = load_kernels(config.kernel_backend, self.device)  # a backend this device cannot run: say so now
        torch.manual_seed(config.model.seed)

        if config.tensor_parallel_size > 1:  # ranks 1..N-1 start here; torch.distributed only on this path
            from pipeline.parallel import load_tensor_parallel_model

            self.model, self.hf_config = load_tensor_parallel_model(config, model_path, self.dtype, self.device)
        else:
            self.model, self.hf_config = load_model(model_path, self.dtype, self.device, config.model.quantization)
        self.rank_driver = getattr(self.model, "driver", None)  # tensor parallelism: ranks 1..N-1; None with one rank
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size = self.hf_config.vocab_size
        self.max_length = min(config.max_length or 10**9, self.hf_config.max_position_embeddings)
        if not config.enable_chunked_prefill and config.max_batch_input_tokens < self.max_length:
            # a prompt longer than one step could never be scheduled (PipelineConfig checks an explicit max_length)
            raise ConfigError(
                f"max_batch_input_tokens: must be >= max_length when enable_chunked_prefill is false (got "
                f"{config.max_batch_input_tokens} < {self.max_length}, the model's limit); raise "
                "max_batch_input_tokens, set a smaller max_length, or enable chunked prefill")
        self.generation_config = read_generation_config(model_path)
        # EOS ids listed only in generation_config.json end generation too, as in transformers' generate
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.hf_config) | generation_eos_ids(self.generation_config)

        self.draft = self._load_draft() if config.is_speculative else None
        num_lookahead = config.speculative.num_speculative_tokens
        pool = build_kv_pool(config, self.hf_config, self.draft, self.max_length, self.dtype, self.device,
                             kv_cache_allocator)
        self.kv_manager, self.kv_cache, self.draft_kv_cache = pool.manager, pool.kv_cache, pool.draft_kv_cache
        self.max_length = servable_length(self.kv_manager, self.max_length, num_lookahead)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_batch_size=config.max_batch_size,
            max_batch_input_tokens=config.max_batch_input_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            kvcache_ce_watermark=config.kvcache_ce_watermark,
            max_queue_size=config.max_queue_size_tg,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_prefill_tokens_beside_decodes=config.max_prefill_tokens_beside_decodes,
            num_lookahead_tokens=num_lookahead,
            warmup_chunk_tokens=config.kv_cache.warmup_chunk_tokens,
            scheduling_policy=config.scheduling_policy,
        )
        if self.device == "cpu" and config.cpu_keep_freed_memory:
            keep_freed_memory()
        for model in {id(m): m for m in (self.model, self.draft.model if self.draft else None) if m}.values():
            self.kernels.prepare_model(model, config.model.cpu_weight_prepack)
        # named for what preparing chose (CPU: routes) and for what this model runs
        self.kernels = load_kernels(config.kernel_backend, self.device, self.dtype,
                                    latent_attention=getattr(self.hf_config, "kv_lora_rank", None) is not None)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kernels, Sampler(self.vocab_size, config.model.seed),
                                  self.device, max_num_reqs=config.max_batch_size, max_model_len=self.max_length)
        if str(self.device).startswith("cuda") and not config.enforce_eager and self.rank_driver is None:
            from pipeline.cuda_graphs import capture_decode_graphs

            self.runner.graphs = capture_decode_graphs(self.model, self.kv_cache, self.kernels, self.device,
                                                       config.max_batch_size, self.runner.buffer.block_table.shape[1])
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.speculator = None  # pipeline/speculative: the draft proposes, one target forward verifies
        if self.draft is not None:
            from pipeline.speculative.decoder import SpeculativeDecoder

            self.speculator = SpeculativeDecoder(self.runner, self.draft, self.draft_kv_cache, num_lookahead)
        self._grammars = None  # pipeline/structured_output BackendSet, built on the first structured request
        # each sequence by id, each request's choices, prefill-only requests held for shipping; ends them
        self.requests = RequestTable(self.scheduler, self.runner, self.kv_manager, self.output_processor)
        self.emitter = TokenEmitter(self.requests, self.output_processor)  # what each sampled token becomes
        self.kv = KVPort(self.kv_manager, self.kv_cache, self.scheduler, self.requests, self.emitter, self.model,
                         self.hf_config, self.rank_driver)  # KV that crosses workers (P/D, migration, warm-ups)
        self.last_plan = None  # the plan of the step whose outputs the last step() returned
        self.num_prompt_tokens_computed = 0  # cumulative: prompt tokens run through the model (not cached ones)
        self.num_warmup_tokens_computed = 0  # cumulative: tokens prefix warm-ups ran through the model
        self._num_warmups = 0
        # Overlap pipeline (pipeline/overlap.py): steps run on the execution stream, read one step late.
        self.stream = ExecutionStream(self.device) if config.enable_overlap_scheduler else None
        if self.stream is not None and not str(self.device).startswith("cuda"):
            logger.warning("enable_overlap_scheduler on CPU: measured slower than off here (the host's work and the "
                           "model's Python share one interpreter lock); see docs/overlap.md")
        self._in_flight: InFlightStep | None = None
        self.executor = StepExecutor(self.scheduler, self.runner, self.kv_manager, self.speculator, self.stream)
        self.sequence_builder = SequenceBuilder(self.tokenizer, self.vocab_size, self.max_length, self.eos_token_ids,
                                                self.device, is_speculative=self.speculator is not None)
        from pipeline.quantization.loading import describe_quantized_layers

        logger.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens, kernels=%s, quantized layers: %s",
            model_path, self.device, self.dtype, pool.num_blocks, config.kv_cache.page_size, self.kernels.name,
            describe_quantized_layers(self.model),
        )

    def _load_draft(self):
        from pipeline.speculative.draft import load_draft_model

        return load_draft_model(self.config.draft_model.model_path, self.model_path, self.model, self.hf_config,
                                self.tokenizer, self.dtype, self.device, self.max_length)

    def model_fingerprint(self) -> str:
        """Which weights this worker's KV comes from (target, and draft when speculating): P/D peers must agree."""
        from pipeline.weights import checkpoint_fingerprint

        fingerprint = checkpoint_fingerprint(self.model_path)
        return fingerprint if self.draft is None else f"{fingerprint}+draft:{self.draft.fingerprint()}"

    # -------------------------------------------------------------- tensor-parallel ranks
    @property
    def rank_pids(self) -> list[int]:
        """Pids of tensor-parallel ranks 1..N-1 (this process is rank 0); none with ``tensor_parallel_size`` 1."""
        return self.rank_driver.pids if self.rank_driver is not None else []

    def check_ranks(self) -> None:
        """``TensorParallelError`` naming every rank that exited (a no-op with one rank): a worker checks
        between steps too, so a rank that dies while it idles takes it down at once, not at the next request."""
        if self.rank_driver is not None:
            self.rank_driver.check_alive()

    def close_ranks(self, has_failed: bool = False) -> None:
        """Stop the tensor-parallel ranks 1..N-1, if any: asked, then killed after a grace (none when
        ``has_failed``: a rank died or hung, the group cannot run another step). Idempotent."""
        if self.rank_driver is not None:
            self.rank_driver.close(grace_s=0.0) if has_failed else self.rank_driver.close()

    # -------------------------------------------------------------- requests
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        prefill_only: bool = False, remote_prefill: bool = False, resume_token_ids: list[int] | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. ``prefill_only`` (PrefillOnly role): stop after the first token and keep
        the blocks until ``kv.release_blocks``. ``remote_prefill`` (DecodeOnly role): another worker
        prefills; see ``kv.reserve_remote`` and ``kv.activate_remote``. ``resume_token_ids``: output tokens
        another worker already produced (a migrated request): they are outputs, not prompt (penalties,
        lengths, seeds per position and the grammar see them so), computed here like a preempted
        request's (with ``remote_prefill``: their KV comes from the worker that produced them, see
        ``kv.activate_migrated``), and generation goes on after them. ``priority`` (vLLM's: lower is served
        first) orders admission and preemption under ``scheduling_policy = "priority"``."""
        if request_id in self.requests:
            raise RequestError(f"request_id: {request_id!r} is already running")
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_length)
        if params.best_of is not None and params.logprobs is None:  # candidates are ranked by their logprobs
            params = msgspec.structs.replace(params, logprobs=0)
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only)
        seq.priority = priority
        if resume_token_ids:
            self.sequence_builder.resume(seq, resume_token_ids, prefill_only)
        # n > 1 (not on a prefill-only worker, which computes the prompt once for the decode worker):
        # the other choices start once this one's prompt KV is written, sharing its blocks (TokenEmitter.emit)
        siblings = [] if prefill_only else [
            self._new_sequence(f"{request_id}/{i}", prompt_token_ids, sibling_params(params, i), False, request_id, i)
            for i in range(1, params.num_sequences)]
        # May raise QueueFullError before anything is recorded.
        (self.scheduler.add_remote if remote_prefill else self.scheduler.add)(seq)
        self.requests.add(request_id, [seq, *siblings])

    def _new_sequence(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams, prefill_only: bool,
                      family_id: str | None = None, index: int = 0) -> Sequence:
        grammar = self._grammar_matcher(params) if params.structured_output is not None else None
        return self.sequence_builder.build(seq_id, prompt_token_ids, params, prefill_only, grammar, family_id, index)

    def warm_prefix(self, token_ids: list[int], num_computed_here: int = 0) -> bool:
        """Queue a prefix warm-up of ``token_ids`` (``pipeline/prefix_warmup.py``): their full blocks are
        computed into the prefix cache in steps with nothing else to run. ``num_computed_here``: the leading
        tokens this worker computed itself (a turn's prompt); a warm-up extends them only while the cache
        still holds them (if it evicted them, the pool is short: warming would evict more). False (nothing
        queued) when the prefix cache is off, already holds them all, or no longer holds what it computed."""
        planned = self.scheduler.warmups.plan(token_ids, num_computed_here)
        if planned is None:
            return False
        tokens, num_cached = planned
        params = SamplingParams(max_tokens=1, temperature=0.0)
        try:
            validate_request(tokens, params, self.vocab_size, self.max_length)
        except RequestError:  # not this model's token ids, or longer than it takes
            return False
        self._num_warmups += 1
        seq = self._new_sequence(f"warmup-{self._num_warmups}", tokens, params, prefill_only=True)
        seq.num_cached_tokens = num_cached  # it must still find these cached when it runs, or it is dropped
        self.scheduler.add_warmup(seq)
        return True

    def get_choices(self, request_id: str) -> list[Sequence]:
        """Every choice of a request (n > 1: index order), finished or not, while the request is known."""
        return self.requests.members(request_id)

    def _grammar_matcher(self, params: SamplingParams):
        """A matcher for the request's constraint (compiled once per distinct constraint); a bad one is a RequestError."""
        from pipeline.structured_output.backend import BackendSet, StructuredOutputError

        try:
            if self._grammars is None:
                self._grammars = BackendSet(self.tokenizer, self.vocab_size,
                                            self.config.sampling.structured_output_backend)
            return self._grammars.matcher(params.structured_output)
        except StructuredOutputError as exc:
            raise RequestError(str(exc)) from None

    def abort_request(self, request_id: str, keep_blocks: bool = False) -> bool:
        """End a request (every choice of it) wherever it is (queued, reserved, running or held) and free
        its blocks (``keep_blocks``: hold them until ``kv.release_blocks``, e.g. while a transfer still reads them)."""
        return self.requests.abort_request(request_id, keep_blocks)

    def abort_choice(self, request_id: str, index: int) -> bool:
        """End one choice of an n > 1 request (the router stopped it on a stop string); the others go on."""
        return self.requests.abort_choice(request_id, index)

    def load(self, **transfer_counters) -> WorkerLoad:
        """This worker's load report for the router (prefix-cached unheld blocks count as free)."""
        scheduler = self.scheduler
        return WorkerLoad(
            num_queued_prefill_tokens=scheduler.num_queued_prefill_tokens,
            num_running=len(scheduler.running) + len(scheduler.reserved),
            num_waiting=len(scheduler.waiting) + len(scheduler.waiting_remote),
            num_free_blocks=self.kv_manager.num_free_blocks,
            num_used_blocks=self.kv_manager.num_used_blocks,
            num_total_blocks=self.kv_manager.num_total_blocks,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_warmup_tokens_computed=self.num_warmup_tokens_computed,
            **transfer_counters,
            **(self.speculator.stats.load_fields() if self.speculator is not None else {}),
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    def has_pending_outputs(self) -> bool:
        """Whether a launched step has not been read yet (overlap pipeline); ``step()`` reads it."""
        return self._in_flight is not None

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    # ------------------------------------------------------ KV moves across workers
    # ``self.kv`` (pipeline/kv_port.py) is the door for KV that crosses workers. What stays here reads the
    # step loop's own state: the chunks of the last step, and the step in flight a drain's pause must read.
    def kv_written_last_step(self) -> list[tuple[str, int]]:
        """For each chunk of the step whose outputs the last ``step()`` returned: (request id, number of its
        leading tokens whose KV is now written)."""
        plan = self.last_plan
        return [] if plan is None else [(c.seq.request_id, c.start + c.num_tokens) for c in plan.chunks]

    def pause_decoding(self, skip: Container[str] = ()) -> tuple[list[StepOutput], list[Sequence]]:
        """Live migration on drain: stop decoding every single-choice request that is decoding (its KV
        then covers every token but the last, which it emitted), keeping its blocks for the handoff;
        requests in ``skip`` go on. Returns the outputs of a step still in flight (read first, so nothing
        is computed past them) and the requests paused now; ``kv.resume_paused`` or ``abort_request`` ends
        a pause."""
        def pausable() -> list[Sequence]:
            return [seq for seq in self.scheduler.running
                    if seq.params.num_sequences == 1 and not seq.is_prefill_only and seq.request_id not in skip
                    and seq.num_output_tokens > 0]
        if not pausable():
            return [], []
        outputs = self._read(self._take_in_flight()) if self._in_flight is not None else []
        paused = [seq for seq in pausable() if seq.num_computed_tokens == seq.num_tokens - 1]
        for seq in paused:
            self.scheduler.pause(seq)
            self.runner.forget(seq.request_id)  # back as a new row of the persistent batch, if resumed
        return outputs, paused

    def has_runnable_work(self) -> bool:
        """Whether the next ``step()`` has something to run or read (so a worker must not sleep on its sockets)."""
        scheduler = self.scheduler
        return bool(scheduler.running or scheduler.waiting or scheduler.has_warmups or self._in_flight is not None)

    # ------------------------------------------------------------------ step
    def step(self) -> list[StepOutput]:
        """Run one scheduled batch; what each request produced. ``last_plan`` keeps the chunks run.

        Overlap on: launch this step and return the previous one's outputs (the first call returns
        nothing; a call with nothing to schedule drains the step in flight)."""
        if self.stream is None:
            return self._step_at_once()
        outputs: list[StepOutput] = []
        if self._in_flight is not None and self._in_flight.needs_host_tokens:
            outputs += self._read(self._take_in_flight())  # the next batch reads these tokens on the host
        plan = self._schedule()
        previous = self._take_in_flight()
        previous_read = Future()  # grammar masks of this step wait for it: their matchers take the previous tokens
        try:
            if not plan.is_empty:
                self._in_flight = self.executor.launch(plan, previous_read)
            if previous is not None:
                outputs += self._read(previous)
            elif not outputs:
                self.last_plan = None
        except BaseException:  # a step failed: the next call starts clean, with no step launched on its tokens
            previous_read.set_result(None)
            for unread in (self._take_in_flight(), previous):  # neither is read: wait till the stream is free
                if unread is not None:
                    unread.wait_and_drop()
            self.runner.forget_launched()
            raise
        finally:
            if not previous_read.done():
                previous_read.set_result(None)  # also on an error: the execution stream must never wait forever
        return outputs

    def _schedule(self):
        plan = self.scheduler.schedule()
        for chunk in plan.chunks:  # prompt positions run through the model (a cached prefix never is)
            num_computed = max(0, min(chunk.start + chunk.num_tokens, chunk.seq.num_prompt_tokens) - chunk.start)
            if chunk.seq.is_warmup:
                self.num_warmup_tokens_computed += num_computed
            else:
                self.num_prompt_tokens_computed += num_computed
        for seq in plan.preempted:  # readmitted later with new blocks: a new row of the persistent batch
            self.runner.forget(seq.request_id)
        # warm-ups that ended since (complete, or dropped for real work) leave the persistent batch before
        # this step takes rows: every step schedules first, so this is the one place that frees theirs
        for seq in self.scheduler.warmups.take_finished():
            self.runner.forget(seq.request_id)
        return plan

    def _step_at_once(self) -> list[StepOutput]:
        plan = self._schedule()
        self.last_plan = plan
        if plan.is_empty:
            return []
        return self.executor.run_at_once(plan, self.emitter.emit, self.emitter.emit_tokens)

    def _take_in_flight(self) -> InFlightStep | None:
        step, self._in_flight = self._in_flight, None
        return step

    def _read(self, step: InFlightStep) -> list[StepOutput]:
        """Wait for ``step``, fill its placeholders, publish its blocks, and run stop checks one step late."""
        result = step.future.result()
        self.last_plan = step.plan
        self.scheduler.register(step.plan)
        outputs: list[StepOutput] = []
        for row, (seq, position) in enumerate(zip(step.sampled, step.positions)):
            if seq.is_finished or self.requests.get(seq.request_id) is not seq:
                continue  # aborted while in flight: its blocks are already free, its token is dropped
            token_id = result.token_ids[row]
            seq.fill_token(position, token_id)
            logprobs = result.logprobs[row] if result.logprobs is not None else None
            outputs.append(self.emitter.emit(seq, token_id, logprobs, num_tokens=position + 1))
        return outputs
