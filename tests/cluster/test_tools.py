"""Tool calling, the Responses API and the clients agents use (the official openai SDK, the OpenAI Agents SDK,
LangChain, LiteLLM) against real clusters, colocated and 1P1D, on a tiny checkpoint whose chat template renders
tools the way Qwen's does (``tests/tool_checkpoint.py``).

The model's weights are random, so it never chooses a call by itself: ``required`` and named calls are
forced by the tool grammar (and must always parse and validate), and an ``auto`` answer that is a call
is forced here with a regex, which is how the parser's path through the cluster is exercised.
"""

from __future__ import annotations

import enum
import json
import os
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.cluster.conftest import CLUSTER_CONFIG, openai_client, running_cluster, wait_for_idle_blocks
from tests.tool_checkpoint import build_tool_checkpoint

openai_agents = None  # the OpenAI Agents SDK (test extras), imported by its test (3 s of every worker's collection)

pytest.importorskip("llguidance")

NUM_BLOCKS = CLUSTER_CONFIG["kv_cache"]["num_blocks"]
WEATHER_ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME_ARGS = {"type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME_ARGS}}]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SHAPES = {"colocated": dict(num_prefill=0, num_decode=0, num_colocated=1), "1p1d": dict(num_prefill=1, num_decode=1)}


@pytest.fixture(scope="module")
def tool_checkpoint(tmp_path_factory):
    return str(build_tool_checkpoint(tmp_path_factory.mktemp("tool-ckpt")))


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, tool_checkpoint, tmp_path_factory):
    with running_cluster(tool_checkpoint, tmp_path_factory.mktemp(f"tools-{request.param}"),
                         **SHAPES[request.param]) as c:
        yield c
        wait_for_idle_blocks(c.url, c.worker_names, NUM_BLOCKS)


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


@pytest.fixture(scope="module")
def tokenizer(tool_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_checkpoint)


def name(client) -> str:
    return client.models.list().data[0].id


def check_calls(calls, allowed=SCHEMAS) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def hf_prompt_length(tokenizer, messages, tools) -> int:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tools_and_tool_turns_render_as_transformers_does(client, tokenizer):
    with_tools = client.chat.completions.create(model=name(client), messages=ASK, tools=TOOLS, max_tokens=1,
                                                tool_choice="none")
    without = client.chat.completions.create(model=name(client), messages=ASK, max_tokens=1)
    assert with_tools.usage.prompt_tokens == hf_prompt_length(tokenizer, ASK, TOOLS)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None
    arguments = {"city": "Paris", "days": 2}
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = client.chat.completions.create(model=name(client), messages=turns, tools=TOOLS, max_tokens=1)
    hf_turns = turns[:1] + [dict(turns[1], tool_calls=[{"type": "function", "function": {
        "name": "get_weather", "arguments": arguments}}])] + turns[2:]  # transformers' form: the arguments as an object
    assert out.usage.prompt_tokens == hf_prompt_length(tokenizer, hf_turns, TOOLS)


@pytest.mark.parametrize("seed, temperature", [(None, 0.0), (3, 1.0), (4, 1.0)])
def test_required_and_named_calls_always_parse_and_validate(client, seed, temperature):
    common = dict(model=name(client), messages=ASK, tools=TOOLS, max_tokens=80, seed=seed, temperature=temperature,
                  parallel_tool_calls=False)
    required = client.chat.completions.create(tool_choice="required", **common)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}}, **common)
    assert named.choices[0].finish_reason == "stop"  # OpenAI's answer for a named function
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_calls([call])


def test_parallel_calls_each_validate(client):
    out = client.chat.completions.create(model=name(client), messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=200, temperature=1.0, seed=11)
    choice = out.choices[0]
    check_calls(choice.message.tool_calls)
    assert choice.finish_reason in ("tool_calls", "length")


def test_streamed_tool_calls_add_up_to_the_whole_answer(client):
    common = dict(model=name(client), messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                  temperature=1.0, seed=5)
    whole = client.chat.completions.create(**common).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **common):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:  # a call's first delta names it
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            assert not choice.delta.content
            finish = choice.finish_reason or finish
    assert finish == whole.finish_reason
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                for c in whole.message.tool_calls]
    with client.chat.completions.stream(**common) as stream:  # the SDK's own accumulator agrees
        final = stream.get_final_completion().choices[0].message
    assert [(c.function.name, c.function.arguments) for c in final.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_an_auto_answer_that_is_a_call_is_parsed(client):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    regex = text.replace("{", "\\{").replace("}", "\\}")
    for stream in (False, True):
        out = client.chat.completions.create(model=name(client), messages=ASK, tools=TOOLS, max_tokens=200,
                                             stream=stream, extra_body={"structured_outputs": {"regex": regex}})
        if stream:
            chunks = list(out)
            arguments = "".join(d.function.arguments or "" for c in chunks for ch in c.choices
                                for d in ch.delta.tool_calls or ())
            assert json.loads(arguments) == {"city": "Oslo", "days": 3}
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            continue
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls[0].function.name == "get_weather"
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 3}
    plain = client.chat.completions.create(model=name(client), messages=ASK, tools=TOOLS, max_tokens=60,
                                           extra_body={"structured_outputs": {"regex": "[a-z ]{5,20}"}})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


def test_a_call_and_its_result_continue_the_conversation(client):
    first = client.chat.completions.create(model=name(client), messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0, parallel_tool_calls=False)
    message = first.choices[0].message
    turns = ASK + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21 C"}]
    second = client.chat.completions.create(model=name(client), messages=turns, tools=TOOLS, max_tokens=5)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


class GetWeather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


def test_strict_tools_under_auto_hold_a_call_to_its_schema(client, tokenizer):
    """The SDK's ``parse`` with ``pydantic_function_tool`` (strict) and tool_choice auto: the model may
    write text, but once it opens a call the grammar holds it to the schema. The bias makes it open one."""
    tool = openai.pydantic_function_tool(GetWeather)
    assert tool["function"]["strict"] is True
    marker = tokenizer.convert_tokens_to_ids("<tool_call>")
    out = client.chat.completions.parse(model=name(client), messages=ASK, tools=[tool], max_tokens=120,
                                        temperature=0, parallel_tool_calls=False, logit_bias={str(marker): 100})
    [call] = out.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather) and out.choices[0].finish_reason == "tool_calls"
    free = client.chat.completions.create(model=name(client), messages=ASK, tools=[tool], max_tokens=8,
                                          temperature=0, logit_bias={str(marker): -100})  # text is allowed too
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content


def test_a_forced_call_beside_an_answer_format_is_the_call(client):
    """An agent with an output type that forces a tool sends both: the call is the answer (OpenAI's reading)."""
    out = client.chat.completions.create(model=name(client), messages=ASK, tools=TOOLS, tool_choice="required",
                                         response_format={"type": "json_object"}, max_tokens=80, temperature=0,
                                         parallel_tool_calls=False)
    check_calls(out.choices[0].message.tool_calls)
    assert out.choices[0].finish_reason == "tool_calls"


def test_bad_tool_requests_are_400s(client):
    cases = [dict(tool_choice="required"),  # no tools
             dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
             dict(tools=TOOLS, tool_choice="required", extra_body={"structured_outputs": {"regex": "a+"}}),
             dict(tools=TOOLS, tool_choice="required",  # the answer format is checked, though a call is forced
                  response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
             dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
             dict(functions=[{"name": "f"}])]
    for extra in cases:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=name(client), messages=ASK, max_tokens=5, **extra)


# ---------------------------------------------------------------------------- the Responses API


def test_responses_create_and_stream(client):
    whole = client.responses.create(model=name(client), input="Say something", max_output_tokens=8, temperature=0)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output[0].type == "message" and whole.output_text
    assert whole.usage.output_tokens <= 8 and whole.usage.input_tokens > 0
    with client.responses.stream(model=name(client), input="Say something", max_output_tokens=8,
                                 temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    if whole.status == "completed":
        assert stream.get_final_response().output_text == whole.output_text


def test_responses_function_calls_and_their_results(client):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    out = client.responses.create(model=name(client), input="Weather?", tools=tools, tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    [call] = [item for item in out.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(model=name(client), input="Weather?", tools=tools, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=80, temperature=0) as stream:
        final = stream.get_final_response()
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    follow = client.responses.create(model=name(client), tools=tools, max_output_tokens=4, input=[
        {"role": "user", "content": "Weather?"}, *[item.model_dump(exclude_none=True) for item in out.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > out.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=name(client), input="x", previous_response_id=out.id)


# ---------------------------------------------------------------------------- other clients


class Verdict(BaseModel):
    verdict: bool
    score: int = Field(ge=0, le=9)


def test_langchain_bind_tools_and_structured_output(cluster):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=name(openai_client(cluster)), base_url=f"{cluster.url}/v1", api_key="x",
                                      temperature=0, max_tokens=80, max_retries=0)
    message = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke("Weather in Rome?")
    [call] = message.tool_calls
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    chunks = list(llm.bind_tools(TOOLS, tool_choice="get_time").stream("What time is it?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.tool_calls[0]["name"] == "get_time"
    jsonschema.validate(merged.tool_calls[0]["args"], TIME_ARGS)
    verdict = llm.with_structured_output(Verdict, method="function_calling").invoke("Is it good?")
    assert isinstance(verdict, Verdict) and 0 <= verdict.score <= 9


def test_litellm_tools(cluster):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    litellm = pytest.importorskip("litellm")
    out = litellm.completion(model=f"openai/{name(openai_client(cluster))}", api_base=f"{cluster.url}/v1",
                             api_key="x", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
                             temperature=0, parallel_tool_calls=False)
    [call] = out.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert out.choices[0].finish_reason == "tool_calls"


class Unit(str, enum.Enum):  # an Enum parameter: pydantic writes it as a $defs entry and a $ref
    celsius = "C"
    fahrenheit = "F"


WEATHER_CALLS: list[tuple[str, Unit]] = []


def get_weather(city: Literal["Paris", "Rome"], unit: Unit) -> openai_agents.ToolOutputText:
    """The weather in a city."""
    WEATHER_CALLS.append((city, Unit(unit)))
    return openai_agents.ToolOutputText(text=f"sunny in {city}, 21 {Unit(unit).value}")


def test_the_openai_agents_sdk_calls_a_strict_tool_with_an_enum_and_reads_its_result(cluster):
    """The Agents SDK's ``function_tool`` is strict and writes an Enum parameter as a ``$defs`` / ``$ref`` schema;
    its tool result goes back as a list of text parts on the Responses API. Both models (Chat Completions and
    Responses) run a turn forced to call the tool and a second turn that reads the result."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    globals()["openai_agents"] = agents  # what get_weather's return annotation names, read by function_tool

    if cluster.num_prefill == 0:
        pytest.skip("the client's side is the same on every shape: run on the 1P1D cluster only (suite time)")
    tool = agents.function_tool(get_weather)
    assert "$defs" in json.dumps(tool.params_json_schema) and tool.strict_json_schema
    client = AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0)
    model_name = name(openai_client(cluster))
    for model in (agents.OpenAIChatCompletionsModel(model=model_name, openai_client=client),
                  agents.OpenAIResponsesModel(model=model_name, openai_client=client)):
        agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[tool], model=model,
                             model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0))
        # the first turn must call the tool; the second (tool_choice reset to auto) reads its result and answers,
        # calls again or runs to max_tokens: a random model's choice (the SDK raises on the last two; a request it
        # sent that was refused would be a BadRequestError)
        WEATHER_CALLS.clear()
        try:
            agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=2,
                                   run_config=agents.RunConfig(tracing_disabled=True))
        except agents.MaxTurnsExceeded:
            pass
        except agents.ModelBehaviorError as exc:
            assert "max_output_tokens" in str(exc)
        assert WEATHER_CALLS and WEATHER_CALLS[0][0] in ("Paris", "Rome") and isinstance(WEATHER_CALLS[0][1], Unit)
