"""Tokenizer loading, chat templates and UTF-8-safe incremental detokenization (torch-free).

All of it goes through transformers' AutoTokenizer, so every checkpoint's own tokenizer and chat
template are used as their authors wrote them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


class TokenizerError(ValueError):
    """The checkpoint has no usable tokenizer, or a chat template is missing."""


def load_tokenizer(model_path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except Exception as exc:  # transformers raises many types here; the user needs the path and the reason
        raise TokenizerError(f"cannot load a tokenizer from {model_path}: {exc}") from None


def eos_token_ids(tokenizer, hf_config: Any | None = None) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS plus the model config's eos_token_id(s)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(hf_config, "eos_token_id", None) if hf_config is not None else None
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, (list, tuple)):
        ids.update(int(i) for i in config_eos)
    return ids


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                        continue_final_message: bool = False, chat_template: str | None = None,
                        template_kwargs: dict[str, Any] | None = None,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat's token ids, as transformers' ``apply_chat_template`` makes them with the same options:
    ``continue_final_message`` leaves the last (assistant) message open for the model to continue,
    ``chat_template`` replaces the checkpoint's, ``template_kwargs`` reach the template (e.g. Qwen3's
    ``enable_thinking``), ``tools`` (OpenAI's function definitions) are rendered where the template says."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise TokenizerError("this model's tokenizer has no chat template; use /v1/completions with a raw prompt")
    if continue_final_message and add_generation_prompt:
        raise TokenizerError("continue_final_message and add_generation_prompt cannot both be true")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        continue_final_message=continue_final_message, chat_template=chat_template,
                                        tools=tools, **(template_kwargs or {}))
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without ever splitting a UTF-8 character.

    It re-decodes a short window of recent tokens (so tokenizers that change a piece's rendering by
    context, e.g. a leading space, stay right) and holds back text that ends in an incomplete
    character (U+FFFD) until the next token completes it. ``finish()`` flushes whatever remains, so
    the concatenated deltas equal ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, new_token_ids: Sequence[int]) -> str:
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=self._skip_special_tokens)
