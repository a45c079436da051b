"""HTTP body -> (prompt token ids, SamplingParams): tokenization and every check that answers 400/404.

Nothing here touches a worker: a request that fails a check never leaves the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import RouterConfig, SamplingConfig
from pipeline.generation_config import resolved_defaults
from pipeline.protocol import StructuredOutput
from pipeline.protocol.requests import SamplingParams
from pipeline.tokenizer import TokenizerError, apply_chat_template, encode_prompt
from router.chat_messages import check_text, template_messages, template_tools, walks_content_parts
from router.chat_output import ChatOutputFormat
from router.constraint_grammar import combined_constraint
from router.errors import APIError, bad_request, from_value_error
from router.openai_schema import ChatCompletionRequest, CompletionRequest, _SamplingFields
from router.reasoning import get_reasoning_parser
from router.served_model import ServedModel
from router.streaming import PromptRendering
from router.structured_output import (check_structured_output, constraint_param, is_a_response_format,
                                      structured_output_from)
from router.tool_calling import plan_tools


@dataclass
class PreparedRequest:
    """One prompt of a request, ready for a worker (a completions request with a list of prompts makes one each)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    want_logprobs: bool
    prompt: PromptRendering = field(default_factory=PromptRendering)
    continuous_usage: bool = False  # stream: usage so far in every chunk (vLLM's continuous_usage_stats)
    tokens_as_ids: bool = False  # logprob entries name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)
    chat_output: ChatOutputFormat | None = None  # chat: how the text becomes reasoning, content and tool calls
    priority: int = 0  # vLLM's: lower is served first (router/admission.py, workers under "priority")


def prepare_completion(body: CompletionRequest, model: ServedModel, defaults: SamplingConfig,
                       context_length: int | None = None) -> list[PreparedRequest]:
    """``context_length``: the longest sequence the live workers hold (``max_model_len``, as /v1/models says;
    None: the model's), which bounds the prompt and ``max_tokens`` and gives the default ``max_tokens``."""
    _check_model(body.model, model)
    _check_prompt_logprobs(body)
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens: must be >= 1 (0 only with echo=true, to score the prompt)", param="max_tokens")
    if body.best_of is not None and body.best_of != body.n and body.stream:
        raise bad_request("best_of: not available with stream=true (the best candidates are known only at the end)",
                          param="best_of")
    prepared = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            prompt_ids = encode_prompt(model.tokenizer, prompt)
        else:
            prompt_ids = list(prompt)
        _check_prompt_ids(prompt_ids, model, "prompt")
        # max_tokens 0 with echo: the worker runs the prompt and samples one token, which is not shown
        max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
        params = _sampling_params(body, model, defaults, len(prompt_ids), max_tokens, body.logprobs, "prompt",
                                  structured_output_from(body), context_length=context_length)
        echo_logprobs = body.logprobs if body.echo else None
        asked = [n for n in (echo_logprobs, body.prompt_logprobs) if n is not None]
        if asked:
            params.prompt_logprobs = max(asked)
        rendering = PromptRendering(
            token_ids=prompt_ids,
            echo_text=(prompt if isinstance(prompt, str) else model.tokenizer.decode(prompt_ids)) if body.echo else None,
            num_top_echo=echo_logprobs,
            num_top_prompt_logprobs=body.prompt_logprobs,
            discard_output=body.max_tokens == 0,
        )
        prepared.append(PreparedRequest(prompt_ids, params, body.stream, body.include_usage,
                                        body.logprobs is not None, rendering, body.continuous_usage,
                                        body.return_tokens_as_token_ids, priority=body.priority))
    return prepared


def _check_prompt_logprobs(body: _SamplingFields) -> None:
    if body.prompt_logprobs is None:
        return
    if not 0 <= body.prompt_logprobs <= 20:
        raise bad_request(f"prompt_logprobs: must be in [0, 20] (got {body.prompt_logprobs})", param="prompt_logprobs")
    if body.stream:
        raise bad_request("prompt_logprobs: not available when stream=true (use echo with logprobs to stream "
                          "the prompt's logprobs)", param="prompt_logprobs")


def prepare_chat(body: ChatCompletionRequest, model: ServedModel, defaults: SamplingConfig,
                 settings: RouterConfig | None = None, context_length: int | None = None) -> list[PreparedRequest]:
    """``settings``: the router's tool-call and reasoning parsers (default: inferred tool format, no reasoning);
    ``context_length``: as ``prepare_completion``'s."""
    settings = settings or RouterConfig()
    _check_model(body.model, model)
    _check_prompt_logprobs(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: requires logprobs=true", param="top_logprobs")
    tools = plan_tools(body, settings.tool_call_parser, body.chat_template or getattr(model.tokenizer, "chat_template",
                                                                                      None))
    prompt_ids = render_chat(model, body, template_tools(body.tools))
    _check_prompt_ids(prompt_ids, model, "messages")
    reasoning = get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None
    inside = False
    if reasoning is not None:
        prompt_text = model.tokenizer.decode(prompt_ids)
        if prompt_text.rstrip().endswith(reasoning.end):  # the template closed the thinking (enable_thinking false)
            reasoning = None
        else:
            inside = reasoning.starts_inside(prompt_text)
    output = ChatOutputFormat(tools.parser, reasoning, inside, body.include_reasoning, tools.is_named)
    requested = structured_output_from(body)
    if requested is not None and tools.forced is not None and is_a_response_format(body):
        # a forced call is the whole answer, so OpenAI's answer format has no text to shape in this turn (an agent
        # with an output type forcing a tool): it is checked, then the call grammar alone constrains
        check_structured_output(requested, model, defaults.structured_output_backend, "response_format")
        requested = None
    constraint = combined_constraint(requested, tools.call_grammar(model.tokenizer),
                                     reasoning.grammar_prefix(inside) if reasoning is not None else None,
                                     tools.calls_instead_of_answer(model.tokenizer) if is_a_response_format(body)
                                     else None)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.resolved_max_tokens()
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = _sampling_params(body, model, defaults, len(prompt_ids), max_tokens, logprobs, "messages", constraint,
                              renames={"logprobs": "top_logprobs", "max_tokens": max_tokens_param},
                              context_length=context_length)
    params.prompt_logprobs = body.prompt_logprobs
    if any(getattr(parser, "needs_special_tokens", False) for parser in (tools.parser, reasoning)):
        params.skip_special_tokens = False  # its markers are special tokens: the parser must see them
    rendering = PromptRendering(token_ids=prompt_ids, num_top_prompt_logprobs=body.prompt_logprobs)
    return [PreparedRequest(prompt_ids, params, body.stream, body.include_usage, body.logprobs, rendering,
                            body.continuous_usage, body.return_tokens_as_token_ids,
                            None if output.is_plain else output, priority=body.priority)]


def render_chat(model: ServedModel, body, tools: list[dict] | None) -> list[int]:
    """The chat's prompt ids through the checkpoint's (or the request's) template; 400 when it refuses."""
    template = body.chat_template or model.tokenizer.chat_template
    messages = template_messages(body.messages, walks_content_parts(template if isinstance(template, str) else None))
    try:
        return apply_chat_template(model.tokenizer, messages, **body.template_options(), tools=tools)
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from None
    except Exception as exc:  # a template may raise anything (jinja2 errors, raise_exception() calls)
        raise bad_request(f"messages: the chat template rejected them: {exc}", param="messages") from None


def _check_model(requested: str, model: ServedModel) -> None:
    if not model.serves(requested):
        raise APIError(
            404, f"The model `{requested}` does not exist. This server serves `{model.name}`.",
            param="model", code="model_not_found",
        )


def _check_prompt_ids(prompt_ids: list[int], model: ServedModel, param: str) -> None:
    if not prompt_ids:
        raise bad_request(f"{param}: must not be empty", param=param)
    bad = next((t for t in prompt_ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {model.vocab_size})", param=param)


def _sampling_params(
    body: _SamplingFields,
    model: ServedModel,
    defaults: SamplingConfig,
    num_prompt_tokens: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    structured: StructuredOutput | None,
    renames: dict[str, str] | None = None,
    context_length: int | None = None,
) -> SamplingParams:
    """``renames``: a ``SamplingParams`` field -> the request field the client set it with (chat: ``top_logprobs``
    sets ``logprobs``), so that a 400 names what the client sent. ``context_length``: the servable context (None:
    the model's)."""
    if body.stream_options is not None and not body.stream:  # as OpenAI and vLLM: options of a stream there is not
        raise bad_request("stream_options: only allowed when stream is true", param="stream_options")
    logit_bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias: keys must be token ids (got {key!r})", param="logit_bias") from None
        if not 0 <= token_id < model.vocab_size:
            raise bad_request(f"logit_bias: token id {token_id} is outside the vocabulary", param="logit_bias")
        logit_bias[token_id] = value
    for stop in body.stop_list():
        check_text(stop, "stop")
    stop_token_ids = list(body.stop_token_ids or [])
    if any(t >= model.vocab_size for t in stop_token_ids):
        raise bad_request("stop_token_ids: ids must be inside the vocabulary", param="stop_token_ids")
    context = model.max_length if context_length is None else context_length
    room = context - num_prompt_tokens if context else None
    if room is not None and room <= 0:
        raise bad_request(
            f"This model's maximum context length is {context} tokens, but the {prompt_param} has "
            f"{num_prompt_tokens} tokens; reduce the {prompt_param} to at most {context - 1} tokens.",
            param=prompt_param, code="context_length_exceeded",
        )
    if structured is not None:
        check_structured_output(structured, model, defaults.structured_output_backend, constraint_param(body))
    unset = resolved_defaults(defaults, model.generation_config, serving=True)  # operator's, else the checkpoint's
    explicit = max_tokens is not None
    if not explicit:  # None: the rest of the context
        max_tokens = unset["max_tokens"] if room is None else min(unset["max_tokens"] or room, room)

    def given_or_default(name: str):
        value = getattr(body, name)
        return unset[name] if value is None else value

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            n=body.n,
            best_of=getattr(body, "best_of", None),
            temperature=given_or_default("temperature"),
            top_p=given_or_default("top_p"),
            top_k=given_or_default("top_k"),
            min_p=given_or_default("min_p"),
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            repetition_penalty=given_or_default("repetition_penalty"),
            logit_bias=logit_bias,
            skip_special_tokens=body.skip_special_tokens,
            structured_output=structured,
        )
    except ValueError as exc:
        raise renamed(from_value_error(exc), renames or {}) from None
    if explicit and room is not None and max_tokens > room:
        max_tokens_param = (renames or {}).get("max_tokens", "max_tokens")  # as the client named it
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, {max_tokens} "
            f"for the completion). Please reduce the length of the {prompt_param} or {max_tokens_param}.",
            param=max_tokens_param, code="context_length_exceeded",
        )
    return params


def renamed(error: APIError, renames: dict[str, str]) -> APIError:
    """``error`` naming the request's own field where ``renames`` maps the internal one to it (param and the
    message's ``"field: ..."`` prefix alike)."""
    new_name = renames.get(error.param or "")
    if new_name is not None:
        if error.message.startswith(f"{error.param}:"):
            error.message = new_name + error.message[len(error.param):]
        error.param = new_name
    return error
