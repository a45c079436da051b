"""Structured output through the cluster with the official openai client: response_format (and its
pydantic `parse` helper) on colocated and 1P1D (also with overlap, and speculating), where the prefill
worker samples the first token under the mask and the decode worker continues the same grammar; bad
constraints are 400s."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pipeline import LLM, SamplingParams
from pipeline.protocol import StructuredOutput
from tests.cluster.conftest import CLUSTER_CONFIG, running_cluster, wait_for_idle_blocks
from tests.pipeline.test_structured_output import BACKENDS, SCHEMAS

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"], "properties": {
    "city": {"type": "string", "maxLength": 8}, "rank": {"type": "integer", "minimum": 1, "maximum": 50},
    "tags": {"type": "array", "items": {"enum": ["old", "new"]}, "maxItems": 2}}}
SHAPES = {"colocated": dict(num_prefill=0, num_decode=0, num_colocated=1),
          "1p1d": dict(num_prefill=1, num_decode=1),
          "1p1d-overlap": dict(num_prefill=1, num_decode=1, config={"enable_overlap_scheduler": True}),
          # constrained requests speculate: the target drafts for itself within the grammar
          "1p1d-speculative": dict(num_prefill=1, num_decode=1, config={"speculative": {"num_speculative_tokens": 3}})}


class Answer(BaseModel):
    verdict: bool
    score: int = Field(ge=0, le=9)


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, tiny_checkpoint, tmp_path_factory):
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp(f"so-{request.param}"),
                         **SHAPES[request.param]) as c:
        c.engine_config = SHAPES[request.param].get("config", {})  # what an offline engine must match
        yield c


def test_json_schema_outputs_validate_greedy_and_sampled(cluster, client):
    model = client.models.list().data[0].id
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    for seed, temperature in [(None, 0.0), (1, 1.0), (2, 1.0)]:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Where?"}],
                                             response_format=response_format, temperature=temperature, seed=seed,
                                             max_tokens=200)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    stream = client.completions.create(model=model, prompt="Where?", max_tokens=200, temperature=1.0, seed=5,
                                       stream=True, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,5}!"}})
    assert re.fullmatch(r"[A-Z][a-z]{2,5}!", "".join(c.choices[0].text for c in stream if c.choices))
    out = client.completions.create(model=model, prompt="Well?", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"guided_choice": ["alpha", "beta"]})
    assert out.choices[0].text in ("alpha", "beta")
    wait_for_idle_blocks(cluster.url, [n for n in cluster.worker_names], CLUSTER_CONFIG["kv_cache"]["num_blocks"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_fuzzed_schema_greedy_and_sampled(client, name, backend):
    model = client.models.list().data[0].id
    extra = {"structured_outputs": {"json": SCHEMAS[name], "backend": backend}}
    for seed, temperature in [(None, 0.0), (11, 1.0)]:
        out = client.completions.create(model=model, prompt="Tell me", max_tokens=300, temperature=temperature,
                                        seed=seed, extra_body=extra)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS[name])


def test_a_seeded_constrained_request_matches_the_offline_engine(cluster, client, tiny_checkpoint, hf_reference):
    """The same tokens whether one process decodes it or a prefill worker samples the first token (an
    engine configured alike: speculation draws its samples differently, from the same distribution)."""
    tokenizer = hf_reference(tiny_checkpoint("llama"))[1]
    prompt_ids = tokenizer("Tell me")["input_ids"]
    spec = StructuredOutput(kind="json", value=json.dumps(SCHEMAS["array_enum"]))
    offline = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 128},
                  **cluster.engine_config).generate(
        [prompt_ids], SamplingParams(max_tokens=200, temperature=1.0, seed=21, structured_output=spec))[0]
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=prompt_ids, max_tokens=200, temperature=1.0, seed=21,
                                    extra_body={"structured_outputs": {"json": SCHEMAS["array_enum"]}})
    assert out.choices[0].text == offline.text


def test_the_openai_parse_helper_with_a_pydantic_model(client):
    model = client.models.list().data[0].id
    completion = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Judge."}],
                                               response_format=Answer, temperature=1.0, seed=4, max_tokens=100)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer) and 0 <= parsed.score <= 9


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "Invalid type: bogus"),
    ({"structured_outputs": {"regex": "[a-z"}}, "regex"),
    ({"structured_outputs": {"json": {"type": "object"}, "backend": "nope"}}, "unknown backend"),
    ({"structured_outputs": {"grammar": "root ::= undefined", "backend": "xgrammar"}}, "undefined"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, r"one output constraint, not 2 \(guided_regex, guided_choice\)"),
    ({"guided_regex": "[a-z"}, "guided_regex: "),  # the field the client sent
])
def test_bad_constraints_are_clear_400s(cluster, client, extra, message):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model=model, prompt="x", max_tokens=5, extra_body=extra)
    assert client.completions.create(model=model, prompt="x", max_tokens=3).choices[0].finish_reason == "length"
