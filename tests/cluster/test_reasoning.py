"""A reasoning model on a real cluster (1P1D, router with ``reasoning_parser: think``): the thinking lands in
``reasoning_content`` streamed or not, and a JSON schema constrains only what follows the thinking, the
prefill worker sampling the first token under the composed grammar and the decode worker continuing it.

The weights are random, so the prompt opens the thinking (``continue_final_message`` on an assistant turn
that starts with ``<think>``) and a logit bias on ``</think>`` makes the model close it after a few tokens.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.cluster.conftest import CLUSTER_CONFIG, openai_client, running_cluster, wait_for_idle_blocks
from tests.tool_checkpoint import build_tool_checkpoint

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {
    "ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}}}
THINKING = [{"role": "user", "content": "Is it fine?"}, {"role": "assistant", "content": "<think>\nLet me"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = str(build_tool_checkpoint(tmp_path_factory.mktemp("think-ckpt")))
    with running_cluster(path, tmp_path_factory.mktemp("think"), num_prefill=1, num_decode=1,
                         config={"router": {"reasoning_parser": "think"}}) as c:
        from transformers import AutoTokenizer

        c.end_id = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("</think>")
        yield c
        wait_for_idle_blocks(c.url, c.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"])


def ask(client, cluster, bias: float, max_tokens: int = 120, **extra):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=THINKING, max_tokens=max_tokens, temperature=0,
        logit_bias={str(cluster.end_id): bias},
        extra_body={"continue_final_message": True, "add_generation_prompt": False, **extra.pop("extra_body", {})},
        **extra)


def closing_bias(client, cluster) -> float:
    """The smallest bias (of a few) at which the greedy answer closes its thinking after some text."""
    for bias in (2.0, 4.0, 6.0, 8.0, 12.0):
        message = ask(client, cluster, bias).choices[0].message
        if message.model_extra["reasoning_content"] and message.content:
            return bias
    pytest.fail("no bias made the model close its thinking")


def test_thinking_lands_in_reasoning_content(cluster):
    client = openai_client(cluster)
    bias = closing_bias(client, cluster)
    message = ask(client, cluster, bias).choices[0].message
    reasoning, content = "", ""
    for chunk in ask(client, cluster, bias, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (message.model_extra["reasoning_content"], message.content)
    assert "</think>" not in reasoning  # the thinking ends at its first end tag


def test_a_schema_applies_after_the_thinking(cluster):
    client = openai_client(cluster)
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    for bias in (2.0, 4.0, 8.0, 12.0):
        out = ask(client, cluster, bias, response_format=response_format, max_tokens=200)
        choice = out.choices[0]
        if choice.finish_reason != "stop":
            continue  # still thinking at the token limit
        assert isinstance(choice.message.model_extra["reasoning_content"], str)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        return
    pytest.fail("the thinking never closed")
