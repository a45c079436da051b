"""The offline API: ``LLM(model=PATH, **overrides).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence as SequenceType

from pipeline.config import PipelineConfig
from pipeline.engine import LLMEngine
from pipeline.generation_config import resolved_defaults
from pipeline.prompt_logprobs import as_dicts
from pipeline.sequence import Sequence
from pipeline.protocol import CompletionOutput, SamplingParams
from pipeline.tokenizer import encode_prompt

PromptInput = str | list[int]


class LLM:
    """Runs the whole pipeline in-process.

    ``overrides`` are PipelineConfig fields by name, nested sections as dicts, e.g.
    ``LLM(model=p, max_batch_input_tokens=16, kv_cache={"page_size": 4, "num_blocks": 64})``.
    ``model=None`` loads the built-in random-weight model; the ``model`` section's other fields go in
    ``model_config={"dtype": ...}``; ``config_file``/``section_name`` read a file section first.
    Invalid values raise ``ConfigError``.
    """

    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        model_section = dict(overrides.pop("model_config", None) or {})
        if model is not None:
            model_section["model_path"] = str(model)
        if model_section:
            overrides["model"] = model_section
        config_file = overrides.pop("config_file", None)
        section_name = overrides.pop("section_name", None)
        self.config = PipelineConfig.load(config_file, section_name, overrides=overrides)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel rank processes, if any (also done when the LLM is garbage-collected and
        at exit). Idempotent; a no-op with ``tensor_parallel_size`` = 1."""
        self.engine.close_ranks()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptInput | SequenceType[PromptInput],
        sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
        on_finished: Callable[[CompletionOutput], None] | None = None,
        priority: SequenceType[int] | None = None,
    ) -> list[CompletionOutput]:
        """One output per prompt, in prompt order. A prompt is a string or a list of token ids. With
        ``n`` > 1 (or ``best_of``) the output is choice 0 and ``output.choices`` holds every choice.

        ``on_finished`` is called as each request completes (progress bars, streaming to a file).
        ``priority`` (vLLM's): one per prompt, lower served first under ``scheduling_policy = "priority"``.
        A bad prompt raises before generation starts; on any error every request of the call is
        aborted, so nothing stays queued and no KV block stays held.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams(**resolved_defaults(self.config.sampling, self.engine.generation_config))
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts")
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority: got {len(priorities)} for {len(prompt_list)} prompts")
        token_lists = [p if isinstance(p, list) else encode_prompt(self.tokenizer, p) for p in prompt_list]
        request_ids = [f"offline-{next(self._ids)}" for _ in token_lists]
        choices = {}
        try:
            for request_id, token_ids, params, level in zip(request_ids, token_lists, params_list, priorities):
                self.engine.add_request(request_id, token_ids, params, priority=level)
                choices[request_id] = self.engine.get_choices(request_id)
            pending = set(request_ids)
            while pending:
                for out in self.engine.step():
                    if out.request_finished:
                        pending.discard(out.request_id)
                        if on_finished is not None:
                            on_finished(_output(choices[out.request_id]))
            while self.engine.has_pending_outputs():  # overlap: a step launched for requests that ended
                self.engine.step()
        finally:
            for request_id in request_ids:  # on any error (or Ctrl-C) nothing stays queued or holds blocks
                self.engine.abort_request(request_id)
        return [_output(choices[r]) for r in request_ids]


def completion_output(seq: Sequence) -> CompletionOutput:
    """One choice's result, offline (vLLM's shapes)."""
    return CompletionOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=seq.output_token_ids,
        text=seq.text,
        finish_reason=seq.finish_reason,
        logprobs=seq.logprobs,
        stop_reason=seq.stop_reason,
        prompt_logprobs=None if seq.prompt_logprobs is None else as_dicts(seq.prompt_logprobs, seq.prompt_token_ids),
        index=seq.index,
        cumulative_logprob=None if seq.logprobs is None else sum(
            entry.get(token, float("-inf")) for entry, token in zip(seq.logprobs, seq.output_token_ids)),
    )


def _output(choices: list[Sequence]) -> CompletionOutput:
    outputs = [completion_output(seq) for seq in choices]
    params = choices[0].params
    if params.best_of is not None:  # the n most likely candidates, most likely first
        outputs = sorted(outputs, key=lambda o: -o.cumulative_logprob)[:params.n]
        for index, output in enumerate(outputs):
            output.index = index
    if len(outputs) > 1:
        outputs[0].choices = outputs
    return outputs[0]


def _as_prompt_list(prompts: PromptInput | SequenceType[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single prompt given as token ids
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))):
            raise ValueError(f"prompts[{i}]: must be a string or a list of token ids (got {type(p).__name__})")
    return prompts
