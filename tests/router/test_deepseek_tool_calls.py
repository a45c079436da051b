"""DeepSeek-V3's tool calls over real HTTP with the official openai client: a checkpoint whose tokenizer has
DeepSeek's markers as special tokens and whose chat template writes V3's layout (so ``auto`` picks the
``deepseek_v3`` parser), and a scripted worker that answers exactly the tokens of a text. The markers survive
detokenization (the parser needs them), calls come out whole and streamed alike, and V3.1's layout is read too."""

from __future__ import annotations

import json

import openai
import pytest

from pipeline.protocol.cluster import FinishCode
from router.served_model import load_served_model
from tests.router.conftest import RouterServer
from tests.router.fake_worker import tokens_script
from tests.router.test_tool_output import streamed
from tests.router.test_tool_parsers import DS_BLOCK, DS_BLOCK_END, DS_CALL, DS_CALL_END, DS_SEP, ds_v3, ds_v31

MAX_LENGTH = 4096
MARKERS = [DS_BLOCK, DS_BLOCK_END, DS_CALL, DS_CALL_END, DS_SEP]
TEMPLATE = ("{%- for message in messages %}<|{{ message.role }}|>{{ message.content or '' }}"
            "{%- for call in message.tool_calls or [] %}" + DS_BLOCK + DS_CALL + "{{ call.type }}" + DS_SEP
            + "{{ call.function.name }}\n```json\n{{ call.function.arguments }}\n```" + DS_CALL_END + DS_BLOCK_END
            + "{%- endfor %}{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "get_time")]
ASK = [{"role": "user", "content": "Weather and time?"}]


@pytest.fixture(scope="module")
def deepseek_model(tmp_path_factory):
    from transformers import AutoTokenizer

    from pipeline.builtin_model import build_checkpoint
    from tests.conftest import TINY_CONFIGS

    config = dict(TINY_CONFIGS["llama"])
    config["extra_vocab"] = config.get("extra_vocab", 0) + len(MARKERS)  # the markers' ids are inside the model
    path = build_checkpoint(tmp_path_factory.mktemp("deepseek-tools"), "llama", **config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(MARKERS, special_tokens=True)  # as in DeepSeek's tokenizer: skip_special_tokens drops them
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return load_served_model(str(path), max_length=MAX_LENGTH, name="tiny")


@pytest.fixture
def serve(deepseek_model):
    servers = []

    def make(text: str) -> openai.OpenAI:
        server = RouterServer(deepseek_model, config={"router": {"max_local_prefill_length": 0}}).start()
        servers.append(server)
        ids = deepseek_model.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert deepseek_model.tokenizer.convert_tokens_to_ids(DS_BLOCK) in ids  # one token, a special one
        server.add_worker(script=tokens_script(ids, finish=FinishCode.STOP), max_length=MAX_LENGTH)
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=10)

    yield make
    for server in servers:
        server.stop()


@pytest.mark.parametrize("calls", [
    ds_v3("get_weather", '{"city": "Paris"}') + "\n" + ds_v3("get_time", '{"zone": "UTC"}'),
    ds_v31("get_weather", '{"city": "Paris"}') + ds_v31("get_time", '{"zone": "UTC"}'),  # V3.1's layout
])
def test_deepseek_calls_are_read_whole_and_streamed(serve, calls):
    client = serve("Let me look." + DS_BLOCK + calls + DS_BLOCK_END)
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=400).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    want = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == want
    content, _, streamed_calls, finish = streamed(client, messages=ASK, tools=TOOLS, max_tokens=400)
    assert finish == "tool_calls" and content == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == want


def test_without_tools_the_markers_are_dropped_with_the_special_tokens(serve):
    client = serve("Plain." + DS_BLOCK + ds_v31("get_time", "{}") + DS_BLOCK_END)
    choice = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=400).choices[0]
    assert choice.message.tool_calls is None and DS_BLOCK not in choice.message.content
    assert choice.message.content.startswith("Plain.")
