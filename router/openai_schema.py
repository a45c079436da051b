"""Pydantic bodies of POST /v1/completions and /v1/chat/completions (types only; values are checked
when they become SamplingParams). A field this server does not know is a 400 that names it: every
accepted field is honoured, and nothing a client asks for is dropped silently."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

# an integer a worker's frame carries (msgpack: 64 bits); past that, a 400 naming the field instead of a request
# admitted and then failing its dispatch
Int64 = Annotated[StrictInt, Field(ge=-2**63, le=2**63 - 1)]


class RequestBody(BaseModel):
    """A request body (or a part of one): an unknown field is a 400 naming it, and ``null`` is "not set"."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit ``null`` asks for nothing, as OpenAI and vLLM read it: on a field with a default it is that
        default (clients send ``"n": null`` for an argument they left alone), on a field this server does not
        know it is dropped (``refusal``, ``audio`` and ``function_call`` are null in every assistant message an
        SDK's ``model_dump()`` gives back). A field whose default is None keeps its null."""
        if not isinstance(data, dict) or None not in data.values():
            return data
        known = {field.alias or name: field for name, field in cls.model_fields.items()}
        return {key: value for key, value in data.items()
                if value is not None or (key in known and (known[key].is_required() or known[key].default is None))}


class StreamOptions(RequestBody):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(RequestBody):
    """``response_format.json_schema``: OpenAI's fields ("strict" is honoured either way: the schema is enforced)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(RequestBody):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extras."""

    model: str
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None  # as vLLM takes it
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the caller's end user, for the operator's logs; OpenAI's abuse-monitoring id
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    return_tokens_as_token_ids: StrictBool = False  # logprob entries name tokens "token_id:N"
    prompt_logprobs: StrictInt | None = None  # per prompt position: the prompt's token and the top N
    priority: Int64 = 0  # lower is served first: the router's admission queue, workers under "priority"
    # structured output (router/structured_output.py): OpenAI's, then vLLM's
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


PromptType = Union[str, list[StrictInt], list[str], list[list[StrictInt]]]


MAX_PROMPTS_PER_REQUEST = 1024


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > MAX_PROMPTS_PER_REQUEST:
                raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request (got {len(value)})")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids (a batch is fanned out, vLLM's choice order)."""
        value = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return list(value)
        return [value]

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value


class TextContentPart(RequestBody):
    type: Literal["text"]
    text: str


class FunctionCall(RequestBody):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallItem(RequestBody):
    """A call an earlier assistant turn made (``message.tool_calls[i]`` of a response, sent back)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: which call this result answers
    reasoning_content: str | None = None  # assistant: its thinking, for templates that render it

    def text(self) -> str:
        """The content as one string: text parts joined by newlines, as vLLM gives them to a template that takes a
        string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None  # the arguments must follow ``parameters`` (a grammar enforces it)


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatTemplateOptions(BaseModel):
    """How the chat becomes a prompt (vLLM's fields), shared by /v1/chat/completions and /tokenize."""

    model_config = ConfigDict(extra="forbid")

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # the last message stays open: the model continues it
    chat_template: str | None = None  # replaces the checkpoint's template
    chat_template_kwargs: dict[str, Any] | None = None  # reach the template, e.g. {"enable_thinking": false}

    def template_options(self) -> dict[str, Any]:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "chat_template": self.chat_template,
                "template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(ChatTemplateOptions, _SamplingFields):
    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: StrictBool = True  # False: at most one call per answer
    include_reasoning: StrictBool = True  # vLLM: False leaves reasoning_content null (the thinking still happens)
    store: StrictBool | None = None  # nothing is stored: only false is honoured
    modalities: list[Literal["text"]] | None = None

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("this server keeps no completions; send store false or leave it out")
        return value

    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
