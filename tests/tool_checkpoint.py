"""A tiny checkpoint whose chat template renders tools, tool calls, tool results and thinking the way
Qwen's do: ``<tool_call>`` / ``</tool_call>`` / ``<think>`` / ``</think>`` are added tokens that are not
special (they survive ``skip_special_tokens``, as in Qwen2.5 and Qwen3), tools are listed as JSON in
the system turn, and ``enable_thinking=False`` closes an empty thinking block in the generation prompt.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.builtin_model import build_checkpoint
from tests.conftest import TINY_CONFIGS

MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

TOOL_TEMPLATE = """
{%- if tools %}<|system|>
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
Call functions listed in <tools></tools> when they help:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Write each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call></s>
{% elif messages[0].role == 'system' %}<|system|>
{{ messages[0].content }}</s>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}<|user|>
<tool_response>
{{ message.content }}
</tool_response></s>
{% elif message.role == 'assistant' %}<|assistant|>
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}</s>
{% else %}<|{{ message.role }}|>
{{ message.content }}</s>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}
""".strip()


def build_tool_checkpoint(path: str | Path, architecture: str = "qwen2") -> Path:
    """The tiny ``architecture`` checkpoint with the markers added and the tool template set."""
    from transformers import AutoTokenizer

    config = dict(TINY_CONFIGS[architecture])
    config["extra_vocab"] = config.get("extra_vocab", 0) + len(MARKERS)  # the markers' ids are inside the model
    path = build_checkpoint(path, architecture, **config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(MARKERS)  # not special: the text keeps them, as Qwen's tokenizers do
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(path)
    return Path(path)
